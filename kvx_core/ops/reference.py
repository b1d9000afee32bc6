"""Reference `write_kv` / `gather_kv` in torch (any device): the oracle for every kernel and the CPU path.

These handle unquantized caches (F16 / BF16 / F32, spec §4.3 baseline) in every layout and block-table
format; quantized caches go through `kvx_core.cache` which encodes with the cache format first.
"""
from __future__ import annotations

import torch

from ..block_tables import resolve_tokens
from ..descriptors import CacheDesc, GatherDesc, KvIoDesc, WriteDesc
from ..enums import DType
from ..errors import KvxError, Status, require
from ..layouts import block_view

_PLAIN = (DType.F16, DType.BF16, DType.F32)


def _check_plain(cache: CacheDesc) -> None:
    require(cache.quant is None and cache.k.dtype in _PLAIN, Status.UNSUPPORTED,
            f"reference write/gather of raw elements needs an F16/BF16/F32 cache, got {cache.k.dtype.name}; "
            "quantized caches are written through kvx_core.cache.PagedKVCache")


def valid_slots(slots: torch.Tensor, invalid_slot: int) -> torch.Tensor:
    """Mask of tokens that are really written: not `invalid_slot` and not negative (spec §7)."""
    return (slots != invalid_slot) & (slots >= 0)


def check_unique_slots(slots: torch.Tensor) -> None:
    """Two tokens of one write batch may not target one slot (the result would be unordered)."""
    require(slots.unique().numel() == slots.numel(), Status.INVALID_ARGUMENT,
            "slot mapping names the same slot twice in one write batch")


def write_kv(cache: CacheDesc, write: WriteDesc) -> None:
    """Scatter `write.io` K/V into the cache by slot mapping; invalid (negative) slots are no-ops."""
    cache.validate()
    _check_plain(cache)
    write.validate(cache)
    slots = write.slots.slots.to(cache.k.tensor.device, torch.int64)
    keep = valid_slots(slots, write.slots.invalid_slot)
    slots = slots[keep]
    check_unique_slots(slots)
    blk, off = slots // cache.block_size, slots % cache.block_size
    for desc, src in ((cache.k, write.io.key), (cache.v, write.io.value)):
        dst = block_view(desc.tensor, desc.layout)
        dst[blk, off] = src[keep].to(dst.dtype).reshape(-1, *dst.shape[2:])


def _secondary_view(cache: CacheDesc, which: str) -> torch.Tensor | None:
    """The secondary pool seen with the same interior layout as the primary K or V tensor."""
    if cache.pool is None or cache.pool.secondary is None:
        return None
    desc = cache.k if which == "k" else cache.v
    sec = cache.pool.secondary
    require(sec.dtype == desc.tensor.dtype and tuple(sec.shape[1:]) == tuple(desc.shape[1:]), Status.INVALID_ARGUMENT,
            f"pool.secondary must have the primary's dtype and block shape {tuple(desc.shape[1:])}, "
            f"got {sec.dtype} {tuple(sec.shape)}")
    return block_view(sec, desc.layout)


def gather_kv(cache: CacheDesc, gather: GatherDesc, out: KvIoDesc | None = None) -> KvIoDesc:
    """Gather `min(seq_len, max_seq_len)` tokens of each sequence into ragged dense `[T, H, D]` K/V.

    Sequences are concatenated in order (beams of a KV_OFFSETS table are separate sequences);
    `gather.output_lengths()` gives each one's token count.
    """
    cache.validate()
    _check_plain(cache)
    gather.validate(cache)
    n2 = 0 if cache.pool is None or cache.pool.secondary is None else int(cache.pool.secondary.shape[0])
    addr = resolve_tokens(gather.block_table, gather.seq_lens, gather.max_seq_len, cache.block_size,
                          cache.num_blocks, n2)
    total = int(addr.lengths.sum())
    h, d = cache.num_kv_heads, cache.head_dim
    if out is None:
        dev, dt = cache.k.tensor.device, cache.k.tensor.dtype
        out = KvIoDesc(torch.empty(total, h, d, dtype=dt, device=dev), torch.empty(total, h, d, dtype=dt, device=dev))
    out.validate(cache, "gather.io")
    if out.num_tokens < total:
        raise KvxError(Status.INVALID_ARGUMENT, f"gather output holds {out.num_tokens} tokens, {total} are gathered")
    for which, dst, blocks, sec in (("k", out.key, addr.k_blocks, addr.k_secondary),
                                    ("v", out.value, addr.v_blocks, addr.v_secondary)):
        desc = cache.k if which == "k" else cache.v
        prim = block_view(desc.tensor, desc.layout)
        vals = prim[blocks.clamp(max=cache.num_blocks - 1), addr.offsets].reshape(-1, h, d)
        if bool(sec.any()):
            second = _secondary_view(cache, which)
            require(second is not None, Status.INVALID_ARGUMENT,
                    "block table references the secondary pool but cache.pool.secondary is NULL")
            vals[sec] = second[blocks[sec], addr.offsets[sec]].reshape(-1, h, d)
        dst[:total] = vals.to(dst.dtype)
    return out
