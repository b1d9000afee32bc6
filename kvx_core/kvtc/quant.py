"""KVTC range quantizers: the byte layout of one range of PCA components for a batch of token rows.

- `int2` / `int4` / `int8`: per component (column) over the buffer's token rows, fp16 `min` and fp16 `step = (max -
  min) / (2^bits - 1)` (the range's metadata: `n` fp16 mins then `n` fp16 steps, once per buffer; the codes are
  computed against the fp16-rounded values the decoder uses), then per row the codes `round((y - min) / step)`
  packed LSB-first (element i of a byte at bits `bits * (i % per_byte)`); a constant column has step 0 and codes 0.
  Per-column metadata costs 4 bytes per component per buffer instead of 4 bytes per row per range.
- `fp8`: E4M3 codes of `y / scale` (a per-component scale from calibration: the component's calibration amax / 448;
  values beyond it saturate to +-448), no per-row metadata.
- `drop`: nothing stored, decoded as 0.
Torch ops only, so the same code runs on the CPU (reference) and on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvxError, Status

F16_MAX = 65504.0
E4M3_MAX = 448.0


@dataclass(frozen=True)
class RangeKind:
    name: str
    bits: int  # 0: dropped

    def __str__(self) -> str:
        return self.name

    @property
    def is_int(self) -> bool:
        return self.name.startswith("int")

    @staticmethod
    def parse(name: str) -> RangeKind:
        for k in KINDS:
            if k.name == name:
                return k
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"unknown KVTC range kind {name!r} (one of {', '.join(map(str, KINDS))})")


KINDS = (RangeKind("drop", 0), RangeKind("int2", 2), RangeKind("int4", 4), RangeKind("int8", 8), RangeKind("fp8", 8))


def range_bytes(kind: RangeKind, n: int) -> int:
    """Bytes one token row of an n-component range takes (IntX metadata, once per buffer, not counted)."""
    return (n * kind.bits + 7) // 8


def meta_bytes(kind: RangeKind, n: int) -> int:
    """Bytes of a range's per-buffer metadata (IntX: fp16 min and step per component)."""
    return 4 * n if kind.is_int else 0


def fp8_scales(y: torch.Tensor) -> torch.Tensor:
    """Per-component FP8 scales `amax / 448` of calibration projections `y [M, C]` (1 for all-zero components)."""
    amax = y.abs().amax(0).float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`[M, n]` codes < 2^bits -> `[M, n * bits / 8]` bytes, LSB-first."""
    per = 8 // bits
    m, n = codes.shape
    c = codes.to(torch.int32).view(m, n // per, per)
    shifts = (torch.arange(per, device=codes.device, dtype=torch.int32) * bits).view(1, 1, per)
    return (c << shifts).sum(-1).to(torch.uint8)


def _unpack(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    shifts = (torch.arange(per, device=data.device, dtype=torch.int32) * bits).view(1, 1, per)
    return ((data.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(data.shape[0], -1)[:, :n]


def column_meta(y: torch.Tensor, levels: torch.Tensor | int,
                is_int: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """IntX metadata of each column of `y [M, C]` (M > 0, finite): fp16 `min` and fp16 `step = (max - min) / levels`
    (`levels = 2^bits - 1`, per column or one for all). KvxError when an IntX column (all, or those `is_int` marks)
    exceeds fp16. Elementwise, so one call over many ranges' columns gives each range's own values: the CPU reference
    and the GPU codec share it."""
    lo, hi = torch.aminmax(y, dim=0)
    big = torch.maximum(lo.abs(), hi.abs()) > F16_MAX
    if bool((big if is_int is None else big & is_int).any()):
        raise KvxError(Status.OUT_OF_RANGE, "a KVTC component exceeds the fp16 range of its min / step")
    mn = lo.to(torch.float16)
    return mn, ((hi - mn.float()) / levels).to(torch.float16)


def pack_range(y: torch.Tensor, kind: RangeKind, mn: torch.Tensor | None, step: torch.Tensor | None,
               scale: torch.Tensor) -> torch.Tensor:
    """Rows `y [M, n]` of one kept range (float32) -> packed rows `[M, range_bytes(kind, n)]` uint8, given the range's
    fp16 `mn` / `step` (IntX) or fp32 `scale` (FP8). The reference of the Triton packer (`ops.triton.kvtc`)."""
    m, n = y.shape
    if not kind.is_int:
        q = (y / scale.to(y.device)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8)
    s = step.float()
    codes = torch.where(s > 0, torch.round((y - mn.float()) / torch.where(s > 0, s, 1.0)),
                        torch.zeros_like(y)).clamp(0, (1 << kind.bits) - 1)
    pad = (-n) % (8 // kind.bits)
    if pad:
        codes = torch.cat([codes, codes.new_zeros(m, pad)], dim=1)
    return _pack(codes, kind.bits)


def unpack_range(data: torch.Tensor, kind: RangeKind, n: int, mn: torch.Tensor | None, step: torch.Tensor | None,
                 scale: torch.Tensor) -> torch.Tensor:
    """`pack_range`'s packed rows -> float32 rows `[M, n]` (`mn + code * step`, two roundings; FP8: value * scale)."""
    if not kind.is_int:
        return data.contiguous().view(torch.float8_e4m3fn).float() * scale.to(data.device)
    return mn.float() + _unpack(data, kind.bits, n).float() * step.float()


def quantize_range(y: torch.Tensor, kind: RangeKind, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `y [M, n]` (float32, finite) of one range -> (metadata `[meta_bytes]` uint8, packed rows
    `[M, range_bytes(kind, n)]` uint8)."""
    m, n = y.shape
    none = torch.empty(0, dtype=torch.uint8, device=y.device)
    if kind.bits == 0:
        return none, torch.empty(m, 0, dtype=torch.uint8, device=y.device)
    if not kind.is_int:
        return none, pack_range(y, kind, None, None, scale)
    if m == 0:
        mn = step = torch.zeros(n, dtype=torch.float16, device=y.device)
    else:
        mn, step = column_meta(y, (1 << kind.bits) - 1)
    return torch.cat([mn, step]).view(torch.uint8), pack_range(y, kind, mn, step, scale)


def dequantize_range(meta: torch.Tensor, data: torch.Tensor, kind: RangeKind, n: int,
                     scale: torch.Tensor) -> torch.Tensor:
    """`quantize_range`'s (metadata, packed rows) -> float32 rows `[M, n]`."""
    if kind.bits == 0:
        return torch.zeros(data.shape[0], n, dtype=torch.float32, device=data.device)
    if not kind.is_int:
        return unpack_range(data, kind, n, None, None, scale)
    mn, step = meta.contiguous().view(torch.float16).view(2, n)
    return unpack_range(data, kind, n, mn, step, scale)
