"""`write_kv` / `gather_kv` / `paged_decode` / `paged_prefill` on a cache descriptor: the GPU kernels when
the pools are CUDA tensors the kernels can address, the torch reference otherwise. Same signatures and
results as `ops.reference` / `ops.attention` (write and gather bit-identical; attention equal up to float
accumulation order), so callers switch by importing this module instead.

The reference remains the path for: CPU pools, v1.0 FP8 caches (per-write scale descriptors),
HND_PACKED layouts with pack > 1, RAGGED / KV_OFFSETS block tables and secondary (host) pools.
"""
from __future__ import annotations

import torch

from ..codec import format_of
from ..descriptors import (
    BlockTable,
    CacheDesc,
    GatherDesc,
    KvIoDesc,
    ScaleDesc,
    SeqLens,
    WriteDesc,
)
from ..enums import BlockTableFormat
from ..errors import KvxError, Status
from ..layouts import block_view
from . import attention, reference


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(cache: CacheDesc) -> bool:
    """Kernels run on CUDA pools (tests force them under TRITON_INTERPRET=1 by patching this)."""
    return cache.k.tensor is not None and cache.k.tensor.is_cuda and _triton_available()


def _hnd(t: torch.Tensor | None, layout) -> torch.Tensor | None:
    """A `[N, H, B, X]` view with a contiguous last dim, or None when the layout has no such view."""
    v5 = block_view(t, layout)
    if v5.shape[-1] != 1:
        return None
    v = v5[..., 0].permute(0, 2, 1, 3)
    return v if v.stride(3) == 1 or v.shape[3] <= 1 else None


def _kernel_pools(cache: CacheDesc):
    """(k_data, k_scales, v_data, v_scales, k_gs, v_gs, fmt) as the kernels take them, or None."""
    q = cache.quant
    fmt = format_of(cache)
    if q is None and (fmt.k.uses_global_scale or fmt.v.uses_global_scale):
        return None  # v1.0 FP8: the scale comes with each write/gather call
    try:
        from .triton.spec import kernel_format
        kernel_format(fmt.k), kernel_format(fmt.v)
    except KvxError:
        return None
    pools = [_hnd(cache.k.tensor, cache.k.layout), _hnd(cache.v.tensor, cache.v.layout)]
    for sd in (q.k_scales, q.v_scales) if q is not None else (None, None):
        pools.append(None if sd is None else _hnd(sd.tensor.view(torch.uint8), sd.layout))
    kd, vd, ks, vs = pools
    if kd is None or vd is None or (q is not None and ((q.k_scales is None) != (ks is None)
                                                       or (q.v_scales is None) != (vs is None))):
        return None
    kg = q.k_global_scale if q is not None and fmt.k.uses_global_scale else None
    vg = q.v_global_scale if q is not None and fmt.v.uses_global_scale else None
    return kd, ks, vd, vs, kg, vg, fmt


def write_kv(cache: CacheDesc, write: WriteDesc, *, check: bool = True) -> None:
    """`reference.write_kv`, on the fused Triton write kernel when possible. `check` validates the slots
    (range, uniqueness: host syncs); engines that own their slot mappings pass False to stay sync-free."""
    pools = _kernel_pools(cache) if _use_triton(cache) else None
    if pools is None:
        return reference.write_kv(cache, write)
    slots = write.slots.slots.to(cache.k.tensor.device, torch.int64)
    keep = reference.valid_slots(slots, write.slots.invalid_slot)
    if check:
        cache.validate()
        write.validate(cache)
        reference.check_unique_slots(slots[keep])
    from .triton import write_kv as triton_write
    kd, ks, vd, vs, kg, vg, fmt = pools
    triton_write(write.io.key, write.io.value, torch.where(keep, slots, -1), kd, ks, vd, vs, fmt, kg, vg,
                 check_slots=False)


def gather_kv(cache: CacheDesc, gather: GatherDesc, out: KvIoDesc | None = None,
              out_dtype: torch.dtype | None = None, k_scale: ScaleDesc | None = None,
              v_scale: ScaleDesc | None = None) -> KvIoDesc:
    """`reference.gather_kv`, on the Triton gather kernel when possible (PACKED tables, primary pool)."""
    pools = _kernel_pools(cache) if _use_triton(cache) else None
    table = gather.block_table
    if pools is None or table.format != BlockTableFormat.PACKED or k_scale is not None or v_scale is not None \
            or (cache.pool is not None and cache.pool.secondary is not None):
        return reference.gather_kv(cache, gather, out, out_dtype, k_scale, v_scale)
    cache.validate()
    gather.validate(cache)
    kd, ks, vd, vs, kg, vg, fmt = pools
    bt = table.indices.reshape(table.seq_count, table.max_blocks_per_seq)
    lens = gather.seq_lens.lengths.to(device=bt.device)
    _check_blocks_in_range(cache, bt, lens.to(torch.int64).clamp(max=gather.max_seq_len))
    from .triton import gather_kv as triton_gather
    if out is not None:
        out.validate(cache, "gather.io")
        total = int(gather.output_lengths().sum())
        if out.num_tokens < total:
            raise KvxError(Status.INVALID_ARGUMENT, f"gather output holds {out.num_tokens} tokens, {total} are gathered")
        triton_gather(kd, ks, vd, vs, bt, lens, fmt, kg, vg, max_seq_len=gather.max_seq_len,
                      out_dtype=out.key.dtype, out=(out.key, out.value))
        return out
    k, v = triton_gather(kd, ks, vd, vs, bt, lens, fmt, kg, vg, max_seq_len=gather.max_seq_len, out_dtype=out_dtype)
    return KvIoDesc(k, v)


def _check_blocks_in_range(cache: CacheDesc, bt: torch.Tensor, lens: torch.Tensor) -> None:
    """OUT_OF_RANGE unless every block a sequence uses (its first ceil(len / block_size) entries; the rest
    of the row may hold stale ids) is a block of the cache. One host sync."""
    need = torch.arange(bt.shape[1], device=bt.device)[None, :] * cache.block_size < lens[:, None]
    if bool((need & ((bt < 0) | (bt >= cache.num_blocks))).any()):
        raise KvxError(Status.OUT_OF_RANGE, f"block table references a block outside [0, {cache.num_blocks})")


def _kernel_table(cache: CacheDesc, table: BlockTable, seq_lens: SeqLens, check: bool):
    """(pools, int32 block table [B, max_blocks], int32 seq_lens [B]) for the attention kernels, or None."""
    pools = _kernel_pools(cache) if _use_triton(cache) else None
    if pools is None or table.format != BlockTableFormat.PACKED \
            or (cache.pool is not None and cache.pool.secondary is not None):
        return None
    dev = cache.k.tensor.device
    bt = table.indices.reshape(table.seq_count, table.max_blocks_per_seq).to(dev, torch.int32)
    lens = seq_lens.lengths.to(dev, torch.int32)
    if check:  # what the reference's gather validates, on the kernels' side
        cache.validate()
        table.validate(cache)
        seq_lens.validate(table, cache.block_size)
        _check_blocks_in_range(cache, bt, lens)
    return pools, bt.contiguous(), lens


def paged_decode(query: torch.Tensor, cache: CacheDesc, table: BlockTable, seq_lens: SeqLens, *,
                 sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                 max_seq_len: int | None = None, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention.paged_decode`, on the decode kernels (CUDA or Triton, `ops.triton.paged_decode`'s choice)
    for PACKED tables over kernel-addressable pools. `check` validates the table against the cache (one host
    sync); engines that own their tables pass False and `max_seq_len` to stay sync-free (CUDA graphs)."""
    args = _kernel_table(cache, table, seq_lens, check)
    if args is None:
        return attention.paged_decode(query, cache, table, seq_lens, sm_scale=sm_scale, softcap=softcap, window=window)
    (kd, ks, vd, vs, kg, vg, fmt), bt, lens = args
    from .triton import paged_decode as kernel
    return kernel(query, kd, ks, vd, vs, kg, vg, bt, lens, fmt, sm_scale=sm_scale, softcap=softcap, window=window,
                  max_seq_len=max_seq_len)


def paged_prefill(query: torch.Tensor, qo_indptr: torch.Tensor, cache: CacheDesc, table: BlockTable,
                  seq_lens: SeqLens, *, causal: bool = True, sm_scale: float | None = None,
                  softcap: float | None = None, window: int | None = None,
                  check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention.paged_prefill`, on the Triton prefill kernel for PACKED tables over kernel-addressable
    pools (the work plan reads `qo_indptr` on the host: pass it on the CPU to avoid a device sync)."""
    args = _kernel_table(cache, table, seq_lens, check)
    if args is None:
        return attention.paged_prefill(query, qo_indptr, cache, table, seq_lens, causal=causal, sm_scale=sm_scale,
                                       softcap=softcap, window=window)
    (kd, ks, vd, vs, kg, vg, fmt), bt, lens = args
    from .triton import paged_prefill as kernel
    from .triton import prefill_plan
    ip = qo_indptr.to(torch.int32)
    if check:
        attention.check_qo_indptr(ip, lens.tolist(), query.shape[0])
    plan = prefill_plan(ip.cpu(), query.shape[1] // cache.num_kv_heads)
    return kernel(query, ip.to(query.device), kd, ks, vd, vs, kg, vg, bt, lens, fmt, causal=causal, sm_scale=sm_scale,
                  softcap=softcap, window_left=window, plan=tuple(x.to(query.device) for x in plan))
