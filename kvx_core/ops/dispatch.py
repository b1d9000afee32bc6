"""`write_kv` / `gather_kv` / `paged_decode` / `paged_prefill` on a cache descriptor: the GPU kernels when
the pools are CUDA tensors the kernels can address, the torch reference otherwise. Same signatures and
results as `ops.reference` / `ops.attention` (write and gather bit-identical; attention equal up to float
accumulation order), so callers switch by importing this module instead.

KV_OFFSETS tables (TRT-LLM) run on the kernels over their K plane, V read one block further
(`checks.offsets_kernel_table`). The reference remains the path for: CPU pools, v1.0 FP8 caches (per-write scale
descriptors), HND_PACKED layouts with pack > 1, RAGGED tables, KV_OFFSETS tables that name host blocks or break
TRT-LLM's K/V block pairing (checked), caches with a secondary (host) pool, and NVFP4 caches whose V scales are
interleaved by 4 tokens (TRT-LLM's layout, `QUANT_FLAG_V_SCALE_INTERLEAVE4`: the kernels read scale rows by strides).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

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
from ..enums import QUANT_FLAG_V_SCALE_INTERLEAVE4, BlockTableFormat
from ..errors import KvxError, Status, require
from ..formats import CacheFormat, get_format
from ..layouts import block_view
from . import attention, reference, smoothing
from .checks import (
    INT32_MAX,
    WriteArgs,
    cache_global_scales,
    check_block_ids,
    check_gather,
    check_table_types,
    check_write,
    kernel_slots,
    kernel_table,
    narrow_int32,
    offsets_kernel_table,
    require_type,
)
from .kernel_format import kernel_format

if TYPE_CHECKING:  # the kernel modules import triton; kvx_core imports with torch alone
    from .decode import DecodePlan
    from .triton.prefill import PrefillPlan


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel_device(device: torch.device) -> bool:
    """Kernels run on CUDA devices (tests force them on the CPU under TRITON_INTERPRET=1 by patching this)."""
    return device.type == "cuda" and _triton_available()


def _use_triton(cache: CacheDesc) -> bool:
    """Kernels run on pools on a kernel device."""
    return cache.k.tensor is not None and _kernel_device(cache.k.tensor.device)


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
    if q is None and fmt.uses_global_scale:
        return None  # v1.0 FP8: the scale comes with each write/gather call
    if q is not None and q.flags & QUANT_FLAG_V_SCALE_INTERLEAVE4:
        return None  # the kernels address scale rows by strides; the interleave is no strided view
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


@dataclass(frozen=True, eq=False)
class BoundLayer:
    """One layer's cache as the kernels take it, derived and checked once when an engine registers its cache
    (`bind`), so that a step's `AttentionPlan.run` and `write_kv` only launch (FlashInfer's plan/run: what depends on
    the layer and not on the step is not re-derived per step). Holds the descriptor it was bound from (the
    validation and reference paths use it) and the block-table format it was bound for: a KV_OFFSETS layer holds V
    shifted by one block (`_shift_v`), so plans of the other format run on the descriptor instead."""

    cache: CacheDesc
    table_format: BlockTableFormat  # PACKED (slot-mapped writes, PACKED plans) or KV_OFFSETS (TRT-LLM's plans)
    fmt: CacheFormat
    geometry: tuple[int, int, int]  # (num_kv_heads, block_size, head_dim)
    k_data: torch.Tensor  # HND kernel views [N, H, B, X]
    k_scales: torch.Tensor | None
    v_data: torch.Tensor
    v_scales: torch.Tensor | None
    k_gs: torch.Tensor | None  # FP32 [H] global scales (None: the side has none)
    v_gs: torch.Tensor | None
    k_global: torch.Tensor  # the attention kernels' global-scale arguments (a placeholder for sides without)
    v_global: torch.Tensor
    k_scale_args: tuple  # `launch.scale_args` of each side
    v_scale_args: tuple
    k_smoothing: torch.Tensor | None  # FP32 [H, D], contiguous
    transforms_keys: bool  # key smoothing or centering: writes transform the keys first
    cuda_pool_reason: str | None  # why the CUDA decode cannot address these pools (None: it can, or it serves no
    # such format / GPU, and plans choose Triton anyway)
    cuda_args: object  # the CUDA decode's layer arguments (`cuda.decode.LayerArgs`; None where it cannot serve)
    write_launch: dict = field(default_factory=dict)  # (K dtype, V dtype, huge) -> (ops.write Choice, the CUDA
    # write's `LayerWrite` when it serves them), made at the first write of those dtypes


def bind(cache: CacheDesc, *, table_format: BlockTableFormat = BlockTableFormat.PACKED) -> BoundLayer | None:
    """Check `cache` (descriptor, pools, global scales: one host sync, skipped while a CUDA graph is being captured)
    and derive what every step's kernels take from it for plans over `table_format` tables; None when the kernels
    cannot address it that way (the reference serves it: pass the descriptor itself). KV_OFFSETS binds V one block
    after K (TRT-LLM's pairing, `_shift_v`): such a layer serves KV_OFFSETS plans only and refuses writes, which are
    slot-mapped; RAGGED tables have no kernels (None)."""
    require_type(cache, CacheDesc, "cache")
    require_type(table_format, BlockTableFormat, "table_format")
    cache.validate()
    pools = _attention_pools(cache)
    if pools is not None and table_format == BlockTableFormat.KV_OFFSETS:
        pools = _shift_v(pools)
    if pools is None or table_format == BlockTableFormat.RAGGED:
        return None
    kd, ks, vd, vs, fmt = pools
    from .cuda import decode as cuda_decode
    from .triton.launch import check_pool, global_scale_arg, scale_args

    h, d = cache.num_kv_heads, cache.head_dim
    capturing = kd.device.type == "cuda" and torch.cuda.is_current_stream_capturing()  # no host sync in a capture
    kg, vg = cache_global_scales(cache, fmt, None, None, "bind", check_values=not capturing)
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    check_pool("K", kd, kk, d)
    check_pool("V", vd, kv, d)
    s = smoothing.of(cache)
    s = None if s is None else s.contiguous()
    k_global, v_global = global_scale_arg(kg, kk, h, kd.device), global_scale_arg(vg, kv, h, kd.device)
    k_args, v_args = scale_args("K", ks, kd, kk, fmt.k, d), scale_args("V", vs, vd, kv, fmt.v, d)
    cuda_why, cuda_args = None, None
    if cuda_decode.plan_reason(fmt, torch.bfloat16, kd.device, 1, h, h, d, cache.block_size) is None:
        q = torch.empty(1, h, d, dtype=torch.bfloat16, device="meta")  # its strides are all pool_reason reads
        cuda_why = cuda_decode.pool_reason(q, fmt, kd, ks, vd, vs)
        if cuda_why is None:
            try:  # rotated formats scale the queries before their rotation, not in the kernel
                cuda_args = cuda_decode.layer_args(fmt, kd, k_args[0], vd, v_args[0], k_global, v_global,
                                                   None if fmt.rotate else s)
            except KvxError as e:  # no library here: plans choose Triton (and say why)
                if e.status != Status.UNSUPPORTED:
                    raise
    return BoundLayer(cache, table_format, fmt, (h, cache.block_size, d), kd, ks, vd, vs, kg, vg, k_global, v_global,
                      k_args, v_args, s, smoothing.transforms_keys(cache), cuda_why, cuda_args)


def _write_bound(layer: BoundLayer, write: WriteDesc) -> None:
    """`write_kv(check=False)` into a bound layer: shapes compared on the host, then the write kernel (the slots as
    they are: every kernel skips negative ones)."""
    from . import write as write_ops

    key, value, slots = write.io.key, write.io.value, write.slots.slots
    h, _, d = layer.geometry
    t = key.shape[0] if isinstance(key, torch.Tensor) else -1
    require(isinstance(value, torch.Tensor) and isinstance(slots, torch.Tensor) and key.dim() == 3
            and tuple(key.shape[1:]) == (h, d) and value.shape == key.shape and slots.shape == (t,)
            and slots.dtype in (torch.int32, torch.int64), Status.INVALID_ARGUMENT,
            f"write into a bound layer: key / value must be [tokens, {h}, {d}] and the slot mapping int32/int64 "
            f"[tokens], got {tuple(getattr(key, 'shape', ()))}, {tuple(getattr(value, 'shape', ()))}, "
            f"{getattr(slots, 'dtype', type(slots).__name__)} {tuple(getattr(slots, 'shape', ()))}")
    s = kernel_slots(slots, key.device, write.slots.invalid_slot)
    if layer.transforms_keys:
        key = smoothing.smooth_keys(layer.cache, key)
    kind = (key.dtype, value.dtype, t >= 2**30)
    launch = layer.write_launch.get(kind)
    if launch is None:
        launch = layer.write_launch[kind] = write_ops.bind_write(key, value, layer.fmt, layer.k_data, layer.k_scales,
                                                                 layer.v_data, layer.v_scales, layer.k_gs, layer.v_gs)
    write_ops.launch_bound(launch, key, value, WriteArgs(s, layer.k_gs, layer.v_gs), layer.k_data, layer.k_scales,
                           layer.v_data, layer.v_scales, layer.fmt)


def _attention_pools(cache: CacheDesc):
    """`_kernel_pools` where the attention kernels can address them too (int32 block ids, the primary pool only),
    else None."""
    pools = _kernel_pools(cache)
    if pools is None or cache.num_blocks > INT32_MAX + 1 \
            or (cache.pool is not None and cache.pool.secondary is not None):
        return None
    return pools


@torch.no_grad()
def write_kv(cache: CacheDesc | BoundLayer, write: WriteDesc, *, check: bool = True) -> None:
    """`reference.write_kv`, on the fused write kernel (CUDA or Triton, `ops.write`) when possible. `check` validates
    the descriptors and the values the write depends on (slot range and uniqueness, global scales: host syncs); engines
    that own their slot mappings and scales pass False to stay sync-free, and a layer bound once (`bind`) then launches
    the write kernel and nothing else. Either way nothing is stored unless the whole write is accepted. A layer
    bound for KV_OFFSETS tables is refused: its K and V are one block array (TRT-LLM's), which a slot names once,
    so a slot-mapped write would store V over K (TRT-LLM: write through `kvx_trtllm.layer_views`)."""
    if isinstance(cache, BoundLayer):
        require(cache.table_format == BlockTableFormat.PACKED, Status.INVALID_ARGUMENT,
                "write_kv: this layer is bound for KV_OFFSETS tables, whose K and V share one block array; slot-mapped "
                "writes need separate K / V views (for TRT-LLM pools: kvx_trtllm.layer_views)")
        if not check:
            return _write_bound(cache, write)
        cache = cache.cache
    pools = _kernel_pools(cache)
    if pools is None:
        return reference.write_kv(cache, write)
    plan = check_write(cache, write, check=check)
    from .write import launch_write
    kd, ks, vd, vs, fmt = pools
    launch_write(smoothing.smooth_keys(cache, write.io.key), write.io.value, plan.args, kd, ks, vd, vs, fmt)


@torch.no_grad()
def gather_kv(cache: CacheDesc, gather: GatherDesc, out: KvIoDesc | None = None,
              out_dtype: torch.dtype | None = None, k_scale: ScaleDesc | None = None,
              v_scale: ScaleDesc | None = None) -> KvIoDesc:
    """`reference.gather_kv`, on the Triton gather kernel when possible (PACKED or KV_OFFSETS tables, primary
    pool)."""
    pools = _kernel_pools(cache)
    table = gather.block_table if isinstance(gather, GatherDesc) else None
    if pools is not None and _offsets(table):
        pools = _shift_v(pools)
    if pools is None or not (_packed(table) or _offsets(table)) \
            or (cache.pool is not None and cache.pool.secondary is not None):
        return reference.gather_kv(cache, gather, out, out_dtype, k_scale, v_scale)
    plan = check_gather(cache, gather, out, out_dtype, k_scale, v_scale)
    kd, ks, vd, vs, fmt = pools
    if _offsets(table):
        rows = offsets_kernel_table(table, gather.seq_lens, cache.block_size, kd.device, check=True)
        if rows is None:  # host blocks or another K/V pairing: the reference reads them
            return reference.gather_kv(cache, gather, out, out_dtype, k_scale, v_scale)
        bt, lens = rows
    else:  # the caller's dtype: the kernel launcher checks the used ids before narrowing
        bt = table.indices.reshape(table.seq_count, table.max_blocks_per_seq).to(kd.device).contiguous()
        lens = gather.seq_lens.lengths.to(kd.device)
    from .triton import gather_pools
    smoothed = smoothing.transforms_keys(cache)  # keys decoded to FP32, times s plus c, then cast once
    k, v = gather_pools(kd, ks, vd, vs, bt, lens, fmt, plan.k_gs, plan.v_gs, max_seq_len=plan.max_seq_len,
                         out_dtype=torch.float32 if smoothed else out_dtype,
                         out=(out.key, out.value) if out is not None and not smoothed else None)
    if smoothed:
        dtype = out.key.dtype if out is not None else (out_dtype or k.dtype)
        k, v = smoothing.unsmooth_keys(cache, k).to(dtype), v.to(dtype)
        if out is not None:
            out.key[:k.shape[0]].copy_(k)
            out.value[:v.shape[0]].copy_(v)
            return out
    return out if out is not None else KvIoDesc(k, v)


def _packed(table: BlockTable) -> bool:
    """PACKED tables: the kernels read them as they are."""
    return isinstance(table, BlockTable) and table.format == BlockTableFormat.PACKED


def _offsets(table: BlockTable) -> bool:
    """KV_OFFSETS tables: the kernels read their K plane (`checks.offsets_kernel_table`)."""
    return isinstance(table, BlockTable) and table.format == BlockTableFormat.KV_OFFSETS


def _kernel_table(table: BlockTable, seq_lens: SeqLens, block_size: int, device: torch.device, check: bool):
    """(int32 block rows, int32 lengths per row) the kernels read for this table, or None (the reference serves
    it). PACKED ids past a sequence's length may be stale and are never read, so they are narrowed unchecked;
    used ids are checked against each layer's cache in `run` (check) or owned by the engine."""
    if _offsets(table):
        return offsets_kernel_table(table, seq_lens, block_size, device, check=check)
    if not _packed(table):
        return None
    bt = table.indices.reshape(table.seq_count, table.max_blocks_per_seq).to(device).to(torch.int32).contiguous()
    return bt, narrow_int32(seq_lens.lengths.to(device), "seq_lens", check=check)


def _shift_v(pools):
    """For a KV_OFFSETS table: the pools with V read one block after K (`checks.offsets_kernel_table`), or None when
    K and V are not one block array (the pairing `V = K + 1` would not name this cache's V blocks)."""
    kd, ks, vd, vs, fmt = pools
    if kd.data_ptr() != vd.data_ptr() or kd.stride() != vd.stride() or (ks is None) != (vs is None) \
            or (ks is not None and ks.data_ptr() != vs.data_ptr()) or kd.shape[0] < 2:
        return None
    # K blocks [0, n-1), V blocks [1, n): one block count for both, and K entry e < n - 1 names V block e + 1
    return kd[:-1], None if ks is None else ks[:-1], vd[1:], None if vs is None else vs[1:], fmt


def _kernel_args(cache: CacheDesc, table: BlockTable, check: bool):
    """(k_data, k_scales, v_data, v_scales, k_global, v_global) for the attention kernels, or None (the
    reference serves the call): PACKED or KV_OFFSETS tables over kernel-addressable primary pools."""
    pools = _attention_pools(cache)
    if pools is None or not (_packed(table) or _offsets(table)):
        return None
    if _offsets(table):
        pools = _shift_v(pools)
        if pools is None:
            return None
    kd, ks, vd, vs, fmt = pools
    kg, vg = cache_global_scales(cache, fmt, None, None, "attention", check_values=check)
    return kd, ks, vd, vs, kg, vg


@dataclass(frozen=True)
class AttentionPlan:
    """One step's attention over descriptors (FlashInfer's plan/run, vLLM's metadata builder): built once per
    step from the step's block table and lengths by `plan_decode` / `plan_prefill`, then `run` once per layer
    with that layer's cache. The kernel plan (backend, splits, work list, workspace) and the int32 tables are made
    once; each run checks its cache against the plan on the host (no sync unless `check`) and takes the
    reference path for caches the kernels cannot address (CPU pools, other layouts)."""

    what: str  # "paged_decode" or "paged_prefill"
    fmt: CacheFormat
    table: BlockTable
    seq_lens: SeqLens
    qo_indptr: torch.Tensor | None
    num_qo_heads: int
    device: torch.device
    options: dict  # the attention options; "sinks": FP32 [Hq] on `device` (`attention.sink_values`) or None
    check: bool
    kernel: DecodePlan | PrefillPlan | None  # None: not on a device the kernels run on
    block_table: torch.Tensor | None  # int32 [B, max_blocks] for the kernels
    lens: torch.Tensor | None  # int32 [B] for the kernels (decode: one per query row, `DecodePlan.row_lens`)
    rows_per_seq: int = 1  # decode: query rows per sequence (speculative decoding: 1 + k)

    def with_sinks(self, sinks: torch.Tensor | None) -> AttentionPlan:
        """This step's plan for a layer with its own attention sinks `[Hq]` (vLLM: one tensor per layer, one plan per
        step for every layer of a group): the same tables, splits and workspace, the sinks checked as `plan_decode`
        checks them (their values only under `check`). None: the plan without sinks."""
        s = attention.sink_values(sinks, self.num_qo_heads, self.device, self.what, check_values=self.check)
        kernel = None if self.kernel is None else replace(self.kernel, sinks=s)  # every merge joins them
        return replace(self, options=dict(self.options, sinks=s), kernel=kernel)

    def _sinks_after_kernel(self, cache: CacheDesc, sinks: torch.Tensor | None = None) -> bool:
        """Whether the sinks (a run's `sinks`, else the plan's) join after the kernel, in torch: over a centered
        cache the kernels' logits are `q . (k - c)`, each row shifted by `q . c`, so the sink joins once
        `center_lse` has restored the LSE."""
        has = sinks is not None or self.options["sinks"] is not None
        return has and smoothing.center_of(cache) is not None

    def run(self, query: torch.Tensor, cache: CacheDesc | BoundLayer, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, *, want_lse: bool = True,
            sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of `query` over `cache` (this layer's descriptor, or the layer bound once by `bind`) ->
        (`out`, `lse`), written in place when given. `want_lse=False` (callers that only read `out`, e.g. an
        engine's decode) returns `(out, None)` and skips the LSE's centering correction
        (`ops.smoothing.center_lse`), a few small launches per layer. A bound layer's decode under `check=False`
        launches decode and merge and nothing else when it was bound for this plan's table format (else the
        descriptor it was bound from serves the call).

        `sinks`: this layer's attention sinks `[Hq]` in place of the plan's (vLLM: one tensor per layer, one plan
        per step for the layers of a group). On the bound decode path they must be FP32, contiguous, on the
        query's device (`attention.sink_values` once, when the engine loads them) and are not checked again;
        elsewhere they are checked as `with_sinks` checks them."""
        require(want_lse or lse is None, Status.INVALID_ARGUMENT, f"{self.what}: an lse buffer with want_lse=False")
        if isinstance(cache, BoundLayer):
            if not self.check and self.what == "paged_decode" and self.kernel is not None and not want_lse \
                    and cache.table_format == self.table.format and not self._sinks_after_kernel(cache.cache, sinks):
                return self.kernel.run_bound(query, cache, self.block_table, self.lens, out, want_lse=False,
                                             sinks=sinks)
            cache = cache.cache
        if sinks is not None:
            return self.with_sinks(sinks).run(query, cache, out, lse, want_lse=want_lse)
        attention.check_args(query, cache, self.table, self.seq_lens, self.what, **self.options)
        fmt = format_of(cache)
        require(fmt == self.fmt, Status.INVALID_ARGUMENT,
                f"{self.what}: the cache is {fmt.name}, the plan was made for {self.fmt.name}")
        if self.check and self.block_table is not None:  # the reference's gather validation, on this layer's cache
            cache.validate()
            if _offsets(self.table):
                self.table.validate(cache)
                self.seq_lens.validate(self.table, cache.block_size)
                check_block_ids(self.block_table, self.lens, cache.block_size, cache.num_blocks - 1)  # V = K + 1
            else:
                kernel_table(cache, self.table, self.seq_lens, check=True)
        args = None if self.kernel is None else _kernel_args(cache, self.table, self.check)
        if args is None:  # reads keys through the reference gather (times s, plus c)
            o, lse_t = self._reference(query, cache, out, lse)
            return o, lse_t if want_lse else None
        kernel, late = self.kernel, self._sinks_after_kernel(cache)
        if late:
            kernel = replace(kernel, sinks=None)
        s = smoothing.of(cache)
        if self.what == "paged_decode":  # the decode scales the queries by s as it loads them
            o, lse_t = kernel.run(query, *args, self.block_table, self.lens, out=out, lse=lse, k_smoothing=s,
                                  want_lse=want_lse or late)
        else:
            o, lse_t = kernel.run(smoothing.smooth_queries(cache, query), *args, self.block_table, self.lens,
                                  out=out, lse=lse)
        if not (want_lse or late):
            return o, None
        sm_scale = attention.softmax_scale(self.options["sm_scale"], cache.head_dim)
        lse_t = smoothing.center_lse(cache, query, lse_t, sm_scale)
        if late:  # one more rounding of the output, in its dtype
            o_s, lse_s = attention.apply_sinks(o, lse_t, self.options["sinks"])
            o.copy_(o_s)
            lse_t.copy_(lse_s)
        return o, lse_t if want_lse else None

    def _reference(self, query, cache, out, lse):
        opts = self.options
        if self.what == "paged_decode":
            o, lse_t = attention.paged_decode(query, cache, self.table, self.seq_lens,
                                              rows_per_seq=self.rows_per_seq, **opts)
        else:
            o, lse_t = attention.paged_prefill(query, self.qo_indptr, cache, self.table, self.seq_lens, **opts)
        if out is not None:
            require(isinstance(out, torch.Tensor) and out.shape == o.shape, Status.INVALID_ARGUMENT,
                    f"{self.what}: out must be {tuple(o.shape)}")
            o = out.copy_(o)
        if lse is not None:
            require(isinstance(lse, torch.Tensor) and lse.shape == lse_t.shape, Status.INVALID_ARGUMENT,
                    f"{self.what}: lse must be {tuple(lse_t.shape)}")
            lse_t = lse.copy_(lse_t)
        return o, lse_t


def _plan_tables(what: str, fmt, table: BlockTable, seq_lens: SeqLens, options: dict, device, check: bool,
                 block_size: int):
    """Checked options and (device, int32 block table, int32 lens) for the kernels (None, None, None off CUDA)."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    require_type(fmt, CacheFormat, f"{what}: fmt")
    check_table_types(table, seq_lens)
    attention.check_options(what, **options)
    device = torch.device(device) if device is not None else table.indices.device
    rows = _kernel_table(table, seq_lens, block_size, device, check) if _kernel_device(device) else None
    return (fmt, device, None, None) if rows is None else (fmt, device, *rows)


def plan_decode(table: BlockTable, seq_lens: SeqLens, *, fmt: CacheFormat | str, num_qo_heads: int,
                num_kv_heads: int, head_dim: int, block_size: int, q_dtype: torch.dtype, device=None,
                max_seq_len: int | None = None, sm_scale: float | None = None, softcap: float | None = None,
                window: int | None = None, check: bool = True, workspace: torch.Tensor | None = None,
                split_batch: int | None = None, sinks: torch.Tensor | None = None,
                rows_per_seq: int = 1) -> AttentionPlan:
    """Plan a decode step (one query token per sequence) for caches of this format and geometry on `device`
    (default: the table's). `max_seq_len` bounds the step's lengths (default: read from `seq_lens`, one host
    sync); with it and `check=False` planning never syncs, so engines plan in their metadata builder and run
    under CUDA graphs (with a persistent `workspace`: `ops.decode.workspace_size`, and `split_batch`: the graph
    bucket in query rows, see `ops.decode.plan_decode`). `sinks [Hq]`: attention sinks (`ops.attention`;
    `with_sinks` gives a layer's own). `rows_per_seq` (speculative decoding: 1 + k): that many query rows per
    sequence, its last cached tokens (`attention.paged_decode`); the per-row lengths are computed here, once per
    step, on the device. `check` refuses a sequence shorter than its rows (one host sync); without it such a
    sequence's rows attend `max(0, ...)` keys (`ops.decode.DecodePlan.row_lens`)."""
    options = dict(sm_scale=sm_scale, softcap=softcap, window=window)
    attention.check_rows_per_seq(rows_per_seq)
    rows_per_seq = int(rows_per_seq)
    fmt, device, bt, lens = _plan_tables("paged_decode", fmt, table, seq_lens, options, device, check, block_size)
    if check and rows_per_seq > 1:
        attention.check_rows_fit(rows_per_seq, seq_lens.lengths.to(torch.int64).tolist())
    kernel = None
    if bt is not None:
        if max_seq_len is None:
            max_seq_len = int(lens.max().item()) if lens.numel() else 0
        from . import decode as decode_kernel
        kernel = decode_kernel.plan_decode(fmt, batch=int(bt.shape[0]) * rows_per_seq, num_qo_heads=num_qo_heads,
                                           num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                                           q_dtype=q_dtype, device=device, max_seq_len=max_seq_len,
                                           workspace=workspace, split_batch=split_batch, rows_per_seq=rows_per_seq,
                                           **options)
        lens = kernel.row_lens(lens)
    plan = AttentionPlan("paged_decode", fmt, table, seq_lens, None, num_qo_heads, device, dict(options, sinks=None),
                         check, kernel, bt, lens, rows_per_seq)
    return plan if sinks is None else plan.with_sinks(sinks)


def plan_prefill(qo_indptr: torch.Tensor, table: BlockTable, seq_lens: SeqLens, *, fmt: CacheFormat | str,
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int, q_dtype: torch.dtype,
                 device=None, causal: bool = True, sm_scale: float | None = None, softcap: float | None = None,
                 window: int | None = None, check: bool = True, sinks: torch.Tensor | None = None,
                 queries_after: bool = False, max_seq_len: int | None = None,
                 num_splits: int | None = None) -> AttentionPlan:
    """Plan a prefill / extend step: sequence b's new queries are rows `qo_indptr[b]:qo_indptr[b+1]` (the work
    list reads `qo_indptr` on the host: pass it on the CPU to avoid a device sync). `causal=False` without a
    window attends every query to all of its sequence's cached tokens (`attention.paged_prefill`; with
    `queries_after` the queries follow them, for a window). `sinks`: as in `plan_decode`. `max_seq_len`: a host
    hint of the longest sequence (no sync) with which the kernel splits the keys of few programs over many SMs
    (`ops.triton.prefill.plan_prefill`); without it, no split. `num_splits` forces the kernel's key splits (tests,
    benchmarks, `ops.warmup`)."""
    options = dict(sm_scale=sm_scale, softcap=softcap, window=window)
    attention.check_options("paged_prefill", causal=causal, queries_after=queries_after)
    fmt, device, bt, lens = _plan_tables("paged_prefill", fmt, table, seq_lens, options, device, check, block_size)
    if bt is not None and bt.shape[0] != seq_lens.seq_count:  # beams: one query range per request, rows per beam
        bt = lens = None
    if check:  # on the caller's dtype, before narrowing
        attention.check_qo_indptr(qo_indptr, seq_lens.lengths.to(torch.int64).tolist(), None,
                                  attention.queries_cached(causal, window, queries_after))
    kernel = None
    if bt is not None and q_dtype in (torch.bfloat16, torch.float16):
        from .triton import prefill as prefill_kernel
        ip = narrow_int32(qo_indptr, "qo_indptr", check=check)
        kernel = prefill_kernel.plan_prefill(fmt, ip.cpu(), num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                             head_dim=head_dim, block_size=block_size, q_dtype=q_dtype,
                                             device=device, causal=causal, sm_scale=sm_scale, softcap=softcap,
                                             window_left=window, queries_after=queries_after,
                                             max_seq_len=max_seq_len, num_splits=num_splits)
    plan = AttentionPlan("paged_prefill", fmt, table, seq_lens, qo_indptr, num_qo_heads, device,
                         dict(options, causal=causal, sinks=None, queries_after=queries_after), check, kernel, bt, lens)
    return plan if sinks is None else plan.with_sinks(sinks)


def paged_decode(query: torch.Tensor, cache: CacheDesc, table: BlockTable, seq_lens: SeqLens, *,
                 sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                 max_seq_len: int | None = None, check: bool = True, sinks: torch.Tensor | None = None,
                 rows_per_seq: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention.paged_decode`, on the decode kernels (CUDA or Triton, `ops.decode`'s choice) for PACKED tables
    over kernel-addressable pools: `plan_decode` for this cache, then `run`. `check` validates the table against
    the cache (one host sync); engines that own their tables plan once per step with `check=False` and
    `max_seq_len` (sync-free: CUDA graphs) and run the plan per layer."""
    attention.check_args(query, cache, table, seq_lens, "paged_decode", sm_scale=sm_scale, softcap=softcap,
                         window=window, sinks=sinks)
    plan = plan_decode(table, seq_lens, fmt=format_of(cache), num_qo_heads=query.shape[1],
                       num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, block_size=cache.block_size,
                       q_dtype=query.dtype, device=query.device, max_seq_len=max_seq_len, sm_scale=sm_scale,
                       softcap=softcap, window=window, check=check, sinks=sinks, rows_per_seq=rows_per_seq)
    return plan.run(query, cache)


def paged_prefill(query: torch.Tensor, qo_indptr: torch.Tensor, cache: CacheDesc, table: BlockTable,
                  seq_lens: SeqLens, *, causal: bool = True, sm_scale: float | None = None,
                  softcap: float | None = None, window: int | None = None, check: bool = True,
                  sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention.paged_prefill`, on the Triton prefill kernel for PACKED tables over kernel-addressable
    pools: `plan_prefill` for this cache, then `run` (pass `qo_indptr` on the CPU to avoid a device sync)."""
    attention.check_args(query, cache, table, seq_lens, "paged_prefill", sm_scale=sm_scale, softcap=softcap,
                         window=window, sinks=sinks)
    plan = plan_prefill(qo_indptr, table, seq_lens, fmt=format_of(cache), num_qo_heads=query.shape[1],
                        num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, block_size=cache.block_size,
                        q_dtype=query.dtype, device=query.device, causal=causal, sm_scale=sm_scale,
                        softcap=softcap, window=window, check=check, sinks=sinks)
    return plan.run(query, cache)
