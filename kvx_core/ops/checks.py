"""Argument checks shared by every write / gather / attention entry point: the torch reference
(`ops.reference`), the dispatch (`ops.dispatch`) and the Triton launchers (`ops.triton`).

They run before anything is touched, so a rejected call changes nothing (K and V, data and scales, are written
all or nothing) and raises KvxError. Checks that read tensor values (slot ranges, global-scale values, block
ids) sync with the device; the sync-free paths (`check=False`) skip only those. Integer tensors are checked on
their own dtype before any narrowing cast (an int64 block id 2**32 + 1 must not become block 1).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ..codec import format_of
from ..descriptors import (
    BlockTable,
    CacheDesc,
    GatherDesc,
    KvIoDesc,
    ScaleDesc,
    SeqLens,
    SlotMapping,
    WriteDesc,
    finite_positive,
)
from ..enums import BlockTableFormat, DType, ScaleGranularity
from ..errors import KvxError, Status, require
from ..formats import CacheFormat, TensorFormat
from ..layouts import block_view

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
IO_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes of dense K/V written into or gathered from a cache."""


def require_type(value, cls: type, what: str) -> None:
    """INVALID_ARGUMENT unless `value` is a `cls` (instead of an AttributeError deep inside an op)."""
    require(isinstance(value, cls), Status.INVALID_ARGUMENT,
            f"{what} must be a {cls.__name__}, got {type(value).__name__}")


# ---------------------------------------------------------------- scales
def global_scale(tf: TensorFormat, g, num_heads: int, device: torch.device, what: str, *,
                 check_values: bool = True, build: bool = True) -> torch.Tensor | None:
    """`g` as the FP32 `[num_heads]` tensor the kernels and `TensorFormat.encode` take; None when `tf` has no
    global scale (and `None` means 1.0 for one that has). Shape [], [1] or [H]; with `check_values` (one host
    sync) finite and > 0 in FP32: a 0 / NaN / inf / negative scale would encode garbage. `build=False`: the type
    and shape checks only, no tensor made and no value read (None): a check of every layer before the layers'
    own use of their scales."""
    if not tf.uses_global_scale:
        return None
    if g is None:
        return torch.ones(num_heads, dtype=torch.float32, device=device) if build else None
    if isinstance(g, (int, float)) and not isinstance(g, bool):
        g = torch.tensor(float(g))
    require(isinstance(g, torch.Tensor) and g.is_floating_point()
            and (g.dim() == 0 or tuple(g.shape) in ((1,), (num_heads,))), Status.INVALID_ARGUMENT,
            f"{what} must be a float tensor of shape [], [1] or [H_kv={num_heads}], got "
            f"{(g.dtype, tuple(g.shape)) if isinstance(g, torch.Tensor) else type(g).__name__}")
    if not build:
        return None
    if g.dtype == torch.float32 and g.device == torch.device(device) and tuple(g.shape) == (num_heads,) \
            and g.is_contiguous():
        out = g  # already what the chain below gives (a view of `g`): no tensor op per call
    else:
        out = g.to(device=device, dtype=torch.float32).reshape(-1).expand(num_heads).contiguous()
    if check_values:
        require(bool(finite_positive(out)), Status.INVALID_ARGUMENT,
                f"{what} must be finite and > 0 in FP32, got {g.tolist()}")
    return out


def _v10_scale(desc: ScaleDesc | None, cache: CacheDesc, tf: TensorFormat, what: str) -> torch.Tensor | None:
    """The tensor of a v1.0 FP8 per-tensor / per-head scale descriptor, None when absent. A scale given to a
    cache that takes none from the call (v1.1 caches carry theirs in `quant`) is refused, not ignored."""
    if desc is None:
        return None
    require_type(desc, ScaleDesc, what)
    if desc.tensor is None:
        return None
    require(cache.quant is None and tf.uses_global_scale, Status.INVALID_ARGUMENT,
            f"{what} applies to v1.0 FP8 caches only; this cache "
            f"{'carries its scales in its quantization descriptor' if cache.quant is not None else 'takes none'}")
    t = desc.tensor
    require_type(t, torch.Tensor, f"{what}.tensor")
    want = {ScaleGranularity.PER_TENSOR: 1, ScaleGranularity.PER_HEAD: cache.num_kv_heads}
    require(desc.granularity in want and desc.dtype == DType.F32 and t.dtype == torch.float32, Status.INVALID_ARGUMENT,
            f"{what} must be an F32 PER_TENSOR or PER_HEAD scale, got {desc.granularity!r} {desc.dtype!r} {t.dtype}")
    require(t.numel() == want[desc.granularity], Status.INVALID_ARGUMENT,
            f"{what}: a {ScaleGranularity(desc.granularity).name} scale has {want[desc.granularity]} value(s), "
            f"got shape {tuple(t.shape)}")
    return t


def cache_global_scales(cache: CacheDesc, fmt: CacheFormat, k10: ScaleDesc | None, v10: ScaleDesc | None, what: str,
                        *, check_values: bool = True, build: bool = True
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validated FP32 `[H]` global scales of K and V: from `cache.quant` (v1.1) or the call's v1.0 FP8 scale
    descriptors `k10` / `v10` (`build`: as for `global_scale`)."""
    out = []
    for which, tf, d10 in (("k", fmt.k, k10), ("v", fmt.v, v10)):
        g = _v10_scale(d10, cache, tf, f"{what}.{which}_scale")
        if cache.quant is not None:
            g = getattr(cache.quant, f"{which}_global_scale")
        name = f"quant.{which}_global_scale" if cache.quant is not None else f"{what}.{which}_scale"
        out.append(global_scale(tf, g, cache.num_kv_heads, cache.k.tensor.device, name, check_values=check_values,
                                build=build))
    return out[0], out[1]


# ---------------------------------------------------------------- write
@dataclass(frozen=True)
class WriteArgs:
    """A checked write: slots on the K/V device (negative where a token is skipped: every kernel skips those)
    and the FP32 `[H]` global scales (None for sides without one)."""

    slots: torch.Tensor
    k_gs: torch.Tensor | None
    v_gs: torch.Tensor | None

    @property
    def keep(self) -> torch.Tensor:
        """Mask of the tokens really written (the reference and the checks index with it)."""
        return self.slots >= 0


def kernel_slots(slots: torch.Tensor, device: torch.device, invalid_slot: int) -> torch.Tensor:
    """The slot mapping as the write kernels take it: int64 on `device` (a no-op for engines' int64 mappings),
    a non-negative `invalid_slot` turned into -1 (negative slots are skipped by every kernel as they are)."""
    s = slots.to(device, torch.int64)
    return torch.where(s == invalid_slot, -1, s) if invalid_slot >= 0 else s


def check_write_args(fmt: CacheFormat, key, value, slots, *, num_slots: int, num_kv_heads: int, k_gs=None,
                     v_gs=None, invalid_slot: int = -1, check: bool = True) -> WriteArgs:
    """THE write check, first thing in every write entry point (reference, dispatch, Triton launcher):
    both sides' K/V tensors, the slot mapping and both global scales, before any pool is touched.
    `check` adds the value checks (host syncs): slots in range and unique, scales finite and > 0."""
    for name, x in (("key", key), ("value", value)):
        require_type(x, torch.Tensor, f"write {name}")
        require(x.dim() == 3 and x.shape[1] == num_kv_heads, Status.INVALID_ARGUMENT,
                f"write {name} must be [tokens, num_kv_heads={num_kv_heads}, head_dim], got {tuple(x.shape)}")
        require(x.dtype in IO_DTYPES, Status.UNSUPPORTED, f"write {name} dtype {x.dtype} unsupported (F16, BF16, F32)")
    require(key.shape == value.shape and key.device == value.device, Status.INVALID_ARGUMENT,
            f"write key and value must have one shape and device, got {tuple(key.shape)} on {key.device} and "
            f"{tuple(value.shape)} on {value.device}")
    fmt.check_head_dim(int(key.shape[2]))
    require_type(slots, torch.Tensor, "slot mapping")
    require(slots.dim() == 1 and slots.dtype in (torch.int32, torch.int64) and slots.numel() == key.shape[0],
            Status.INVALID_ARGUMENT, f"slot mapping must be int32/int64 [tokens={key.shape[0]}], got {slots.dtype} "
            f"{tuple(slots.shape)}")
    kg = global_scale(fmt.k, k_gs, num_kv_heads, key.device, "K global scale", check_values=check)
    vg = global_scale(fmt.v, v_gs, num_kv_heads, key.device, "V global scale", check_values=check)
    s = kernel_slots(slots, key.device, invalid_slot)
    if check:
        valid = s[s >= 0]
        hi = int(valid.max()) if valid.numel() else -1
        require(hi < num_slots, Status.OUT_OF_RANGE, f"slot {hi} is out of range: the cache has {num_slots} slots")
        require(valid.unique().numel() == valid.numel(), Status.INVALID_ARGUMENT,
                "slot mapping names the same slot twice in one write batch")
    return WriteArgs(s, kg, vg)


@dataclass(frozen=True)
class WritePlan:
    """A checked `write_kv` call on a cache descriptor: its format and checked arguments."""

    fmt: CacheFormat
    args: WriteArgs


def check_write(cache: CacheDesc, write: WriteDesc, *, check: bool = True) -> WritePlan:
    """Descriptor-level write check (reference and dispatch): the descriptors (`check`: also their values),
    the v1.0 FP8 scale descriptors, then `check_write_args`, and that K and V do not overlap at the written
    slots. Nothing after this may reject the write."""
    require_type(cache, CacheDesc, "cache")
    require_type(write, WriteDesc, "write")
    require_type(write.io, KvIoDesc, "write.io")
    require_type(write.slots, SlotMapping, "write.slots")
    for what, t in (("write key", write.io.key), ("write value", write.io.value), ("slot mapping", write.slots.slots)):
        require_type(t, torch.Tensor, what)
    if check:
        cache.validate()
        write.validate(cache)
    k5, v5 = block_view(cache.k.tensor, cache.k.layout), block_view(cache.v.tensor, cache.v.layout)
    require(k5.data_ptr() != v5.data_ptr() or k5.stride() != v5.stride(), Status.INVALID_ARGUMENT,
            "write: the cache's K and V are one block array (a TRT-LLM pool layer read through KV_OFFSETS tables), so "
            "a slot-mapped write would store V over K; write through per-layer K/V views (kvx_trtllm.layer_views)")
    fmt = format_of(cache)
    kg, vg = cache_global_scales(cache, fmt, write.k_scale, write.v_scale, "write", check_values=check)
    args = check_write_args(fmt, write.io.key, write.io.value, write.slots.slots,
                            num_slots=cache.num_blocks * cache.block_size, num_kv_heads=cache.num_kv_heads,
                            k_gs=kg, v_gs=vg, invalid_slot=write.slots.invalid_slot, check=check)
    if check:
        slots = args.slots[args.keep]
        check_disjoint(k5, v5, slots // cache.block_size, slots % cache.block_size)
    return WritePlan(fmt, args)


def _byte_offsets(view5: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Storage byte offsets of every element of rows `view5[blk, off]` (a 5-D block view)."""
    s, es = view5.stride(), view5.element_size()
    idx = [torch.arange(n, device=blk.device) * st for n, st in zip(view5.shape[2:], s[2:], strict=True)]
    inner = idx[0][:, None, None] + idx[1][None, :, None] + idx[2][None, None, :]
    return ((view5.storage_offset() + blk * s[0] + off * s[1])[:, None, None, None] + inner).flatten() * es


def _blocks_disjoint(k5: torch.Tensor, v5: torch.Tensor) -> bool:
    """O(1) sufficient test: K and V blocks share a byte stride, each block's bytes fit in one stride,
    and V's bytes sit beside K's within it (regions of one page, or FlashInfer's interleaved [N, 2, ...])."""
    es = k5.element_size()
    stride = k5.stride(0) * es
    if v5.stride(0) * v5.element_size() != stride:
        return False
    inner = [(sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:], strict=True)) + 1) * t.element_size()
             for t in (k5, v5)]
    if max(inner) > stride:
        return False
    d = (v5.storage_offset() * v5.element_size() - k5.storage_offset() * es) % stride
    return inner[0] <= d and d + inner[1] <= stride


def check_disjoint(k5: torch.Tensor, v5: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> None:
    """The K and V elements a write touches must be distinct (a TRT-LLM pool view, where K and V share
    one buffer and are told apart only by KV_OFFSETS, is for gathering, not slot-mapped writes)."""
    if k5.untyped_storage().data_ptr() != v5.untyped_storage().data_ptr() or blk.numel() == 0:
        return
    if _blocks_disjoint(k5, v5):
        return
    require(not bool(torch.isin(_byte_offsets(k5, blk, off), _byte_offsets(v5, blk, off)).any()),
            Status.INVALID_ARGUMENT, "cache K and V overlap in memory at the written slots, so a write would "
            "hit both; slot-mapped writes need disjoint K and V (for a TRT-LLM pool, use per-layer K/V views)")


# ---------------------------------------------------------------- gather
def check_max_seq_len(value) -> int:
    """`max_seq_len` as an int in [0, 2**32 - 1] (the C field is uint32; a float or bool is refused, not
    truncated)."""
    require(not isinstance(value, bool) and hasattr(type(value), "__index__"), Status.INVALID_ARGUMENT,
            f"max_seq_len must be an int, got {type(value).__name__} {value!r}")
    n = operator.index(value)
    require(0 <= n <= UINT32_MAX, Status.INVALID_ARGUMENT, f"max_seq_len must be in [0, {UINT32_MAX}], got {n}")
    return n


def check_table_types(table: BlockTable, seq_lens: SeqLens) -> None:
    """The block table and lengths are descriptors over tensors (before their own `validate` reads them)."""
    require_type(table, BlockTable, "block table")
    require_type(table.indices, torch.Tensor, "block_table.indices")
    require(table.indptr is None or isinstance(table.indptr, torch.Tensor), Status.INVALID_ARGUMENT,
            f"block_table.indptr must be a tensor or None, got {type(table.indptr).__name__}")
    require_type(seq_lens, SeqLens, "seq_lens")
    require_type(seq_lens.lengths, torch.Tensor, "seq_lens.lengths")


def check_table_shape(table: BlockTable) -> None:
    """Index tensors of a validated table have its format's shape (or are flat, as a C buffer is): RAGGED
    `[indices_count]`, PACKED `[seqs, max_blocks]`, KV_OFFSETS `[seqs, beam, 2, max_blocks]` (a matching
    count alone would let `[1, n]` or `[n, 1]` through to fail deep inside the gather)."""
    s, m = table.seq_count, table.max_blocks_per_seq
    full = {BlockTableFormat.RAGGED: None, BlockTableFormat.PACKED: (s, m),
            BlockTableFormat.KV_OFFSETS: (s, table.beam_width, 2, m)}[BlockTableFormat(table.format)]
    shape = tuple(table.indices.shape)
    require(len(shape) == 1 or shape == full, Status.INVALID_ARGUMENT,
            f"{BlockTableFormat(table.format).name} block_table.indices must be 1-D"
            + (f" or {list(full)}" if full else "") + f", got shape {list(shape)}")


def check_out(out: KvIoDesc, cache: CacheDesc, total: int, out_dtype: torch.dtype | None) -> None:
    """A gather output: shaped for the cache, room for `total` tokens, of `out_dtype` when both are given,
    and not overlapping the cache's pools or itself (a gather must not write into the cache)."""
    require_type(out, KvIoDesc, "gather out")
    require_type(out.key, torch.Tensor, "gather out.key")
    require_type(out.value, torch.Tensor, "gather out.value")
    out.validate(cache, "gather out")
    require(out.num_tokens >= total, Status.INVALID_ARGUMENT, f"gather output holds {out.num_tokens} tokens, "
            f"{total} are gathered")
    require(out_dtype is None or out.key.dtype == out.value.dtype == out_dtype, Status.INVALID_ARGUMENT,
            f"out_dtype {out_dtype} differs from the gather output's {out.key.dtype} / {out.value.dtype}")
    q = cache.quant
    pools = {"K": cache.k.tensor, "V": cache.v.tensor,
             "K scales": q.k_scales.tensor if q is not None and q.k_scales is not None else None,
             "V scales": q.v_scales.tensor if q is not None and q.v_scales is not None else None,
             "secondary": cache.pool.secondary if cache.pool is not None else None}
    check_no_alias({"out.key": out.key, "out.value": out.value}, pools)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Address range [first byte, last byte + 1) of `t`'s elements (empty for an empty tensor)."""
    if t.numel() == 0:
        return 0, 0
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a.device == b.device and a0 < b1 and b0 < a1


def check_no_alias(outputs: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor | None]) -> None:
    """INVALID_ARGUMENT when output tensors overlap each other or an input (by address range)."""
    names = list(outputs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            require(not _overlap(outputs[a], outputs[b]), Status.INVALID_ARGUMENT,
                    f"gather {a} and {b} overlap in memory")
        for b, t in inputs.items():
            require(t is None or not _overlap(outputs[a], t), Status.INVALID_ARGUMENT,
                    f"gather {a} overlaps the cache's {b} pool in memory (a gather must not write into the cache)")


def check_out_dtype(out_dtype) -> None:
    """A gather's `out_dtype`: None (the default for the cache) or a dense K/V dtype."""
    require(out_dtype is None or isinstance(out_dtype, torch.dtype), Status.INVALID_ARGUMENT,
            f"out_dtype must be a torch.dtype or None, got {out_dtype!r}")
    require(out_dtype is None or out_dtype in IO_DTYPES, Status.UNSUPPORTED,
            f"out_dtype {out_dtype} unsupported (F16, BF16, F32)")


@dataclass(frozen=True)
class GatherPlan:
    """A checked `gather_kv` call: the cache format, `max_seq_len` as an int, tokens gathered, and the
    FP32 `[H]` global scales (None for sides without one)."""

    fmt: CacheFormat
    max_seq_len: int
    total: int
    k_gs: torch.Tensor | None
    v_gs: torch.Tensor | None


def check_gather(cache: CacheDesc, gather: GatherDesc, out: KvIoDesc | None, out_dtype: torch.dtype | None,
                 k_scale: ScaleDesc | None, v_scale: ScaleDesc | None) -> GatherPlan:
    """Every `gather_kv` argument, before anything is read or written (reference and dispatch)."""
    require_type(cache, CacheDesc, "cache")
    require_type(gather, GatherDesc, "gather")
    cache.validate()
    max_seq_len = check_max_seq_len(gather.max_seq_len)
    check_table_types(gather.block_table, gather.seq_lens)
    gather.validate(cache)
    check_table_shape(gather.block_table)
    check_out_dtype(out_dtype)
    total = int(gather.output_lengths().sum())
    if out is not None:
        check_out(out, cache, total, out_dtype)
    fmt = format_of(cache)
    kg, vg = cache_global_scales(cache, fmt, k_scale, v_scale, "gather")
    return GatherPlan(fmt, max_seq_len, total, kg, vg)


# ---------------------------------------------------------------- block tables for the kernels
def check_block_ids(bt: torch.Tensor, lens: torch.Tensor, block_size: int, num_blocks: int) -> None:
    """OUT_OF_RANGE unless every block a sequence uses (its first ceil(len / block_size) entries; the rest
    of the row may hold stale ids) is a block of the cache. Checked on the table's own dtype. One host sync."""
    need = torch.arange(bt.shape[1], device=bt.device)[None, :] * block_size < lens.to(bt.device, torch.int64)[:, None]
    bad = need & ((bt < 0) | (bt >= num_blocks))
    if bool(bad.any()):
        s, j = (int(i) for i in bad.nonzero()[0])
        raise KvxError(Status.OUT_OF_RANGE, f"block table entry [{s}, {j}] = {int(bt[s, j])} is outside the cache's "
                       f"blocks [0, {num_blocks})")


def narrow_int32(t: torch.Tensor, what: str, *, check: bool) -> torch.Tensor:
    """`t` as int32 for the kernels; with `check` (one host sync), INVALID_ARGUMENT when a value does not fit
    (a narrowing cast would wrap it silently)."""
    if check and t.dtype != torch.int32 and t.numel():
        require(bool(((t >= -INT32_MAX - 1) & (t <= INT32_MAX)).all()), Status.INVALID_ARGUMENT,
                f"{what} holds values that do not fit int32")
    return t.to(torch.int32)


def kernel_table(cache: CacheDesc, table: BlockTable, seq_lens: SeqLens, *,
                 check: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 block table `[B, max_blocks]` contiguous, int32 seq_lens `[B]`) of a PACKED table on the cache
    device, as the attention kernels read them. `check` first validates on the callers' dtypes what the
    reference's gather validates (table and lengths against the cache, used block ids in range), then
    narrows; unused entries (stale ids past a sequence's length) are never read, so they are not checked."""
    check_table_types(table, seq_lens)
    dev = cache.k.tensor.device
    if check:
        table.validate(cache)
        check_table_shape(table)
        seq_lens.validate(table, cache.block_size)
    bt = table.indices.reshape(table.seq_count, table.max_blocks_per_seq).to(dev)
    lens = seq_lens.lengths.to(dev)
    if check:
        check_block_ids(bt, lens, cache.block_size, cache.num_blocks)
    return bt.to(torch.int32).contiguous(), narrow_int32(lens, "seq_lens", check=check)


def offsets_kernel_table(table: BlockTable, seq_lens: SeqLens, block_size: int, device: torch.device, *,
                         check: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A KV_OFFSETS table (TRT-LLM's KVCacheIndex offsets) as the attention kernels read it: (int32 rows of its K
    plane `[seqs * beams, max_blocks]`, int32 lengths per row), or None when the kernels cannot read it.

    TRT-LLM's offsets name a layer's K block `e` and its V block `e + 1` in one block array (`(mem_idx * layers) *
    2 + kv`), so the kernels read K through the K plane and V through the same entries over the block array
    shifted by one block (`ops.dispatch._shift_v`): TRT-LLM's own offsets, no block-id conversion. With `check`
    (one host sync) every entry a sequence uses must be a primary-pool block (not null, not bit 31) whose V entry
    is its K entry + 1, else None (the reference serves the call). Without `check` the caller vouches for that
    layout, which is how TRT-LLM's KV cache manager writes its tables."""
    check_table_shape(table)  # host metadata only: a malformed table is a KvxError, not a reshape error
    s, w, m = table.seq_count, table.beam_width, table.max_blocks_per_seq
    o = table.indices.reshape(s, w, 2, m).to(device)
    k = o[:, :, 0].reshape(s * w, m)
    lens = seq_lens.lengths.to(device).to(torch.int64).repeat_interleave(w)
    if check:
        used = torch.arange(m, device=device)[None, :] * block_size < lens[:, None]
        v = o[:, :, 1].reshape(s * w, m)
        if not bool((~used | ((k >= 0) & (v.to(torch.int64) == k.to(torch.int64) + 1))).all()):
            return None
    return k.to(torch.int32).contiguous(), narrow_int32(lens, "seq_lens", check=check)

