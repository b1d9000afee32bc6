"""TGI's `KVCache` with KVX storage: one layer's dual data + scale pools in the run's KVX format.

Installed as `text_generation_server.layers.attention.kv_cache` (and re-exported by the attention module),
so TGI's `FlashCausalLM.init_kv_cache` builds these, one per layer, with its own arguments. TGI's model
files call `store(key=, value=, slots=, kv_scales=)` before attention; the K/V are quantized into the pools
by `kvx_core.ops.dispatch.write_kv` (the fused Triton write on CUDA, the torch reference on CPU).

Each cache is bound once (`dispatch.bind`: pools, scale arguments, global scales and key vectors derived and
checked when TGI builds it), and `store` and this backend's attention run on that bound layer (`layer`), so a
step's write launches the write kernel alone and a decode launches decode + merge. `bind` keeps copies of what it
derives (e.g. a per-tensor global scale expanded to every KV head) and the descriptor it was bound from, so the
layer is bound again whenever the global scales, key smoothing or centering change (`_apply_scales`, the
calibration below). Where the kernels cannot address the pools (CPU), `layer` is the descriptor itself.

KV calibration file (`calibration`): when the run has one, each layer takes its key smoothing, key centering and
global scales from it (they replace checkpoint scales), set before the first write.

Checkpoint KV scales: TGI's `get_kv_scales` reads `{prefix}.k_scale` / `v_scale` (FP8 convention
`amax / 448`, as vLLM and ModelOpt write them). Formats with a per-tensor global scale (fp8_*, nvfp4, k8v4)
take `global_scale_for_amax(amax)` from them; 1.0 / 1.0 means "no scales" (TGI's own rule) and
keeps the format's default global scale of 1.0. Formats with per-block scales only (int8, int4, mxfp4) find
their scales in the data and ignore checkpoint scales (logged once).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from loguru import logger
from text_generation_server.utils.log import log_once

from kvx_adapters.tgi import slots_from_tgi
from kvx_core.cache import PagedKVCache
from kvx_core.calibration import amax_from_kv_scale, global_scale_for_amax
from kvx_core.descriptors import CacheDesc, KvIoDesc, WriteDesc
from kvx_core.errors import Status, require
from kvx_core.kv_calibration import LayerValues
from kvx_core.ops import backends
from kvx_core.ops.dispatch import BoundLayer, bind, write_kv

from . import calibration, config


@dataclass
class KVScales:
    """A layer's checkpoint KV scales: the fields TGI's model files and attention functions read
    (`key_scale`/`value_scale` on the device, `*_cpu` floats for host-side decisions)."""

    key_scale: torch.Tensor
    value_scale: torch.Tensor
    calibration: LayerValues | None = None  # the run's KV calibration for this layer (`calibration`)
    key_scale_cpu: float = field(init=False)
    value_scale_cpu: float = field(init=False)

    def __post_init__(self) -> None:
        require(self.key_scale.numel() == 1 and self.value_scale.numel() == 1, Status.UNSUPPORTED,
                "checkpoint k_scale / v_scale must be scalars: the KVX TGI backend takes per-tensor KV scales")
        self.key_scale_cpu = float(self.key_scale.item())
        self.value_scale_cpu = float(self.value_scale.item())
        for name, v in (("k_scale", self.key_scale_cpu), ("v_scale", self.value_scale_cpu)):
            require(math.isfinite(v) and v > 0, Status.INVALID_ARGUMENT,
                    f"checkpoint {name} = {v}: KV scales must be finite and > 0 (amax / 448)")


def get_kv_scales(weights, prefix: str) -> KVScales:
    """The layer's `{prefix}.k_scale` / `v_scale` (or the older shared `kv_scale`), 1.0 when absent:
    the checkpoint names TGI reads."""
    one = torch.tensor(1.0, dtype=torch.float32, device=weights.device)
    cal = calibration.layer_values(weights, prefix)
    if weights.has_tensor(f"{prefix}.k_scale") and weights.has_tensor(f"{prefix}.v_scale"):
        k = weights.get_tensor(f"{prefix}.k_scale", to_dtype=False).float()
        v = weights.get_tensor(f"{prefix}.v_scale", to_dtype=False).float()
        return KVScales(k, v, cal)
    if weights.has_tensor(f"{prefix}.kv_scale"):
        kv = weights.get_tensor(f"{prefix}.kv_scale").float()
        return KVScales(kv, kv, cal)
    return KVScales(one, one, cal)


class KVCache:
    """One layer's KV cache over a KVX `PagedKVCache` (`cache`, its descriptor `desc`, and `layer`: what `store`
    and attention run on, the descriptor bound once or the descriptor itself).

    TGI constructs it with its own arguments (`dtype` = its cache dtype: the model dtype unless
    `--kv-cache-dtype`, which is refused) and calls only `store`; the KVX format of the run (`kvx_tgi.install`)
    decides the storage, and this backend's attention functions read it through `layer`. TGI's other
    `KVCache` members (`key`, `value`, `can_scale`, ...) serve its own attention kernels, which this backend
    replaces, so they are not provided.
    """

    layer: CacheDesc | BoundLayer

    def __init__(self, *, num_blocks: int, num_heads: int, head_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        run = config.current()
        run.check_cache_dtype(dtype)
        self.format = run.format
        self.format.check_head_dim(head_size)
        self.cache = PagedKVCache(self.format, num_layers=1, num_blocks=num_blocks, block_size=run.block_size,
                                  num_kv_heads=num_heads, head_dim=head_size, device=device,
                                  per_head_global_scale=calibration.active())
        self._scales: tuple[float, float] | None = None
        self._calibrated = False
        self.desc: CacheDesc = self.cache.descriptor(0)
        self._bind()
        geometry = backends.Geometry(num_heads, num_heads, head_size, run.block_size, dtype)  # dtype: the model's
        log_once(logger.info, f"KVX {self.format.name} on {device}: {backends.summary(self.format, device, geometry)}")

    def store(self, *, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, kv_scales: KVScales) -> None:
        """Quantize `[T, H, D]` K/V into the pools at TGI's int64 `slots` (one per token)."""
        self._apply_scales(kv_scales)
        write_kv(self.layer, WriteDesc(KvIoDesc(key, value), slots_from_tgi(slots)), check=False)

    def _bind(self) -> None:
        """`layer` = `desc` bound (PACKED tables: TGI's); done again whenever the descriptor's global scales or key
        vectors change, since `bind` holds copies of them."""
        self.layer = bind(self.desc) or self.desc

    # ------------------------------------------------------------ scales
    def _apply_scales(self, kv_scales: KVScales) -> None:
        """Set the pools' global scales from the checkpoint's once (before the first write; `fill_` with host
        floats, so a CUDA-graph capture may record it)."""
        if kv_scales.calibration is not None:
            self._apply_calibration(kv_scales.calibration, (kv_scales.key_scale_cpu, kv_scales.value_scale_cpu))
            return
        want = (kv_scales.key_scale_cpu, kv_scales.value_scale_cpu)
        if self._scales == want:
            return
        require(self._scales is None, Status.INVALID_ARGUMENT,
                f"this layer's KV scales changed from {self._scales} to {want} after K/V were written with the old "
                "ones")
        self._scales = want
        if want == (1.0, 1.0):
            return
        pools = self.cache.layers[0]
        fmt = self.format
        if not fmt.uses_global_scale:
            log_once(logger.info, f"KVX {fmt.name}: checkpoint k_scale/v_scale ignored (the format keeps per-block "
                                  "scales)")
            return
        for tf, g, s in ((fmt.k, pools.k_global, want[0]), (fmt.v, pools.v_global, want[1])):
            scale = global_scale_for_amax(tf, amax_from_kv_scale(torch.tensor([s])))
            if scale is not None:
                g.fill_(float(scale[0]))
        self._bind()

    def _apply_calibration(self, values: LayerValues, checkpoint: tuple[float, float]) -> None:
        """Set the layer's key smoothing, key centering and global scales from the run's calibration file once,
        before the first write (its scales replace a checkpoint's k_scale / v_scale, logged once)."""
        if self._calibrated:
            return
        if (values.k_global is not None or values.v_global is not None) and checkpoint != (1.0, 1.0):
            log_once(logger.info,
                     "KVX: the KV calibration file's global scales replace the checkpoint's k_scale / v_scale")
        values.apply(self.cache, 0)
        self.desc = self.cache.descriptor(0)
        self._bind()
        self._calibrated = True
