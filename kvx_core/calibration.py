"""Global K/V scales for the formats that use one (FP8, NVFP4, and K8V4's two halves).

A global scale maps a layer's K (or V) range onto the format's range: FP8 stores `x / g` with
`g = amax / fp8_max`; NVFP4 uses `g = amax / (6 * 448)` so the largest E4M3 group scale is 448.
Scales come from calibration or from a checkpoint's `k_scale` / `v_scale`, which follow vLLM / ModelOpt's FP8
convention `amax / 448`. Two calibration rules:
- "amax" (`AmaxObserver`, `global_scale_for_amax`): the running amax over calibration tokens, mapped as above.
- "mse" (`SampleObserver.global_scales(fmt, rule="mse")`): per KV head, the candidate scale whose encode -> decode
  of the calibration values has the least squared error (`mse_global_scale`). NVFP4: `g_amax * 2^(j / 4)`,
  j = -24..4 (the amax rule's scale is one of them). FP8: the powers of two from 6 octaves below to 1 above the
  amax scale's: scaling by a power of two is exact, and on SmolLM2 every non-power-of-two FP8 scale measured worse
  than 1.0 (docs/results.md "Calibration").
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from .allocator import as_int
from .errors import Status, require
from .formats import CacheFormat, TensorFormat
from .formats.base import to_f32_saturated

_FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
_NVFP4_RANGE = 6.0 * 448.0
_CKPT_FP8_MAX = 448.0  # checkpoint k_scale/v_scale are amax / 448 (vLLM, ModelOpt)


def global_scale_for_amax(tf: TensorFormat, amax: torch.Tensor) -> torch.Tensor | None:
    """FP32 global scale of one tensor format for an observed amax (None if the format has none).

    A zero amax (a tensor that was never non-zero) keeps scale 1.0.
    """
    if not tf.uses_global_scale:
        return None
    require(isinstance(amax, torch.Tensor) and amax.is_floating_point(), Status.INVALID_ARGUMENT,
            f"calibration amax must be a float tensor, got {type(amax).__name__}")
    a = amax.to(torch.float32)
    require(bool(torch.isfinite(a).all()), Status.INVALID_ARGUMENT, "calibration amax must be finite")
    rng = _FP8_MAX.get(tf.name, _NVFP4_RANGE)
    return torch.where(a > 0, a / rng, torch.ones_like(a))


def amax_from_kv_scale(scale: torch.Tensor, what: str = "k_scale / v_scale") -> torch.Tensor:
    """Amax (flattened fp32) from a checkpoint's `k_scale` / `v_scale`, FP8 convention `amax / 448`. A NaN,
    infinite or negative scale is refused (KvxError naming `what`): `global_scale_for_amax` would silently make a
    negative one 1.0."""
    t = scale.detach().float().reshape(-1)
    require(bool(torch.isfinite(t).all() and (t >= 0).all()), Status.INVALID_ARGUMENT,
            f"checkpoint {what} must be finite and >= 0 (amax / 448), got {t[:4].tolist()}")
    return t * _CKPT_FP8_MAX


class AmaxObserver:
    """Running per-layer amax of K and V (per tensor, or per KV head) over calibration tokens."""

    def __init__(self, num_layers: int, num_kv_heads: int = 1, per_head: bool = False) -> None:
        require(isinstance(per_head, bool), Status.INVALID_ARGUMENT, f"per_head must be a bool, got {per_head!r}")
        layers, heads = as_int(num_layers, "num_layers", 1), as_int(num_kv_heads, "num_kv_heads", 1)
        self.amax = torch.zeros((layers, 2, heads if per_head else 1), dtype=torch.float32)
        self.per_head = per_head

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Fold `[..., H, D]` K/V into the layer's amax (non-finite values are rejected; empty batches add
        nothing). K and V are both checked before either is folded in."""
        num_layers, _, width = self.amax.shape
        layer = as_int(layer, "layer")
        require(0 <= layer < num_layers, Status.OUT_OF_RANGE, f"layer {layer} out of range [0, {num_layers})")
        amax = [self._batch_amax(layer, name, x) for name, x in (("K", key), ("V", value))]
        for i, a in enumerate(amax):
            if a is not None:
                self.amax[layer, i] = torch.maximum(self.amax[layer, i], a)

    def _batch_amax(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """Checked amax of one K or V batch, `[1]` or `[H]` on the CPU (None for an empty batch)."""
        width = self.amax.shape[-1]
        require(isinstance(x, torch.Tensor) and x.is_floating_point(), Status.INVALID_ARGUMENT,
                f"layer {layer}: {name} must be a floating-point torch.Tensor, got {type(x).__name__}")
        x = x.detach()
        require(not self.per_head or (x.dim() >= 2 and x.shape[-2] == width), Status.INVALID_ARGUMENT,
                f"layer {layer}: per-head observer of {width} KV heads got K/V of shape {tuple(x.shape)}")
        require(bool(torch.isfinite(x).all()), Status.INVALID_ARGUMENT,
                f"layer {layer}: non-finite {name} values in calibration data")
        if x.numel() == 0:
            return None
        x = to_f32_saturated(x)  # finite FP64 beyond FP32 counts as FP32 max, as the formats encode it
        a = x.abs().amax(dim=-1).reshape(-1, x.shape[-2]).amax(dim=0) if self.per_head else x.abs().amax().reshape(1)
        return a.cpu()

    def global_scales(self, fmt: CacheFormat) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per layer `(k_global, v_global)` for `fmt` (None where its K or V format has no global scale)."""
        return [(global_scale_for_amax(fmt.k, a[0]), global_scale_for_amax(fmt.v, a[1])) for a in self.amax]


_KV_SCALE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\..*\b([kv])_scale$")


def amax_from_checkpoint(state_dict: Mapping[str, torch.Tensor], num_layers: int) -> torch.Tensor | None:
    """Per-layer `[num_layers, 2, 1|H]` amax from a checkpoint's `...layers.{i}...k_scale` / `v_scale`
    tensors (FP8 convention `amax / 448`), or None if the checkpoint has none. Partial sets are an error, and so is
    a NaN, infinite or negative scale (`amax_from_kv_scale`)."""
    num_layers = as_int(num_layers, "num_layers", 1)
    require(isinstance(state_dict, Mapping), Status.INVALID_ARGUMENT,
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    found: dict[tuple[int, int], torch.Tensor] = {}
    for key, t in state_dict.items():
        m = _KV_SCALE_KEY.search(key) if isinstance(key, str) else None
        if m:
            require(int(m.group(1)) < num_layers, Status.INVALID_ARGUMENT,
                    f"checkpoint key {key!r} names a layer beyond the model's {num_layers}")
            require(isinstance(t, torch.Tensor) and t.is_floating_point(), Status.INVALID_ARGUMENT,
                    f"checkpoint {key!r} must be a float tensor, got {type(t).__name__}")
            found[(int(m.group(1)), 0 if m.group(2) == "k" else 1)] = amax_from_kv_scale(t, repr(key))
    if not found:
        return None
    missing = [(i, "kv"[j]) for i in range(num_layers) for j in range(2) if (i, j) not in found]
    require(not missing, Status.INVALID_ARGUMENT,
            f"checkpoint has k_scale/v_scale for some layers but not {missing[:4]}...; provide all or none")
    width = max(t.numel() for t in found.values())
    require(all(t.numel() in (1, width) for t in found.values()), Status.INVALID_ARGUMENT,
            f"checkpoint k_scale/v_scale must be per tensor (1 value) or per KV head ({width} values), "
            f"got sizes {sorted({t.numel() for t in found.values()})}")
    out = torch.empty(num_layers, 2, width)
    for (i, j), t in found.items():
        out[i, j] = t.expand(width) if t.numel() == 1 else t
    return out


SCALE_RULES = ("amax", "mse")
MSE_STEPS = range(-24, 5)
"""Candidate exponents of `mse_global_scale`, in quarter octaves (NVFP4) or octaves (FP8) from its anchor."""


def mse_global_scale(tf: TensorFormat, x: torch.Tensor) -> torch.Tensor | None:
    """Per-head FP32 global scale `[H]` of `tf` for calibration values `x [T, H, D]` with the least sum over tokens
    and dims of (x - decode(encode(x, g)))^2 among `anchor * 2^(j * step)`: NVFP4 anchor g_amax, step 1/4, j in
    `MSE_STEPS`; FP8 anchor 2^floor(log2(g_amax)), step 1, j in -6..1 (powers of two). Ties: the smaller scale.
    None if `tf` has no global scale."""
    if not tf.uses_global_scale:
        return None
    require(isinstance(x, torch.Tensor) and x.dim() == 3 and x.is_floating_point(), Status.INVALID_ARGUMENT,
            f"calibration values must be a float tensor [T, H, D], got {getattr(x, 'shape', type(x).__name__)}")
    x = to_f32_saturated(x.detach().float())
    require(bool(torch.isfinite(x).all()), Status.INVALID_ARGUMENT, "calibration values must be finite")
    g_amax = global_scale_for_amax(tf, x.abs().amax(dim=(0, 2)))
    if tf.name in _FP8_MAX:
        anchor, exps = torch.exp2(torch.floor(torch.log2(g_amax))), [float(j) for j in range(-6, 2)]
    else:
        anchor, exps = g_amax, [j / 4 for j in MSE_STEPS]
    best_err = torch.full_like(g_amax, float("inf"))
    best = g_amax.clone()
    for e in exps:
        g = anchor * 2.0 ** e
        payload, scales = tf.encode(x, g)
        err = ((tf.decode(payload, scales, g) - x) ** 2).sum(dim=(0, 2))
        better = err < best_err
        best = torch.where(better, g, best)
        best_err = torch.where(better, err, best_err)
    return best


class SampleObserver:
    """Calibration K/V values per layer (FP32 on the CPU, up to `max_tokens` per layer), for scale rules that need
    the values, not only their amax: `global_scales(fmt, rule)` per KV head."""

    def __init__(self, num_layers: int, max_tokens: int = 8192) -> None:
        self.num_layers = as_int(num_layers, "num_layers", 1)
        self.max_tokens = as_int(max_tokens, "max_tokens", 1)
        self.samples: list[list[torch.Tensor]] = [[] for _ in range(self.num_layers)]  # per layer: [K, V] chunks

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep `[..., H, D]` K/V of a layer (checked finite, both before either is kept; beyond `max_tokens` the
        rest is dropped)."""
        layer = as_int(layer, "layer")
        require(0 <= layer < self.num_layers, Status.OUT_OF_RANGE, f"layer {layer} out of range [0, {self.num_layers})")
        pair = []
        for name, x in (("K", key), ("V", value)):
            require(isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2, Status.INVALID_ARGUMENT,
                    f"layer {layer}: {name} must be a float tensor [..., H, D], "
                    f"got {getattr(x, 'shape', type(x).__name__)}")
            require(bool(torch.isfinite(x).all()), Status.INVALID_ARGUMENT,
                    f"layer {layer}: non-finite {name} values in calibration data")
            pair.append(x.detach().reshape(-1, *x.shape[-2:]).float().cpu())
        have = sum(c[0].shape[0] for c in self.samples[layer])
        room = self.max_tokens - have
        if room > 0:
            self.samples[layer].append(tuple(t[:room] for t in pair))

    def values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's kept K and V, `[T, H, D]` each."""
        chunks = self.samples[layer]
        require(bool(chunks), Status.INVALID_ARGUMENT, f"layer {layer}: no calibration values observed")
        return torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])

    def global_scales(self, fmt: CacheFormat, rule: str = "mse", progress: Callable[[int], None] | None = None
                      ) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per layer `(k_global, v_global)`, `[H]` each, by `rule` ("amax" or "mse"); None where the format has
        none. `progress(layer)` after each layer (the MSE fit takes seconds per layer)."""
        require(rule in SCALE_RULES, Status.INVALID_ARGUMENT, f"scale rule must be one of {SCALE_RULES}, got {rule!r}")
        out = []
        for layer in range(self.num_layers):
            pair = []
            for tf, x in zip((fmt.k, fmt.v), self.values(layer), strict=True):
                if rule == "mse":
                    pair.append(mse_global_scale(tf, x))
                else:
                    pair.append(global_scale_for_amax(tf, to_f32_saturated(x).abs().amax(dim=(0, 2))))
            out.append(tuple(pair))
            if progress is not None:
                progress(layer)
        return out


def stored_values(obs: SampleObserver, smoothing: list[torch.Tensor] | None = None,
                  rotate: bool = False, center: list[torch.Tensor] | None = None) -> SampleObserver:
    """The observer's K/V as a cache stores them, for fitting global scales: keys minus each layer's centering
    vector `[H, D]`, divided by its smoothing vector, then K and V rotated (`formats.rotation`) for a `_rot`
    format."""
    from .ops.rotation import rotate as hadamard_rotate

    out = SampleObserver(obs.num_layers, obs.max_tokens)
    for layer in range(obs.num_layers):
        k, v = obs.values(layer)
        if center is not None:
            k = k - center[layer]
        if smoothing is not None:
            k = k / smoothing[layer]
        out.observe(layer, *((hadamard_rotate(k), hadamard_rotate(v)) if rotate else (k, v)))
    return out


def key_smoothing(keys: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Per-channel key smoothing (`ops.smoothing`) from calibration keys `[T, H, D]`: `s = (amax_c / g_h) ** alpha`,
    `amax_c` a channel's max |K| over the tokens (floored at 2**-20 of its head's largest, so an all-zero channel
    gets a small finite s), `g_h` the geometric mean of the head's `amax` (so s is ~1 overall and the attention logits
    keep their scale). alpha 0 is no smoothing, 1 flattens every channel to the same max; 0.25-0.5 measured best on
    SmolLM2 (docs/results.md "Calibration"). FP32 `[H, D]`."""
    require(isinstance(keys, torch.Tensor) and keys.dim() == 3 and keys.shape[0] > 0 and keys.is_floating_point(),
            Status.INVALID_ARGUMENT, "key_smoothing expects float keys [tokens > 0, heads, head_dim]")
    require(isinstance(alpha, (int, float)) and 0.0 <= float(alpha) <= 1.0, Status.INVALID_ARGUMENT,
            f"alpha must be in [0, 1], got {alpha!r}")
    amax = keys.detach().abs().float().amax(0)
    require(bool(torch.isfinite(amax).all()), Status.INVALID_ARGUMENT, "calibration keys hold NaN or inf")
    top = amax.amax(-1, keepdim=True)
    require(bool((top > 0).all()), Status.INVALID_ARGUMENT, "a KV head's calibration keys are all zero")
    amax = torch.maximum(amax, top * 2.0 ** -20)
    g = amax.log().mean(-1, keepdim=True).exp()
    return ((amax / g) ** float(alpha)).contiguous()


def key_center(keys: torch.Tensor) -> torch.Tensor:
    """Per-channel key centering (`ops.smoothing`) from calibration keys `[T, H, D]`: each (KV head, channel)'s mean
    over the tokens, FP32 `[H, D]` (the cache stores `K - c`; attention is shift invariant). The mean, not the
    midrange: the slow RoPE channels sit at an offset with a spread around it, and the mean minimises the squared
    distance the quantizer is left with. Fit `key_smoothing` on the centered keys."""
    require(isinstance(keys, torch.Tensor) and keys.dim() == 3 and keys.shape[0] > 0 and keys.is_floating_point(),
            Status.INVALID_ARGUMENT, "key_center expects float keys [tokens > 0, heads, head_dim]")
    c = keys.detach().double().mean(0).float()
    require(bool(torch.isfinite(c).all()), Status.INVALID_ARGUMENT, "calibration keys hold NaN or inf")
    return c.contiguous()


def key_transform(obs: SampleObserver, alpha: float | None = None, center: bool = False
                  ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """Per layer `(smoothing, centering)` vectors `[H, D]` fitted on the observer's keys, None for one not asked
    for: centering `key_center(K)` when `center`, smoothing `key_smoothing(K - c, alpha)` when `alpha` is given
    (fitted on the centered keys, which is what the quantizer then sees). One rule for `kvx demo` and
    `kvx calibrate-kv`, so a file serves what the demo measured."""
    layers = range(obs.num_layers)
    centers = [key_center(obs.values(i)[0]) for i in layers] if center else None
    smooth = None if alpha is None else [
        key_smoothing(obs.values(i)[0] - (0 if centers is None else centers[i]), alpha) for i in layers]
    return smooth, centers
