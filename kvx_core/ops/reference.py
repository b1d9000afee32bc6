"""Reference `write_kv` / `gather_kv` in torch (any device): the oracle for every kernel and the CPU path.

Every cache format goes through the same two functions: the format (from the cache descriptor)
encodes new tokens into the data pool and the scale pool at the same (block, offset), and decodes
them back. Plain F16/BF16/F32 caches are the identity format (spec §4.3 baseline); v1.0 FP8 caches
take their per-tensor scale from the write descriptor; v1.1 caches carry a quantization descriptor.
Gathered K/V are always in the model's domain (a Hadamard rotation is undone).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..block_tables import resolve_tokens
from ..descriptors import CacheDesc, GatherDesc, KvIoDesc, ScaleDesc, WriteDesc
from ..enums import QUANT_FLAG_V_SCALE_INTERLEAVE4, QuantFormat
from ..errors import Status, require
from ..formats import CacheFormat, TensorFormat
from ..layouts import block_view
from ..scale_layout import Interleave4Rows
from . import smoothing
from .checks import check_gather, check_write
from .rotation import rotate


@dataclass
class _Pools:
    """One of K or V: its tensor format and its 5-D data and scale views."""

    fmt: TensorFormat
    data: torch.Tensor  # [N, B, H, Dp, pack]
    scales: torch.Tensor | Interleave4Rows | None  # [N, B, H, S, 1], indexed [block, offset]


def side_pools(cache: CacheDesc, fmt: CacheFormat, which: str) -> _Pools:
    """K ("k") or V ("v") of `cache`: its tensor format and 5-D data / scale views (raw row access by slot);
    V scales interleaved by 4 tokens (`QUANT_FLAG_V_SCALE_INTERLEAVE4`) are read and written through their rows."""
    desc = cache.k if which == "k" else cache.v
    q = cache.quant
    scales = getattr(q, f"{which}_scales") if q is not None else None
    if scales is None:
        rows = None
    elif which == "v" and q.flags & QUANT_FLAG_V_SCALE_INTERLEAVE4:
        rows = Interleave4Rows(scales.tensor.view(torch.uint8))
    else:
        rows = block_view(scales.tensor.view(torch.uint8), scales.layout)
    return _Pools(fmt.k if which == "k" else fmt.v, block_view(desc.tensor, desc.layout), rows)


@torch.no_grad()
def write_kv(cache: CacheDesc, write: WriteDesc) -> None:
    """Encode `write.io` K/V in the cache's format and scatter payload and scales by slot mapping;
    invalid (negative) slots are no-ops. All or nothing: every argument is checked and both sides are
    encoded before the first byte is stored, so a rejected write leaves the pools as they were."""
    plan = check_write(cache, write)
    fmt, a = plan.fmt, plan.args
    slots = a.slots[a.keep]
    blk, off = slots // cache.block_size, slots % cache.block_size
    sides = [(side_pools(cache, fmt, "k"), smoothing.smooth_keys(cache, write.io.key), a.k_gs),
             (side_pools(cache, fmt, "v"), write.io.value, a.v_gs)]
    encoded = [p.fmt.encode(rotate(x[a.keep]) if fmt.rotate else x[a.keep], g) for p, x, g in sides]
    for (p, _, _), (payload, scales) in zip(sides, encoded, strict=True):
        p.data[blk, off] = payload.reshape(-1, *p.data.shape[2:])
        if p.scales is not None:
            p.scales[blk, off] = scales.reshape(-1, *p.scales.shape[2:])


@torch.no_grad()
def gather_kv(cache: CacheDesc, gather: GatherDesc, out: KvIoDesc | None = None,
              out_dtype: torch.dtype | None = None, k_scale: ScaleDesc | None = None,
              v_scale: ScaleDesc | None = None) -> KvIoDesc:
    """Gather and decode `min(seq_len, max_seq_len)` tokens of each sequence into ragged dense
    `[T, H, D]` K/V (FP32 for quantized caches unless `out_dtype`/`out` say otherwise).

    Sequences are concatenated in order (beams of a KV_OFFSETS table are separate sequences);
    `gather.output_lengths()` gives each one's token count. `k_scale`/`v_scale` are the per-tensor
    scales of a v1.0 FP8 cache (as in its write descriptor).
    """
    plan = check_gather(cache, gather, out, out_dtype, k_scale, v_scale)
    fmt = plan.fmt
    # None: no secondary pool, so resolve_tokens rejects references to it (INVALID_ARGUMENT)
    n2 = None if cache.pool is None or cache.pool.secondary is None else int(cache.pool.secondary.shape[0])
    addr = resolve_tokens(gather.block_table, gather.seq_lens, plan.max_seq_len, cache.block_size,
                          cache.num_blocks, n2)
    total = plan.total
    h, d = cache.num_kv_heads, cache.head_dim
    sides = (("k", addr.k_blocks, addr.k_secondary, plan.k_gs), ("v", addr.v_blocks, addr.v_secondary, plan.v_gs))
    if any(bool(sec.any()) for _, _, sec, _ in sides):
        require(cache.quant is None, Status.UNSUPPORTED,
                "secondary (host) pools are defined for unquantized caches only in KVX v1.1")
        _check_secondary(cache)
    if out is None:
        dt = out_dtype or (cache.k.tensor.dtype if fmt.quant == QuantFormat.NONE else torch.float32)
        dev = cache.k.tensor.device
        out = KvIoDesc(torch.empty(total, h, d, dtype=dt, device=dev), torch.empty(total, h, d, dtype=dt, device=dev))
    for (which, blocks, sec, g), dst in zip(sides, (out.key, out.value), strict=True):
        p = side_pools(cache, fmt, which)
        if bool(sec.any()):
            data = _with_secondary(cache, which, p.data, blocks, sec, addr.offsets)
        else:
            data = p.data[blocks, addr.offsets]
        scales = p.scales[blocks, addr.offsets].flatten(-2) if p.scales is not None else \
            torch.empty(total, h, 0, dtype=torch.uint8, device=data.device)
        x = p.fmt.decode(data.flatten(-2), scales, g)
        x = rotate(x) if fmt.rotate else x
        dst[:total] = (smoothing.unsmooth_keys(cache, x) if which == "k" else x).to(dst.dtype)
    return out


def _check_secondary(cache: CacheDesc) -> None:
    """The secondary pool a table references (`resolve_tokens` checked it exists) has each primary's dtype
    and block shape."""
    second = cache.pool.secondary
    for desc in (cache.k, cache.v):
        require(second.dtype == desc.tensor.dtype and tuple(second.shape[1:]) == tuple(desc.shape[1:]),
                Status.INVALID_ARGUMENT, f"pool.secondary must have the primary's dtype and block shape "
                f"{tuple(desc.shape[1:])}, got {second.dtype} {tuple(second.shape)}")


def _with_secondary(cache: CacheDesc, which: str, primary: torch.Tensor, blocks: torch.Tensor,
                    sec: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of the primary pool, with those flagged secondary read from `pool.secondary` (same block shape)."""
    desc = cache.k if which == "k" else cache.v
    rows = primary[torch.where(sec, 0, blocks), offsets]  # placeholder rows for secondary tokens
    rows[sec] = block_view(cache.pool.secondary, desc.layout)[blocks[sec], offsets[sec]]
    return rows
