"""TensorRT-LLM <-> KVX: KVBlockArray pools addressed by KVCacheIndex block offsets.

Facts used (NVIDIA/TensorRT-LLM; docs/engine_layouts.md §17.3, commits in §17.6):
- `cpp/tensorrt_llm/kernels/kvCacheUtils.h` `KVBlockArray`: block offsets table `[B, W, 2, M]`
  (`getRowPtr`: `data + seqIdx * M * 2 + kvIdx * M`, seqIdx running over batch * beam); block address
  `getPoolPtr(offset) + offset.get() * mBytesPerBlock` with `mBytesPerBlock = tokensPerBlock *
  bytesPerToken`; block interior `[numHeads, tokensPerBlock, hiddenSizePerHead]` (`getKVLocalIdx`);
  `tokensPerBlock` must be a power of two (`mTokensPerBlockLog2`).
- `cpp/include/tensorrt_llm/kernels/kvCacheIndex.h`: int32, bit 31 = secondary pool, all bits set = null.
- `cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`: pools are `{numPrimaryBlocks, numLayers,
  kvFactor, blockSize}` (secondary: `{numSecondaryBlocks, ...}`, pinned host); `setOffsets` stores
  `flat_index3(memoryPoolBlockIndex, layerIdx=0, kv, numLayers, kvFactor)`, i.e.
  `(mem_idx * num_layers + 0) * kv_factor + kv`.
- `cpp/tensorrt_llm/thop/attentionOp.cpp`: the kernel's pool pointer for a layer is the pool base plus
  `intra_pool_offset = layer_idx_in_cache_pool * kv_factor * bytes_per_block`, with
  `bytes_per_block = tokens_per_block * num_kv_heads * head_size * cache_elem_bits / 8`. So a layer's
  block lives at `base + ((mem_idx * num_layers + layer) * kv_factor + kv) * bytes_per_block`.
- `tensorrt_llm/_torch/pyexecutor/resource_manager.py` `KVCacheManager.get_unique_primary_pool()`
  (that pool) and `get_buffers(layer_idx, kv_layout)` (`[blocks, kv_factor, T, H, D]` for NHD,
  `[blocks, kv_factor, H, T, D]` for HND: per-layer views used by the PyTorch-side backends).

Two descriptions of one layer, pick by the block table you hold:
- `from_trtllm_pool` + `from_trtllm_offsets`: KVX KV_OFFSETS, exactly the kernel's addressing (the
  raw offsets table, the layer-shifted pool, primary and secondary pools). Gather only: K and V have
  different block ids, so slot-mapping writes do not apply.
- `from_trtllm_layer` (or `from_trtllm_buffers`) + PACKED tables of memory-pool block indices
  (`packed_from_kv_offsets`): per-layer strided K/V views; `write_kv` and `gather_kv` both apply.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvx_core.allocator import as_int
from kvx_core.block_tables import blocks_needed, is_power_of_two, make_kv_cache_index, split_kv_cache_index
from kvx_core.descriptors import BlockTable, CacheDesc, PoolDesc, SeqLens, memory_of
from kvx_core.enums import Layout
from kvx_core.errors import Status, require

from . import (
    _as_cache_dtype,
    _check_geometry,
    _describe,
    _index_tensor,
    _logical,
    _name_layout,
    _packed_rows,
    _seq_lens,
    _tensor,
)

KV_LAYOUTS = ("NHD", "HND")


def _check_tokens_per_block(tokens_per_block: int) -> int:
    """The checked int (a float or bool is refused, never truncated)."""
    t = as_int(tokens_per_block, "TRT-LLM tokens_per_block", 1)
    require(is_power_of_two(t), Status.INVALID_ARGUMENT,
            f"TRT-LLM tokens_per_block must be a power of two (KVBlockArray shifts by mTokensPerBlockLog2), got {t}")
    return t


def _check_kv_factor(kv_factor: int) -> int:
    k = as_int(kv_factor, "kv_factor")
    require(k in (1, 2), Status.INVALID_ARGUMENT, f"kv_factor must be 1 (K only) or 2 (K, V), got {k}")
    return k


def _check_heads(num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    return as_int(num_kv_heads, "num_kv_heads", 1), as_int(head_dim, "head_dim", 1)


def bytes_per_block(tokens_per_block: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """`KVBlockArray::mBytesPerBlock` = tokens_per_block * num_kv_heads * head_dim * elem_bits / 8."""
    elem_bits = torch.empty((), dtype=dtype).element_size() * 8
    return tokens_per_block * num_kv_heads * head_dim * elem_bits // 8


def _typed_pool(pool: object, cache_dtype: torch.dtype | None, what: str) -> torch.Tensor:
    """A TRT-LLM pool (typed, or raw bytes plus `cache_dtype`) as a tensor of cache elements."""
    t = _tensor(pool, what)
    require(t.is_contiguous(), Status.INVALID_ARGUMENT,
            f"{what} must be the contiguous pool allocation (KVBlockArray addresses it by byte offsets), "
            f"got strides {tuple(t.stride())}")
    if (cache_dtype is not None and t.dtype in (torch.uint8, torch.int8)
            and torch.empty((), dtype=cache_dtype).element_size() != 1):
        es = torch.empty((), dtype=cache_dtype).element_size()
        require(t.numel() % es == 0, Status.INVALID_ARGUMENT, f"{what}: {t.numel()} bytes is not a whole number "
                f"of {cache_dtype} elements")
        t = t.reshape(-1).view(cache_dtype)
    return _as_cache_dtype(t, cache_dtype, what)


def _flat_blocks(pool: torch.Tensor, first_block: int, h: int, t: int, d: int, what: str) -> torch.Tensor:
    """`[n, H, T, D]` blocks of a contiguous pool, starting `first_block` blocks after its base."""
    per_block = h * t * d
    flat = pool.reshape(-1)
    start = first_block * per_block
    n = (flat.numel() - start) // per_block
    require(n > 0, Status.INVALID_ARGUMENT,
            f"{what} of {flat.numel()} elements holds no block of {per_block} elements after block {first_block}")
    return flat[start:start + n * per_block].view(n, h, t, d)


def from_trtllm_pool(primary_pool: torch.Tensor, *, tokens_per_block: int, num_kv_heads: int, head_dim: int,
                     layer: int = 0, kv_factor: int = 2, cache_dtype: torch.dtype | None = None,
                     secondary_pool: torch.Tensor | None = None) -> CacheDesc:
    """Describe a TRT-LLM KV pool as KVBlockArray sees it for one layer (zero-copy), for KV_OFFSETS tables.

    `primary_pool` is the pool allocation: `get_unique_primary_pool()` `[blocks, num_layers, kv_factor,
    H * T * D]` (checked), a bare `[n, H, T, D]` block array (`TrtllmBlockArray.primary`), or the same
    memory flat / as bytes (`cache_dtype` then names the element type). K and V are both the `[n, H, T, D]` (HND) block
    array starting at the layer's pool pointer, base + `layer * kv_factor * bytes_per_block` (`attentionOp.cpp`
    `intra_pool_offset`), so the raw offsets TRT-LLM stores (`(mem_idx * num_layers) * kv_factor + kv`) index it
    unchanged; with `layer=0`, absolute offsets `(mem_idx * num_layers + layer) * kv_factor + kv` index it instead.
    `secondary_pool` (the pinned host pool, same layout) serves offsets with bit 31 set.
    """
    t, kv_factor = _check_tokens_per_block(tokens_per_block), _check_kv_factor(kv_factor)
    h, d = _check_heads(num_kv_heads, head_dim)
    pools = []
    for what, raw in (("primary_pool", primary_pool), ("secondary_pool", secondary_pool)):
        if raw is None:
            pools.append(None)
            continue
        p = _typed_pool(raw, cache_dtype, f"TRT-LLM {what}")
        if p.dim() == 4 and tuple(p.shape[1:]) != (h, t, d):  # not a bare [n, H, T, D] block array
            require(p.shape[2] == kv_factor and p.shape[3] == h * t * d and 0 <= layer < p.shape[1],
                    Status.INVALID_ARGUMENT,
                    f"TRT-LLM {what} {tuple(p.shape)} must be [blocks, num_layers, kv_factor={kv_factor}, "
                    f"H*T*D={h * t * d}] with layer {layer} < num_layers")
        pools.append(_flat_blocks(p, layer * kv_factor, h, t, d, f"TRT-LLM {what}"))
    prim, sec = pools
    require(sec is None or (sec.dtype == prim.dtype), Status.INVALID_ARGUMENT,
            "TRT-LLM primary and secondary pools must hold one dtype")
    pool = PoolDesc(memory_of(prim), h * t * d * prim.element_size(), primary=prim, secondary=sec)
    return _describe(prim, Layout.HND, prim, Layout.HND, block_size=t, num_kv_heads=h, head_dim=d, pool=pool)


def from_trtllm_offsets(offsets: torch.Tensor, *, beam_width: int | None = None) -> BlockTable:
    """TRT-LLM block offsets -> KVX KV_OFFSETS table (zero-copy).

    Takes `[B, W, 2, M]` int32 KVCacheIndex values, or the `[B * W, 2, M]` slice of the PyTorch
    backend's `kv_cache_block_offsets[pool_idx]` with `beam_width` (default 1).
    """
    beam_width = None if beam_width is None else as_int(beam_width, "beam_width", 1)
    o = _index_tensor(offsets, "TRT-LLM block offsets", (3, 4), (torch.int32,))
    require(o.shape[-2] == 2, Status.INVALID_ARGUMENT,
            f"TRT-LLM block offsets need a K/V dim of 2 at dim -2, got shape {tuple(o.shape)}")
    if o.dim() == 3:
        w = beam_width or 1
        require(o.shape[0] % w == 0, Status.INVALID_ARGUMENT,
                f"{o.shape[0]} offset rows are not a whole number of beams of width {w}")
        o = o.view(o.shape[0] // w, w, 2, o.shape[2])
    require(beam_width is None or o.shape[1] == beam_width, Status.INVALID_ARGUMENT,
            f"offsets have beam width {o.shape[1]}, beam_width={beam_width} was given")
    return BlockTable.kv_offsets(o)


def seq_lens_from_trtllm(sequence_lengths: torch.Tensor, *, beam_width: int = 1) -> SeqLens:
    """TRT-LLM `sequence_lengths` (one per batch * beam row, equal within a request) -> KVX SeqLens."""
    t = _index_tensor(sequence_lengths, "TRT-LLM sequence_lengths", 1)
    require(beam_width >= 1 and t.numel() % beam_width == 0, Status.INVALID_ARGUMENT,
            f"{t.numel()} sequence lengths are not a whole number of beams of width {beam_width}")
    if beam_width > 1:
        rows = t.view(-1, beam_width)
        require(bool((rows == rows[:, :1]).all()), Status.INVALID_ARGUMENT,
                "the beams of one request must have one sequence length")
        t = rows[:, 0]
    return _seq_lens(t, "TRT-LLM sequence_lengths")


# ---------------------------------------------------------------- per-layer (PACKED) views
def from_trtllm_buffers(buffers: torch.Tensor, *, kv_layout: str = "NHD",
                        cache_dtype: torch.dtype | None = None) -> CacheDesc:
    """Describe `KVCacheManager.get_buffers(layer_idx, kv_layout)` (zero-copy).

    `[blocks, 2, T, H, D]` for `"NHD"`, `[blocks, 2, H, T, D]` for `"HND"` (the C++ kernels' interior);
    block ids are memory-pool block indices. kv_factor 1 (K-only) buffers have no V: UNSUPPORTED.
    """
    require(kv_layout in KV_LAYOUTS, Status.INVALID_ARGUMENT, f"kv_layout must be NHD or HND, got {kv_layout!r}")
    b = _as_cache_dtype(_tensor(buffers, "TRT-LLM buffers", 5), cache_dtype, "TRT-LLM buffers")
    require(b.shape[1] == 2, Status.UNSUPPORTED if b.shape[1] == 1 else Status.INVALID_ARGUMENT,
            f"TRT-LLM buffers {tuple(b.shape)} need kv_factor 2 at dim 1 (K-only caches have no V)")
    k, v = b[:, 0], b[:, 1]
    if kv_layout == "HND":
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    _, t, h, d = k.shape
    _check_tokens_per_block(t)
    (kl, kt), (vl, vt) = _name_layout(k), _name_layout(v)
    return _describe(kt, kl, vt, vl, block_size=t, num_kv_heads=h, head_dim=d)


def from_trtllm_layer(primary_pool: torch.Tensor, layer: int, *, tokens_per_block: int, num_kv_heads: int,
                      head_dim: int, num_layers: int | None = None, kv_layout: str = "HND",
                      cache_dtype: torch.dtype | None = None) -> CacheDesc:
    """One layer of the unique primary pool as strided K/V views (zero-copy), for PACKED tables.

    `primary_pool` is `[blocks, num_layers, 2, H * T * D]` (or the same memory flat / as bytes, with
    `num_layers`). `kv_layout="HND"` (default) is the C++ KVBlockArray interior `[H, T, D]`; `"NHD"`
    matches `get_buffers(layer, "NHD")`.
    """
    t = _check_tokens_per_block(tokens_per_block)
    require(kv_layout in KV_LAYOUTS, Status.INVALID_ARGUMENT, f"kv_layout must be NHD or HND, got {kv_layout!r}")
    h, d = _check_heads(num_kv_heads, head_dim)
    p = _typed_pool(primary_pool, cache_dtype, "TRT-LLM primary_pool")
    if p.dim() == 4:
        _check_geometry("TRT-LLM pool", {"num_layers": p.shape[1]}, num_layers=num_layers)
        require(p.shape[2] == 2 and p.shape[3] == h * t * d, Status.INVALID_ARGUMENT,
                f"TRT-LLM primary_pool {tuple(p.shape)} must be [blocks, num_layers, 2, H*T*D={h * t * d}]")
        num_layers = p.shape[1]
    require(num_layers is not None and num_layers > 0, Status.INVALID_ARGUMENT,
            "a flat TRT-LLM pool needs num_layers")
    per_row = num_layers * 2 * h * t * d
    require(p.numel() % per_row == 0, Status.INVALID_ARGUMENT,
            f"pool of {p.numel()} elements is not whole blocks of {num_layers} layers x 2 x {h * t * d}")
    require(0 <= layer < num_layers, Status.INVALID_ARGUMENT, f"layer {layer} is outside [0, {num_layers})")
    inner = (h, t, d) if kv_layout == "HND" else (t, h, d)
    buf = p.reshape(-1, num_layers, 2, h * t * d)[:, layer].unflatten(2, inner)
    return from_trtllm_buffers(buf, kv_layout=kv_layout)


# ---------------------------------------------------------------- offsets <-> PACKED block ids
def kv_offsets_from_packed(block_ids: torch.Tensor | BlockTable, *, num_layers: int, kv_factor: int = 2,
                           layer: int = 0, beam_width: int = 1, seq_lens: SeqLens | None = None,
                           tokens_per_block: int | None = None,
                           secondary: torch.Tensor | bool = False) -> torch.Tensor:
    """Memory-pool block ids `[S, M]` -> TRT-LLM offsets `[S, W, 2, M]` int32 KVCacheIndex.

    Entry `(mem_idx * num_layers + layer) * kv_factor + kv` (`kvCacheManager.cpp` `setOffsets` with
    `layerIdx = 0`, the layer added through the pool pointer: keep `layer=0` for the table TRT-LLM
    itself builds). Beams share the ids. Negative ids, and with `seq_lens` + `tokens_per_block` the
    entries past each sequence's blocks, become the null index (-1); `secondary` marks host blocks.
    """
    _check_kv_factor(kv_factor)
    rows = _packed_rows(block_ids, None, "kv_offsets_from_packed") if isinstance(block_ids, BlockTable) else \
        _index_tensor(block_ids, "block_ids", 2)
    require(num_layers >= 1 and 0 <= layer < num_layers, Status.INVALID_ARGUMENT,
            f"layer {layer} must be in [0, num_layers={num_layers})")
    require(beam_width >= 1, Status.INVALID_ARGUMENT, f"beam_width must be >= 1, got {beam_width}")
    ids = rows.to(torch.int64)
    null = ids < 0
    if seq_lens is not None:
        require(tokens_per_block is not None, Status.INVALID_ARGUMENT, "seq_lens needs tokens_per_block")
        _check_tokens_per_block(tokens_per_block)
        lens = _index_tensor(seq_lens.lengths, "seq_lens", 1)
        require(lens.numel() == ids.shape[0], Status.INVALID_ARGUMENT,
                f"{lens.numel()} sequence lengths for {ids.shape[0]} block-table rows")
        used = blocks_needed(lens.to(ids.device), tokens_per_block)
        require(not used.numel() or int(used.max()) <= ids.shape[1], Status.OUT_OF_RANGE,
                f"a sequence needs more than max_blocks_per_seq={ids.shape[1]} blocks")
        null = null | (torch.arange(ids.shape[1], device=ids.device)[None, :] >= used[:, None])
    kv = torch.arange(2, device=ids.device).view(1, 2, 1) if kv_factor == 2 else 0
    off = (ids.unsqueeze(1) * num_layers + layer) * kv_factor + kv
    off = torch.where(null.unsqueeze(1), -1, off.expand(-1, 2, -1))
    sec = torch.as_tensor(secondary, device=ids.device)
    enc = make_kv_cache_index(off, sec.unsqueeze(1) if sec.dim() == 2 else sec)
    return enc.unsqueeze(1).expand(-1, beam_width, -1, -1).contiguous()


def packed_from_kv_offsets(offsets: torch.Tensor | BlockTable, *, num_layers: int, kv_factor: int = 2,
                           layer: int = 0, beam: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """TRT-LLM offsets `[S, W, 2, M]` -> `(memory-pool block ids int64 [S, M] (-1 = null), is_secondary)`.

    Inverts `kv_offsets_from_packed` for one beam: INVALID_ARGUMENT when an entry does not follow
    `(mem_idx * num_layers + layer) * kv_factor + kv` or K and V name different memory blocks.
    """
    _check_kv_factor(kv_factor)
    o = offsets.indices if isinstance(offsets, BlockTable) else _index_tensor(offsets, "offsets", 4, (torch.int32,))
    require(o.dim() == 4 and o.shape[2] == 2 and 0 <= beam < o.shape[1], Status.INVALID_ARGUMENT,
            f"offsets must be [S, W, 2, M] with beam {beam} < W, got {tuple(o.shape)}")
    ks, kt, kn = split_kv_cache_index(o[:, beam, 0])
    vs, vt, vn = split_kv_cache_index(o[:, beam, 1])
    stride = num_layers * kv_factor
    k_rel, v_rel = ks - layer * kv_factor, vs - layer * kv_factor - (kv_factor - 1)
    ok = (kn == vn) & (kt == vt) & (kn | ((k_rel >= 0) & (k_rel % stride == 0) & (v_rel == k_rel)))
    require(bool(ok.all()), Status.INVALID_ARGUMENT,
            f"offsets do not follow TRT-LLM's (mem_idx * {num_layers} + {layer}) * {kv_factor} + kv layout, or K and "
            "V name different blocks")
    return torch.where(kn, -1, k_rel // stride), kt


# ---------------------------------------------------------------- KVX -> KVBlockArray
@dataclass
class TrtllmBlockArray:
    """What a TRT-LLM `KVBlockArray` needs: pool base, bytes per block and the offsets table."""

    primary: torch.Tensor  # [n, H, T, D] blocks from the pool base (its data_ptr is mPrimaryPoolPtr)
    bytes_per_block: int
    offsets: torch.Tensor  # int32 KVCacheIndex [S, W, 2, M]
    tokens_per_block: int


def to_trtllm_block_array(cache: CacheDesc, table: BlockTable, *, seq_lens: SeqLens | None = None,
                          beam_width: int = 1) -> TrtllmBlockArray:
    """Express a KVX cache + PACKED table as a KVBlockArray pool and offsets (zero-copy pool).

    Needs what `getKVLocalIdx` assumes: every K and V block a contiguous `[H, T, D]` run of
    `bytes_per_block` bytes, K and V in one allocation at whole-block distances from a common base;
    UNSUPPORTED otherwise (e.g. NHD memory). `primary` starts at the lower of the K and V bases: for a
    per-layer view from `from_trtllm_layer` that is the layer's pool pointer (pool base + `layer * 2 *
    bytes_per_block`, as `attentionOp.cpp` passes it) and the offsets are TRT-LLM's own table,
    `(mem_idx * num_layers) * 2 + kv`; a vLLM HND cache yields `id` / `N + id`. Entries of negative ids
    (and past `seq_lens`) are null.
    """
    cache.validate()
    _check_tokens_per_block(cache.block_size)
    n, t, h, d = cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim
    per_block = h * t * d
    k, v = (_logical(cache, w).permute(0, 2, 1, 3) for w in ("k", "v"))
    require(k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr(), Status.UNSUPPORTED,
            "K and V live in different allocations; a KVBlockArray addresses both from one pool pointer")
    for name, x in (("K", k), ("V", v)):
        require(x[0].is_contiguous(), Status.UNSUPPORTED,
                f"{name} blocks are not contiguous [H, T, D] runs (strides {tuple(x.stride())}); KVBlockArray "
                "needs the HND block interior")
        require(n == 1 or x.stride(0) % per_block == 0, Status.UNSUPPORTED,
                f"{name} block stride {x.stride(0)} is not a whole number of {per_block}-element blocks")
    base = min(k.storage_offset(), v.storage_offset())
    starts = [x.storage_offset() - base for x in (k, v)]
    require(all(s % per_block == 0 for s in starts), Status.UNSUPPORTED,
            f"K and V start {starts} elements from the pool base, not at whole-block distances")
    total = (k.untyped_storage().nbytes() // k.element_size() - base) // per_block
    primary = torch.as_strided(k, (total, h, t, d), (per_block, t * d, d, 1), base)
    rows = _packed_rows(table, None, "to_trtllm_block_array")
    ids = rows.to(torch.int64)
    null = ids < 0
    if seq_lens is not None:
        lens = _index_tensor(seq_lens.lengths, "seq_lens", 1).to(ids.device)
        null = null | (torch.arange(ids.shape[1], device=ids.device)[None, :] >= blocks_needed(lens, t)[:, None])
    steps = [x.stride(0) // per_block if n > 1 else 1 for x in (k, v)]
    planes = [torch.where(null, -1, s // per_block + ids * step) for s, step in zip(starts, steps, strict=True)]
    offsets = make_kv_cache_index(torch.stack(planes, dim=1))
    return TrtllmBlockArray(primary, per_block * k.element_size(),
                            offsets.unsqueeze(1).expand(-1, beam_width, -1, -1).contiguous(), t)


__all__ = [
    "KV_LAYOUTS", "TrtllmBlockArray", "bytes_per_block", "from_trtllm_buffers", "from_trtllm_layer",
    "from_trtllm_offsets", "from_trtllm_pool", "kv_offsets_from_packed", "packed_from_kv_offsets",
    "seq_lens_from_trtllm", "to_trtllm_block_array",
]
