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
from ..errors import KvxError
from ..layouts import block_view
from . import attention, reference
from .checks import INT32_MAX, cache_global_scales, check_gather, check_write, kernel_table, narrow_int32
from .kernel_format import kernel_format


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
    """(k_data, k_scales, v_data, v_scales, fmt) as the kernels take them, or None (the reference serves the
    call, and refuses what is not a cache descriptor)."""
    if not isinstance(cache, CacheDesc) or not _use_triton(cache):
        return None
    q = cache.quant
    fmt = format_of(cache)
    if q is None and (fmt.k.uses_global_scale or fmt.v.uses_global_scale):
        return None  # v1.0 FP8: the scale comes with each write/gather call
    try:
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
    return kd, ks, vd, vs, fmt


@torch.no_grad()
def write_kv(cache: CacheDesc, write: WriteDesc, *, check: bool = True) -> None:
    """`reference.write_kv`, on the fused Triton write kernel when possible. `check` validates the descriptors
    and the values the write depends on (slot range and uniqueness, global scales: host syncs); engines that
    own their slot mappings and scales pass False to stay sync-free. Either way nothing is stored unless the
    whole write is accepted."""
    pools = _kernel_pools(cache)
    if pools is None:
        return reference.write_kv(cache, write)
    plan = check_write(cache, write, check=check)
    from .triton.write import launch_write
    kd, ks, vd, vs, fmt = pools
    launch_write(write.io.key, write.io.value, plan.args, kd, ks, vd, vs, fmt)


@torch.no_grad()
def gather_kv(cache: CacheDesc, gather: GatherDesc, out: KvIoDesc | None = None,
              out_dtype: torch.dtype | None = None, k_scale: ScaleDesc | None = None,
              v_scale: ScaleDesc | None = None) -> KvIoDesc:
    """`reference.gather_kv`, on the Triton gather kernel when possible (PACKED tables, primary pool)."""
    pools = _kernel_pools(cache)
    if pools is None or not isinstance(gather, GatherDesc) or not _packed(gather.block_table) \
            or (cache.pool is not None and cache.pool.secondary is not None):
        return reference.gather_kv(cache, gather, out, out_dtype, k_scale, v_scale)
    plan = check_gather(cache, gather, out, out_dtype, k_scale, v_scale)
    kd, ks, vd, vs, fmt = pools
    table = gather.block_table
    bt = table.indices.reshape(table.seq_count, table.max_blocks_per_seq).to(kd.device).contiguous()
    lens = gather.seq_lens.lengths.to(kd.device)
    from .triton import gather_kv as triton_gather
    k, v = triton_gather(kd, ks, vd, vs, bt, lens, fmt, plan.k_gs, plan.v_gs, max_seq_len=plan.max_seq_len,
                         out_dtype=out_dtype,
                         out=(out.key, out.value) if out is not None else None)
    return out if out is not None else KvIoDesc(k, v)


def _packed(table: BlockTable) -> bool:
    """The kernels read PACKED tables; anything else (including a malformed table) goes to the reference."""
    return isinstance(table, BlockTable) and table.format == BlockTableFormat.PACKED


def _kernel_table(cache: CacheDesc, table: BlockTable, seq_lens: SeqLens, check: bool):
    """(pools, int32 block table [B, max_blocks], int32 seq_lens [B], global scales) for the attention
    kernels, or None (the reference serves the call)."""
    pools = _kernel_pools(cache)
    if pools is None or not _packed(table) or cache.num_blocks > INT32_MAX + 1 \
            or (cache.pool is not None and cache.pool.secondary is not None):
        return None
    if check:  # what the reference's gather validates, on the kernels' side
        cache.validate()
    bt, lens = kernel_table(cache, table, seq_lens, check=check)
    gs = cache_global_scales(cache, pools[-1], None, None, "attention", check_values=check)
    return pools, bt, lens, gs


def paged_decode(query: torch.Tensor, cache: CacheDesc, table: BlockTable, seq_lens: SeqLens, *,
                 sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                 max_seq_len: int | None = None, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention.paged_decode`, on the decode kernels (CUDA or Triton, `ops.decode.paged_decode`'s choice)
    for PACKED tables over kernel-addressable pools. `check` validates the table against the cache (one host
    sync); engines that own their tables pass False and `max_seq_len` to stay sync-free (CUDA graphs)."""
    attention.check_args(query, cache, table, seq_lens, "paged_decode", sm_scale=sm_scale, softcap=softcap,
                         window=window)
    args = _kernel_table(cache, table, seq_lens, check)
    if args is None:
        return attention.paged_decode(query, cache, table, seq_lens, sm_scale=sm_scale, softcap=softcap, window=window)
    (kd, ks, vd, vs, fmt), bt, lens, (kg, vg) = args
    from .decode import paged_decode as kernel
    return kernel(query, kd, ks, vd, vs, kg, vg, bt, lens, fmt, sm_scale=sm_scale, softcap=softcap, window=window,
                  max_seq_len=max_seq_len)


def paged_prefill(query: torch.Tensor, qo_indptr: torch.Tensor, cache: CacheDesc, table: BlockTable,
                  seq_lens: SeqLens, *, causal: bool = True, sm_scale: float | None = None,
                  softcap: float | None = None, window: int | None = None,
                  check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention.paged_prefill`, on the Triton prefill kernel for PACKED tables over kernel-addressable
    pools (the work plan reads `qo_indptr` on the host: pass it on the CPU to avoid a device sync)."""
    attention.check_args(query, cache, table, seq_lens, "paged_prefill", sm_scale=sm_scale, softcap=softcap,
                         window=window)
    args = _kernel_table(cache, table, seq_lens, check)
    if args is None:
        return attention.paged_prefill(query, qo_indptr, cache, table, seq_lens, causal=causal, sm_scale=sm_scale,
                                       softcap=softcap, window=window)
    (kd, ks, vd, vs, fmt), bt, lens, (kg, vg) = args
    from .triton import paged_prefill as kernel
    from .triton import prefill_plan
    if check:  # on the caller's dtype, before narrowing
        attention.check_qo_indptr(qo_indptr, lens.tolist(), query.shape[0])
    ip = narrow_int32(qo_indptr, "qo_indptr", check=check)
    plan = prefill_plan(ip.cpu(), query.shape[1] // cache.num_kv_heads)
    return kernel(query, ip.to(query.device), kd, ks, vd, vs, kg, vg, bt, lens, fmt, causal=causal, sm_scale=sm_scale,
                  softcap=softcap, window_left=window, plan=tuple(x.to(query.device) for x in plan))
