"""One vLLM instance's KV cache as the KVX handoff reads and writes it: export a sequence into a bundle, import a
bundle (or a slice of its tokens) into the cache, converting format, layout and block size on the way.

How each layer's cache is reached, by the attention implementation vLLM built for it:
- KVX pages (`kvx_*` dtypes): the backend's own zero-copy descriptor (`KvxAttentionImpl.cache_desc`).
- vLLM's FlashAttention / FlashInfer caches (`auto`; `fp8` with unit scales): `kvx_adapters.vllm` (vLLM 0.26 packs
  K and V into each token's row, `(blocks, heads, block_size, 2 * head_size)`; earlier releases stack them).
- vLLM CPU's `auto` cache: its K is packed in an ISA-specific tile layout (`cpu_attn_reshape_and_cache`, csrc/cpu),
  so it is not a strided tensor. `CpuPacking` learns the layout from vLLM's own writer (it writes probe tokens whose
  values are their own coordinates and reads back where each landed, checking that every coordinate lands exactly
  once); export gathers rows through that map into a staging cache, import converts into a staging cache and
  stores with vLLM's own writer. Nothing else is assumed about the packing.
Anything else (fp8 with calibrated scales, other backends) is refused at startup naming what is served.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, BinaryIO

import torch

from kvx_core.descriptors import CacheDesc
from kvx_core.enums import Layout
from kvx_core.errors import Status, require
from kvx_core.transfer import ModelFingerprint, export_bundle, import_bundle

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_PROBE_MAX = 256
"""Probe values are coordinates + 1; every integer up to 256 is exact in bf16 / fp16 / fp32."""


def _dense(k: torch.Tensor, v: torch.Tensor) -> CacheDesc:
    """A one-block HND staging cache over `k`, `v` `[1, H, T, D]`."""
    _, h, t, d = k.shape
    return CacheDesc.from_torch(k.contiguous(), v.contiguous(), block_size=t, num_kv_heads=h, head_dim=d,
                                k_layout=Layout.HND, v_layout=Layout.HND)


class CpuPacking:
    """Where vLLM CPU's writer puts each (token-in-block, head, dim) of K and of V within one block."""

    def __init__(self, isa: str, dtype: torch.dtype, num_kv_heads: int, block_size: int, head_dim: int):
        if max(num_kv_heads, block_size, head_dim) >= _PROBE_MAX:
            raise ValueError(f"KVX connector: cannot map vLLM CPU's {isa} cache layout for {num_kv_heads} heads x "
                             f"block {block_size} x head_dim {head_dim} (probe values must stay below {_PROBE_MAX})")
        self.isa, self.dtype, self.shape = isa, dtype, (num_kv_heads, block_size, head_dim)
        h, b, d = self.shape
        coords = torch.meshgrid(torch.arange(b), torch.arange(h), torch.arange(d), indexing="ij")  # [B, H, D] each
        seen = []
        for c in coords:  # token, head, dim: three probes, each value = coordinate + 1
            kc, vc = self._empty_block()
            x = (c + 1).to(dtype)
            self.write(kc, vc, x, x, torch.arange(b))
            seen.append((kc[0], vc[0]))
        self.k_where = self._inverse([s[0] for s in seen])
        self.v_where = self._inverse([s[1] for s in seen])

    def _empty_block(self) -> tuple[torch.Tensor, torch.Tensor]:
        h, b, d = self.shape
        return self.split(torch.zeros(1, h, b, 2 * d, dtype=self.dtype))

    @staticmethod
    def split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM CPU's K and V views of a layer's `[num_blocks, H, block_size, 2 * head_dim]` cache."""
        n, h, b, _ = kv_cache.shape
        return kv_cache.view(n, h, 2 * b, -1).chunk(2, dim=2)

    def write(self, key_cache, value_cache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store `k`, `v` `[T, H, D]` at `slots` with vLLM's own CPU writer."""
        from vllm import _custom_ops as ops

        ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache,
                                       slots.to(torch.int64), self.isa)

    def _inverse(self, probes: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """From the three probe blocks `[H, B, D]` (token+1, head+1, dim+1 at each stored position): index tensors
        `[B, H, D]` (h', b', d') of where token t, head h, dim d is stored; ValueError unless a bijection."""
        h, b, d = self.shape
        t_id, h_id, d_id = (p.to(torch.int64) - 1 for p in probes)
        written = (t_id >= 0) & (h_id >= 0) & (d_id >= 0)
        pos = written.nonzero()  # [n, 3] = (h', b', d')
        t, hh, dd = t_id[written], h_id[written], d_id[written]
        key = (t * h + hh) * d + dd
        if pos.shape[0] != h * b * d or torch.unique(key).numel() != h * b * d:
            raise ValueError(f"KVX connector: vLLM CPU's {self.isa} writer did not store each of the {h * b * d} "
                             "values of a block exactly once; its cache layout cannot be mapped")
        out = []
        for col in range(3):
            m = torch.empty(b * h * d, dtype=torch.int64)
            m[key] = pos[:, col]
            out.append(m.view(b, h, d))
        return tuple(out)

    def read(self, cache: torch.Tensor, where: tuple[torch.Tensor, ...], slots: torch.Tensor) -> torch.Tensor:
        """Rows `[T, H, D]` of `slots` from vLLM CPU's K or V view `cache`."""
        b = self.shape[1]
        blk, off = (slots // b).view(-1, 1, 1), slots % b
        return cache[blk, where[0][off], where[1][off], where[2][off]]


def layer_isa(layer: Any) -> str:
    """The ISA of a vLLM CPU attention layer's cache writer: `layer.isa` from vLLM 0.29 (set by the CPU metadata
    builder), else its impl's (0.26-0.28 set it there only)."""
    return getattr(layer, "isa", None) or layer.impl.isa


class LayerCaches:
    """The KV caches of one vLLM worker's attention layers, in layer order, for export and import."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layers: dict[str, Any], cache_dtype: str):
        from vllm.model_executor.models.utils import extract_layer_index

        self.names = sorted(kv_caches, key=extract_layer_index)
        self.kv = [kv_caches[n] for n in self.names]
        self.layers = [layers[n] for n in self.names]
        self.cache_dtype = cache_dtype
        self.kind = _kind(self.layers[0], cache_dtype)
        self._packing: CpuPacking | None = None
        self._descs: list[CacheDesc] | None = None

    def packing(self) -> CpuPacking:
        if self._packing is None:
            n, h, b, c = self.kv[0].shape
            self._packing = CpuPacking(layer_isa(self.layers[0]), self.kv[0].dtype, h, b, c // 2)
        return self._packing

    def descs(self) -> list[CacheDesc]:
        """Zero-copy descriptors of every layer (not for vLLM CPU's packed cache), built on first use: the cache
        tensors vLLM registered never move."""
        if self._descs is None:
            if self.kind == "kvx":
                self._descs = [layer.impl.cache_desc(layer, kv) for layer, kv in zip(self.layers, self.kv, strict=True)]
            else:
                from kvx_adapters.vllm import from_vllm_kv_cache, from_vllm_packed_kv_cache

                dtype = _FP8.get(self.cache_dtype)
                self._descs = [from_vllm_packed_kv_cache(kv, cache_dtype=dtype) if kv.dim() == 4  # 0.26: K|V rows
                               else from_vllm_kv_cache(kv, backend=self.kind, cache_dtype=dtype) for kv in self.kv]
        return self._descs

    def export_source(self, slots: torch.Tensor) -> tuple[list[CacheDesc], torch.Tensor]:
        """The caches and slots to export the tokens at `slots` (sequence order) from: the cache itself, or for vLLM
        CPU's packed cache, dense copies of those tokens."""
        if self.kind != "cpu":
            return self.descs(), slots
        p, staged = self.packing(), []
        for kv in self.kv:
            kc, vc = p.split(kv)
            k, v = p.read(kc, p.k_where, slots), p.read(vc, p.v_where, slots)
            staged.append(_dense(k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)))
        return staged, torch.arange(slots.numel())

    def export(self, out: BinaryIO, slots: torch.Tensor, *, model: ModelFingerprint, token_ids: Sequence[int],
               kv_heads: tuple[int, int] | None = None) -> dict:
        """Write the bundle of the tokens at `slots` (sequence order); `kv_heads`: the model's KV heads this cache
        holds (a tensor-parallel rank's), default all."""
        caches, at = self.export_source(slots)
        return export_bundle(out, caches, at, model=model, token_ids=token_ids, kv_heads=kv_heads)

    def load(self, src: BinaryIO | torch.Tensor | Sequence[BinaryIO | torch.Tensor], slots: torch.Tensor, *,
             model: ModelFingerprint, token_ids: Sequence[int], token_range: tuple[int, int],
             kv_heads: tuple[int, int] | None = None) -> None:
        """Store the bundled tokens `token_range` at `slots`, converted into this cache, from a bundle or the
        shards of a tensor-parallel producer (`kv_heads`: the model's KV heads this cache holds); all or nothing."""
        if self.kind != "cpu":
            import_bundle(src, self.descs(), slots, model=model, token_ids=token_ids, token_range=token_range,
                          kv_heads=kv_heads)
            return
        p = self.packing()
        h, b, d = p.shape
        t = slots.numel()
        capacity = self.kv[0].shape[0] * b  # vLLM's writer is not bounds-checked: slots are, before anything runs
        require(t == 0 or (int(slots.min()) >= 0 and int(slots.max()) < capacity), Status.OUT_OF_RANGE,
                f"KVX connector: slots must lie in [0, {capacity})")
        staged = [_dense(torch.zeros(1, h, t, d, dtype=p.dtype), torch.zeros(1, h, t, d, dtype=p.dtype))
                  for _ in self.kv]
        import_bundle(src, staged, torch.arange(t), model=model, token_ids=token_ids, token_range=token_range,
                      kv_heads=kv_heads)
        for kv, s in zip(self.kv, staged, strict=True):  # every layer converted and checked: now store
            kc, vc = p.split(kv)
            p.write(kc, vc, s.k.tensor[0].transpose(0, 1), s.v.tensor[0].transpose(0, 1), slots)


def _kind(layer: Any, cache_dtype: str) -> str:
    """How a layer's cache is reached: "kvx", "cpu", "flash_attn" or "flashinfer"; ValueError otherwise."""
    impl = type(layer.impl).__name__
    if impl == "KvxAttentionImpl":
        return "kvx"
    if cache_dtype in _FP8 and (float(layer._k_scale_float) != 1.0 or float(layer._v_scale_float) != 1.0):
        raise ValueError(f"KVX connector: --kv-cache-dtype {cache_dtype} with calibrated k/v scales is not served "
                         "(the bundle carries FP8 values without vLLM's per-layer scale); use auto or a kvx_* dtype")
    kinds = {"CPUAttentionBackendImpl": ("cpu", ("auto",)),
             "FlashAttentionImpl": ("flash_attn", ("auto", *_FP8)), "FlashInferImpl": ("flashinfer", ("auto", *_FP8))}
    if impl in kinds and cache_dtype in kinds[impl][1]:
        return kinds[impl][0]
    raise ValueError(f"KVX connector: the {impl} attention backend with --kv-cache-dtype {cache_dtype} is not "
                     "served; the connector reads kvx_* pages, vLLM's FlashAttention / FlashInfer caches (auto, "
                     "fp8) and vLLM CPU's auto cache")
