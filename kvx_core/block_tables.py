"""Block-table encodings (spec §5): PACKED, RAGGED, KV_OFFSETS, FlashInfer's paged form, slot mapping.

All functions are vectorized torch and keep the input's device. `resolve_tokens` is the one place
that turns any block table into per-token physical addresses; the reference ops build on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .descriptors import BlockTable, SeqLens
from .enums import KVCACHEINDEX_SECONDARY_BIT, BlockTableFormat
from .errors import KvxError, Status, int_value, require

_INDEX_MASK = KVCACHEINDEX_SECONDARY_BIT - 1


def _index_tensor(t: object, what: str, ndim: int | None = None) -> None:
    """INVALID_ARGUMENT unless `t` is an integer tensor (of `ndim` dims when given)."""
    require(isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool),
            Status.INVALID_ARGUMENT, f"{what} must be an integer tensor, got "
            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    require(ndim is None or t.dim() == ndim, Status.INVALID_ARGUMENT,
            f"{what} must be {ndim}-D, got shape {tuple(t.shape)}")


def _int(n: object, what: str, lo: int | None = None) -> None:
    """INVALID_ARGUMENT unless `n` is an int (not a bool), at least `lo` when given."""
    require(int_value(n) is not None and (lo is None or n >= lo), Status.INVALID_ARGUMENT,
            f"{what} must be an int{f' >= {lo}' if lo is not None else ''}, got {n!r}")


def _table_and_lengths(table: object, seq_lens: object, block_size: object) -> None:
    """A PACKED `[S, M]` table with S non-negative lengths and a positive block size."""
    _index_tensor(table, "block table", 2)
    _index_tensor(seq_lens, "sequence lengths", 1)
    _int(block_size, "block_size", 1)
    require(seq_lens.numel() == table.shape[0], Status.INVALID_ARGUMENT,
            f"{seq_lens.numel()} sequence lengths for a table of {table.shape[0]} sequences")
    require(not bool((seq_lens < 0).any()), Status.INVALID_ARGUMENT, "sequence lengths must be >= 0")


def _indptr(ip: object, what: str) -> None:
    """A 1-D integer prefix-sum array: starts at 0, non-decreasing."""
    _index_tensor(ip, what, 1)
    require(ip.numel() >= 1 and int(ip[0]) == 0 and bool((ip[1:] >= ip[:-1]).all()), Status.INVALID_ARGUMENT,
            f"{what} must start at 0 and be non-decreasing")


def _mask_like(mask: object, t: torch.Tensor, what: str) -> None:
    """INVALID_ARGUMENT unless `mask` is a bool, or a bool/integer tensor that broadcasts to `t`'s shape."""
    ok = isinstance(mask, bool)
    if isinstance(mask, torch.Tensor) and not (mask.is_floating_point() or mask.is_complex()):
        try:
            ok = torch.broadcast_shapes(mask.shape, t.shape) == t.shape
        except RuntimeError:
            ok = False
    require(ok, Status.INVALID_ARGUMENT, f"{what} must be a bool or a bool tensor broadcastable to shape "
            f"{tuple(t.shape)}, got {mask!r}")


def is_power_of_two(n: int) -> bool:
    n = int_value(n)
    return n is not None and n > 0 and n & (n - 1) == 0


def blocks_needed(seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Blocks each sequence occupies: ceil(len / block_size)."""
    _index_tensor(seq_lens, "sequence lengths")
    _int(block_size, "block_size", 1)
    return (seq_lens.to(torch.int64) + block_size - 1) // block_size


# ---------------------------------------------------------------- KVCacheIndex (TRT-LLM)
def make_kv_cache_index(index: torch.Tensor, secondary: torch.Tensor | bool = False) -> torch.Tensor:
    """Encode block indices as int32 KVCacheIndex: bit 31 marks the secondary pool; -1 stays null."""
    _index_tensor(index, "block indices")
    _mask_like(secondary, index, "secondary")
    idx = index.to(torch.int64)
    require(bool(((idx >= -1) & (idx <= _INDEX_MASK)).all()), Status.OUT_OF_RANGE,
            f"KVCacheIndex values must be in [0, {_INDEX_MASK}] or -1 (null)")
    sec = torch.as_tensor(secondary, device=idx.device).to(torch.bool)
    # TRT-LLM asserts value != kNullFlag: secondary index 2**31-1 would encode as the null index (-1).
    require(not bool((sec & (idx == _INDEX_MASK)).any()), Status.OUT_OF_RANGE,
            f"KVCacheIndex {_INDEX_MASK} in the secondary pool encodes as the null index (-1)")
    enc = torch.where(sec & (idx >= 0), idx | KVCACHEINDEX_SECONDARY_BIT, idx)
    return torch.where(enc >= 2**31, enc - 2**32, enc).to(torch.int32)


def split_kv_cache_index(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode KVCacheIndex int32 values into `(index, is_secondary, is_null)`."""
    _index_tensor(value, "KVCacheIndex values")
    v = value.to(torch.int64) & 0xFFFFFFFF
    null = v == 0xFFFFFFFF
    return torch.where(null, -1, v & _INDEX_MASK), (v & KVCACHEINDEX_SECONDARY_BIT != 0) & ~null, null


# ---------------------------------------------------------------- conversions
def packed_to_ragged(table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PACKED `[S, M]` -> RAGGED per-token block ids and `indptr` (prefix sums of lengths)."""
    _table_and_lengths(table, seq_lens, block_size)
    lens = seq_lens.to(torch.int64)
    require(bool((blocks_needed(lens, block_size) <= table.shape[1]).all()), Status.OUT_OF_RANGE,
            f"a sequence needs more than max_blocks_per_seq={table.shape[1]} blocks")
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=table.device)
    indptr[1:] = torch.cumsum(lens, 0)
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=table.device), lens)
    pos = torch.arange(int(indptr[-1]), device=table.device) - indptr[seq]
    return table[seq, pos // block_size].to(table.dtype), indptr.to(table.dtype)


def ragged_to_packed(indices: torch.Tensor, indptr: torch.Tensor, block_size: int,
                     max_blocks_per_seq: int | None = None, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """RAGGED -> PACKED `[S, M]` (unused entries = `pad`) and sequence lengths.

    Every token of a block must name the same block id; INVALID_ARGUMENT otherwise.
    """
    _index_tensor(indices, "RAGGED indices", 1)
    _indptr(indptr, "RAGGED indptr")
    _int(block_size, "block_size", 1)
    _int(pad, "pad")
    if max_blocks_per_seq is not None:
        _int(max_blocks_per_seq, "max_blocks_per_seq", 0)
    ip = indptr.to(torch.int64)
    require(ip.numel() >= 1 and int(ip[-1]) == indices.numel(), Status.INVALID_ARGUMENT,
            f"RAGGED indptr ends at {int(ip[-1]) if ip.numel() else None}, indices hold {indices.numel()} entries")
    lens = ip[1:] - ip[:-1]
    need = blocks_needed(lens, block_size)
    m = int(need.max()) if need.numel() else 0
    m = m if max_blocks_per_seq is None else max_blocks_per_seq
    require(not need.numel() or int(need.max()) <= m, Status.OUT_OF_RANGE,
            f"a sequence needs {int(need.max()) if need.numel() else 0} blocks > max_blocks_per_seq={m}")
    table = torch.full((lens.numel(), m), pad, dtype=indices.dtype, device=indices.device)
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=ip.device), lens)
    pos = torch.arange(indices.numel(), device=ip.device) - ip[seq]
    table[seq, pos // block_size] = indices
    require(bool((table[seq, pos // block_size] == indices).all()), Status.INVALID_ARGUMENT,
            "RAGGED indices name different blocks for tokens of one block")
    return table, lens.to(indptr.dtype)


def packed_to_kv_offsets(k_table: torch.Tensor, v_table: torch.Tensor | None = None, beam_width: int = 1,
                         secondary: torch.Tensor | bool = False) -> torch.Tensor:
    """PACKED `[S, M]` (K, and V if separate) -> KV_OFFSETS `[S, beam, 2, M]` KVCacheIndex int32.

    Beams share the table (as TRT-LLM does for the shared context); `secondary` marks host blocks.
    """
    v_table = k_table if v_table is None else v_table
    _index_tensor(k_table, "K block table", 2)
    _index_tensor(v_table, "V block table", 2)
    require(k_table.shape == v_table.shape, Status.INVALID_ARGUMENT,
            f"K and V block tables differ in shape: {tuple(k_table.shape)} vs {tuple(v_table.shape)}")
    _int(beam_width, "beam_width", 1)
    kv = torch.stack([make_kv_cache_index(k_table, secondary), make_kv_cache_index(v_table, secondary)], dim=1)
    return kv.unsqueeze(1).expand(-1, beam_width, -1, -1).contiguous()


def kv_offsets_to_packed(offsets: torch.Tensor, beam: int = 0, kv: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One `(beam, K|V)` plane of a KV_OFFSETS table -> `(block ids (-1 = null), is_secondary)`."""
    _index_tensor(offsets, "KV_OFFSETS table", 4)
    require(offsets.shape[2] == 2, Status.INVALID_ARGUMENT,
            f"KV_OFFSETS table must be [seqs, beam, 2, max_blocks], got {tuple(offsets.shape)}")
    _int(beam, "beam", 0)
    require(beam < offsets.shape[1] and int_value(kv) in (0, 1), Status.INVALID_ARGUMENT,
            f"beam must be < {offsets.shape[1]} and kv 0 (K) or 1 (V), got beam={beam!r}, kv={kv!r}")
    idx, sec, _ = split_kv_cache_index(offsets[:, beam, kv])
    return idx, sec


def packed_to_flashinfer(table: torch.Tensor, seq_lens: torch.Tensor,
                         block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PACKED -> FlashInfer `(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)` (int32).

    Empty sequences have 0 pages and last_page_len 0.
    """
    _table_and_lengths(table, seq_lens, block_size)
    lens = seq_lens.to(torch.int64)
    pages = blocks_needed(lens, block_size)
    require(not pages.numel() or int(pages.max()) <= table.shape[1], Status.OUT_OF_RANGE,
            f"a sequence needs more than max_blocks_per_seq={table.shape[1]} blocks")
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=table.device)
    indptr[1:] = torch.cumsum(pages, 0)
    mask = torch.arange(table.shape[1], device=table.device)[None, :] < pages[:, None]
    last = torch.where(pages > 0, lens - (pages - 1) * block_size, 0)
    return indptr.to(torch.int32), table[mask].to(torch.int32), last.to(torch.int32)


def flashinfer_to_packed(indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                         block_size: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer paged form -> PACKED table and sequence lengths."""
    _indptr(indptr, "paged_kv_indptr")
    _index_tensor(indices, "paged_kv_indices", 1)
    _index_tensor(last_page_len, "paged_kv_last_page_len", 1)
    _int(block_size, "block_size", 1)
    _int(pad, "pad")
    require(last_page_len.numel() == indptr.numel() - 1, Status.INVALID_ARGUMENT,
            f"paged_kv_last_page_len has {last_page_len.numel()} entries for {indptr.numel() - 1} sequences")
    ip = indptr.to(torch.int64)
    require(ip.numel() >= 1 and int(ip[-1]) == indices.numel(), Status.INVALID_ARGUMENT,
            f"paged_kv_indptr ends at {int(ip[-1]) if ip.numel() else None}, paged_kv_indices hold "
            f"{indices.numel()} pages")
    pages = ip[1:] - ip[:-1]
    last = last_page_len.to(torch.int64)
    require(bool(((pages == 0) & (last == 0) | (pages > 0) & (last >= 1) & (last <= block_size)).all()),
            Status.INVALID_ARGUMENT, f"last_page_len must be in [1, {block_size}] (0 for empty sequences)")
    m = int(pages.max()) if pages.numel() else 0
    table = torch.full((pages.numel(), m), pad, dtype=indices.dtype, device=indices.device)
    mask = torch.arange(m, device=indices.device)[None, :] < pages[:, None]
    table[mask] = indices
    return table, torch.where(pages > 0, (pages - 1) * block_size + last, 0)


# ---------------------------------------------------------------- slot mapping
def slot_mapping(table: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor, block_size: int,
                 invalid_slot: int = -1) -> torch.Tensor:
    """Global slots `table[s, p // B] * B + p % B` (int64) for tokens at `positions` of `seq_ids`.

    Tokens with a negative seq id or position (padding) get `invalid_slot`.
    """
    _index_tensor(table, "block table", 2)
    _index_tensor(seq_ids, "seq_ids")
    _index_tensor(positions, "positions")
    require(seq_ids.shape == positions.shape, Status.INVALID_ARGUMENT,
            f"seq_ids {tuple(seq_ids.shape)} and positions {tuple(positions.shape)} must have one shape")
    _int(block_size, "block_size", 1)
    _int(invalid_slot, "invalid_slot")
    s, p = seq_ids.to(torch.int64), positions.to(torch.int64)
    ok = (s >= 0) & (p >= 0)
    blk = torch.where(ok, p // block_size, 0)
    require(not bool(ok.any()) or int(blk[ok].max()) < table.shape[1], Status.OUT_OF_RANGE,
            f"a position needs block {int(blk[ok].max()) if ok.any() else 0} >= max_blocks_per_seq={table.shape[1]}")
    require(not bool(ok.any()) or int(s[ok].max()) < table.shape[0], Status.OUT_OF_RANGE,
            f"sequence id out of range for a table of {table.shape[0]} sequences")
    ids = torch.zeros_like(s)
    ids[ok] = table.to(torch.int64)[s[ok], blk[ok]]  # index with valid tokens only: the table may be empty
    return torch.where(ok, ids * block_size + p % block_size, invalid_slot)


# ---------------------------------------------------------------- resolution
@dataclass
class TokenAddresses:
    """Physical address of every gathered token, for K and V separately (KV_OFFSETS may differ)."""

    k_blocks: torch.Tensor  # int64 [T]
    v_blocks: torch.Tensor
    offsets: torch.Tensor  # int64 [T], position inside the block
    k_secondary: torch.Tensor  # bool [T], block lives in the secondary pool
    v_secondary: torch.Tensor
    lengths: torch.Tensor  # int64 [S * beam], tokens per output sequence


def resolve_tokens(table: BlockTable, seq_lens: SeqLens, max_seq_len: int, block_size: int,
                   num_blocks: int, num_secondary_blocks: int | None = 0) -> TokenAddresses:
    """Physical (block, offset, pool) of the first `min(len, max_seq_len)` tokens of each sequence.

    KV_OFFSETS tables yield `seq_count * beam_width` output sequences in (seq, beam) order. Every
    referenced block id must exist (OUT_OF_RANGE otherwise); null KVCacheIndex entries inside a
    sequence's length are OUT_OF_RANGE too. `num_secondary_blocks=None` means there is no secondary
    pool: referencing it is INVALID_ARGUMENT.
    """
    require(isinstance(table, BlockTable) and isinstance(seq_lens, SeqLens), Status.INVALID_ARGUMENT,
            f"resolve_tokens takes a BlockTable and SeqLens, got {type(table).__name__}, {type(seq_lens).__name__}")
    _int(max_seq_len, "max_seq_len", 0)
    _int(block_size, "block_size", 1)
    _int(num_blocks, "num_blocks", 0)
    if num_secondary_blocks is not None:
        _int(num_secondary_blocks, "num_secondary_blocks", 0)
    dev = table.indices.device
    beams = table.beam_width
    lens = seq_lens.lengths.to(device=dev, dtype=torch.int64).clamp(max=max_seq_len).repeat_interleave(beams)
    n = lens.numel()
    seq = torch.repeat_interleave(torch.arange(n, device=dev), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum()), device=dev) - starts[seq]
    if table.format == BlockTableFormat.RAGGED:
        ip = table.indptr.to(device=dev, dtype=torch.int64)
        full = ip[1:] - ip[:-1]
        require(bool((seq_lens.lengths.to(dev, torch.int64) <= full).all()), Status.OUT_OF_RANGE,
                "RAGGED: a sequence length exceeds its indptr span")
        blocks = table.indices.to(torch.int64)[ip[seq] + pos]
        k_blocks = v_blocks = blocks
        k_sec = v_sec = torch.zeros_like(blocks, dtype=torch.bool)
    elif table.format == BlockTableFormat.PACKED:
        flat = table.indices.reshape(table.seq_count, table.max_blocks_per_seq)  # a flat C buffer is fine too
        k_blocks = v_blocks = flat.to(torch.int64)[seq, pos // block_size]
        k_sec = v_sec = torch.zeros_like(k_blocks, dtype=torch.bool)
    else:
        flat = table.indices.reshape(n, 2, table.max_blocks_per_seq)
        k_blocks, k_sec, k_null = split_kv_cache_index(flat[seq, 0, pos // block_size])
        v_blocks, v_sec, v_null = split_kv_cache_index(flat[seq, 1, pos // block_size])
        require(not bool((k_null | v_null).any()), Status.OUT_OF_RANGE,
                "KV_OFFSETS: a null KVCacheIndex lies inside a sequence's length")
    for blocks, sec in ((k_blocks, k_sec), (v_blocks, v_sec)):
        require(num_secondary_blocks is not None or not bool(sec.any()), Status.INVALID_ARGUMENT,
                "block table references the secondary pool but cache.pool.secondary is NULL")
        limit = torch.where(sec, num_secondary_blocks or 0, num_blocks)
        bad = (blocks < 0) | (blocks >= limit)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise KvxError(Status.OUT_OF_RANGE,
                           f"block id {int(blocks[i])} ({'secondary' if bool(sec[i]) else 'primary'} pool) is out "
                           f"of range for output sequence {int(seq[i])} token {int(pos[i])}: the pool has "
                           f"{int(limit[i])} blocks")
    return TokenAddresses(k_blocks, v_blocks, pos % block_size, k_sec, v_sec, lens)
