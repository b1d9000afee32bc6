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
from ..codec import format_of
from ..descriptors import CacheDesc, GatherDesc, KvIoDesc, ScaleDesc, WriteDesc
from ..enums import QuantFormat
from ..errors import KvxError, Status, require
from ..formats import TensorFormat, rotate
from ..layouts import block_view


@dataclass
class _Pools:
    """One of K or V: its tensor format, 5-D data and scale views, and FP32 global scale."""

    fmt: TensorFormat
    data: torch.Tensor  # [N, B, H, Dp, pack]
    scales: torch.Tensor | None  # [N, B, H, S, 1]
    global_scale: torch.Tensor | None


def _pools(cache: CacheDesc, which: str, v10_scale: ScaleDesc | None = None) -> _Pools:
    fmt = format_of(cache)
    tf = fmt.k if which == "k" else fmt.v
    desc = cache.k if which == "k" else cache.v
    q = cache.quant
    scales = getattr(q, f"{which}_scales") if q is not None else None
    g = getattr(q, f"{which}_global_scale") if q is not None else None
    if q is None and tf.uses_global_scale and v10_scale is not None and v10_scale.tensor is not None:
        g = v10_scale.tensor  # v1.0 FP8 cache: per-tensor / per-head scale from the write descriptor
    if not tf.uses_global_scale:
        g = None
    return _Pools(tf, block_view(desc.tensor, desc.layout),
                  block_view(scales.tensor.view(torch.uint8), scales.layout) if scales is not None else None, g)


def valid_slots(slots: torch.Tensor, invalid_slot: int) -> torch.Tensor:
    """Mask of tokens that are really written: not `invalid_slot` and not negative (spec §7)."""
    return (slots != invalid_slot) & (slots >= 0)


def check_unique_slots(slots: torch.Tensor) -> None:
    """Two tokens of one write batch may not target one slot (the result would be unordered)."""
    require(slots.unique().numel() == slots.numel(), Status.INVALID_ARGUMENT,
            "slot mapping names the same slot twice in one write batch")


def _byte_offsets(view5: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Storage byte offsets of every element of rows `view5[blk, off]` (a 5-D block view)."""
    s, es = view5.stride(), view5.element_size()
    idx = [torch.arange(n, device=blk.device) * st for n, st in zip(view5.shape[2:], s[2:])]
    inner = idx[0][:, None, None] + idx[1][None, :, None] + idx[2][None, None, :]
    return ((view5.storage_offset() + blk * s[0] + off * s[1])[:, None, None, None] + inner).flatten() * es


def _blocks_disjoint(k5: torch.Tensor, v5: torch.Tensor) -> bool:
    """O(1) sufficient test: K and V blocks share a byte stride, each block's bytes fit in one stride,
    and V's bytes sit beside K's within it (regions of one page, or FlashInfer's interleaved [N, 2, ...])."""
    es = k5.element_size()
    stride = k5.stride(0) * es
    if v5.stride(0) * v5.element_size() != stride:
        return False
    inner = [(sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:])) + 1) * t.element_size()
             for t in (k5, v5)]
    if max(inner) > stride:
        return False
    d = (v5.storage_offset() * v5.element_size() - k5.storage_offset() * es) % stride
    return inner[0] <= d and d + inner[1] <= stride


def _check_disjoint(k5: torch.Tensor, v5: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> None:
    """The K and V elements a write touches must be distinct (a TRT-LLM pool view, where K and V share
    one buffer and are told apart only by KV_OFFSETS, is for gathering, not slot-mapped writes)."""
    if k5.untyped_storage().data_ptr() != v5.untyped_storage().data_ptr() or blk.numel() == 0:
        return
    if _blocks_disjoint(k5, v5):
        return
    require(not bool(torch.isin(_byte_offsets(k5, blk, off), _byte_offsets(v5, blk, off)).any()),
            Status.INVALID_ARGUMENT, "cache K and V overlap in memory at the written slots, so a write would "
            "hit both; slot-mapped writes need disjoint K and V (for a TRT-LLM pool, use per-layer K/V views)")


def write_kv(cache: CacheDesc, write: WriteDesc) -> None:
    """Encode `write.io` K/V in the cache's format and scatter payload and scales by slot mapping;
    invalid (negative) slots are no-ops."""
    cache.validate()
    write.validate(cache)
    rot = format_of(cache).rotate
    slots = write.slots.slots.to(cache.k.tensor.device, torch.int64)
    keep = valid_slots(slots, write.slots.invalid_slot)
    slots = slots[keep]
    check_unique_slots(slots)
    blk, off = slots // cache.block_size, slots % cache.block_size
    _check_disjoint(_pools(cache, "k").data, _pools(cache, "v").data, blk, off)
    for which, src, v10 in (("k", write.io.key, write.k_scale), ("v", write.io.value, write.v_scale)):
        p = _pools(cache, which, v10)
        x = src[keep]
        payload, scales = p.fmt.encode(rotate(x) if rot else x, p.global_scale)
        p.data[blk, off] = payload.reshape(-1, *p.data.shape[2:])
        if p.scales is not None:
            p.scales[blk, off] = scales.reshape(-1, *p.scales.shape[2:])


def gather_kv(cache: CacheDesc, gather: GatherDesc, out: KvIoDesc | None = None,
              out_dtype: torch.dtype | None = None, k_scale: ScaleDesc | None = None,
              v_scale: ScaleDesc | None = None) -> KvIoDesc:
    """Gather and decode `min(seq_len, max_seq_len)` tokens of each sequence into ragged dense
    `[T, H, D]` K/V (FP32 for quantized caches unless `out_dtype`/`out` say otherwise).

    Sequences are concatenated in order (beams of a KV_OFFSETS table are separate sequences);
    `gather.output_lengths()` gives each one's token count. `k_scale`/`v_scale` are the per-tensor
    scales of a v1.0 FP8 cache (as in its write descriptor).
    """
    cache.validate()
    gather.validate(cache)
    fmt = format_of(cache)
    # None: no secondary pool, so resolve_tokens rejects references to it (INVALID_ARGUMENT)
    n2 = None if cache.pool is None or cache.pool.secondary is None else int(cache.pool.secondary.shape[0])
    addr = resolve_tokens(gather.block_table, gather.seq_lens, gather.max_seq_len, cache.block_size,
                          cache.num_blocks, n2)
    total = int(addr.lengths.sum())
    h, d = cache.num_kv_heads, cache.head_dim
    if out is None:
        dt = out_dtype or (cache.k.tensor.dtype if fmt.quant == QuantFormat.NONE else torch.float32)
        dev = cache.k.tensor.device
        out = KvIoDesc(torch.empty(total, h, d, dtype=dt, device=dev), torch.empty(total, h, d, dtype=dt, device=dev))
    out.validate(cache, "gather.io")
    if out.num_tokens < total:
        raise KvxError(Status.INVALID_ARGUMENT, f"gather output holds {out.num_tokens} tokens, {total} are gathered")
    for which, dst, blocks, sec, v10 in (("k", out.key, addr.k_blocks, addr.k_secondary, k_scale),
                                         ("v", out.value, addr.v_blocks, addr.v_secondary, v_scale)):
        p = _pools(cache, which, v10)
        if bool(sec.any()):
            require(cache.quant is None, Status.UNSUPPORTED,
                    "secondary (host) pools are defined for unquantized caches only in KVX v1.1")
            data = _with_secondary(cache, which, p.data, blocks, sec, addr.offsets)
        else:
            data = p.data[blocks, addr.offsets]
        scales = p.scales[blocks, addr.offsets].flatten(-2) if p.scales is not None else \
            torch.empty(total, h, 0, dtype=torch.uint8, device=data.device)
        x = p.fmt.decode(data.flatten(-2), scales, p.global_scale)
        dst[:total] = (rotate(x) if fmt.rotate else x).to(dst.dtype)
    return out


def _with_secondary(cache: CacheDesc, which: str, primary: torch.Tensor, blocks: torch.Tensor,
                    sec: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of the primary pool, with those flagged secondary read from `pool.secondary` (same block shape)."""
    require(cache.pool is not None and cache.pool.secondary is not None, Status.INVALID_ARGUMENT,
            "block table references the secondary pool but cache.pool.secondary is NULL")
    desc = cache.k if which == "k" else cache.v
    second = cache.pool.secondary
    require(second.dtype == desc.tensor.dtype and tuple(second.shape[1:]) == tuple(desc.shape[1:]),
            Status.INVALID_ARGUMENT, f"pool.secondary must have the primary's dtype and block shape "
            f"{tuple(desc.shape[1:])}, got {second.dtype} {tuple(second.shape)}")
    rows = primary[torch.where(sec, 0, blocks), offsets]  # placeholder rows for secondary tokens
    rows[sec] = block_view(second, desc.layout)[blocks[sec], offsets[sec]]
    return rows
