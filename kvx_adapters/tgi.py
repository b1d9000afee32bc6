"""TGI (text-generation-inference) <-> KVX: `KVCache.kv_cache`, block tables, slots and `Seqlen`.

Shapes (huggingface/text-generation-inference; docs/engine_layouts.md §17.2, commit in §17.6):
- `server/text_generation_server/layers/attention/kv_cache.py` `KVCache.__init__` allocates a
  `(key, value)` tuple per layer by `ATTENTION` (`models/globals.py`):
  * `flashinfer`, `flashdecoding`, and `flashdecoding-ipex` on XPU: both `(num_blocks, BLOCK_SIZE,
    num_heads, head_size)` (NHD);
  * IPEX on CPU: both `(num_blocks, num_heads, BLOCK_SIZE, head_size)` (HND), `attention="ipex-cpu"`;
  * otherwise (`paged`): K `(num_blocks, num_heads, head_size // x, BLOCK_SIZE, x)`, V
    `(num_blocks, num_heads, head_size, BLOCK_SIZE)`, `x = BLOCK_SIZE // element_size` (1 on XPU),
    written by the vLLM-derived `reshape_and_cache` kernel (kernels-community/paged-attention).
  `KVCache.store` writes NHD caches with `key_cache.view(-1, H, D)[slots] = key` (no `-1` handling).
- `models/globals.py`: `BLOCK_SIZE` 256 (flashdecoding), 1 (flashinfer), 64 (flashdecoding-ipex),
  16 otherwise.
- `models/flash_causal_lm.py`: `block_tables_tensor` int32 `[batch, max_blocks]` (allocated with
  `torch.empty`, padding unset), `slots` int64; for flashinfer `block_tables_to_ragged`
  (`models/metadata_kernels.py`) concatenates the first `cache_len + input_len` entries of every
  block-table row: with flashinfer's BLOCK_SIZE of 1 that is one block id per token.
- `layers/attention/common.py` `Seqlen`: `input_lengths`, `cache_lengths`, `cu_seqlen_k` =
  prefix sums of `input_lengths + cache_lengths`.
"""
from __future__ import annotations

import torch

from kvx_core.block_tables import packed_to_ragged
from kvx_core.descriptors import BlockTable, CacheDesc, SeqLens, SlotMapping
from kvx_core.enums import BlockTableFormat
from kvx_core.errors import KvxError, Status, require

from . import (
    _as_cache_dtype,
    _check_geometry,
    _describe,
    _index_tensor,
    _int32,
    _logical,
    _name_layout,
    _packed_rows,
    _seq_lens,
    _tensor,
)
from .vllm import from_vllm_paged, to_vllm_paged

ATTENTION = ("flashinfer", "flashdecoding", "flashdecoding-ipex", "paged", "ipex-cpu")
"""`attention` values: TGI's `ATTENTION` setting, plus `ipex-cpu` for its IPEX-on-CPU HND branch."""
_NHD = ("flashinfer", "flashdecoding", "flashdecoding-ipex")


def _check_attention(attention: str) -> None:
    require(attention in ATTENTION, Status.INVALID_ARGUMENT,
            f"unknown TGI attention {attention!r}; expected one of {', '.join(ATTENTION)}")


def _pair(kv_cache: object) -> tuple[torch.Tensor, torch.Tensor]:
    require(isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2, Status.INVALID_ARGUMENT,
            "TGI kv_cache must be the (key_cache, value_cache) tuple of KVCache.kv_cache")
    return kv_cache[0], kv_cache[1]


def from_tgi_kv_cache(kv_cache: tuple[torch.Tensor, torch.Tensor], *, attention: str,
                      num_kv_heads: int | None = None, head_dim: int | None = None, block_size: int | None = None,
                      cache_dtype: torch.dtype | None = None) -> CacheDesc:
    """Describe one layer's `KVCache.kv_cache` tuple (zero-copy) for TGI's `attention` backend.

    NHD backends -> `Layout.NHD`; `ipex-cpu` -> `Layout.HND`; `paged` -> K `Layout.HND_PACKED` (pack
    `x`), V `Layout.CUSTOM` (see `kvx_adapters.vllm.from_vllm_paged`). Non-canonical strides are
    named from the strides as for vLLM.
    """
    _check_attention(attention)
    key, value = _pair(kv_cache)
    if attention == "paged":
        return from_vllm_paged(key, value, cache_dtype=cache_dtype, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, block_size=block_size)
    key = _as_cache_dtype(_tensor(key, "TGI key_cache", 4), cache_dtype, "TGI key_cache")
    value = _as_cache_dtype(_tensor(value, "TGI value_cache", 4), cache_dtype, "TGI value_cache")
    require(key.shape == value.shape, Status.INVALID_ARGUMENT,
            f"TGI key_cache {tuple(key.shape)} and value_cache {tuple(value.shape)} must have one shape")
    if attention in _NHD:
        lk, lv = key, value
    else:
        lk, lv = key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)
    _, b, h, d = lk.shape
    _check_geometry(f"TGI {attention}", {"num_kv_heads": h, "head_dim": d, "block_size": b},
                    num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    (kl, kt), (vl, vt) = _name_layout(lk), _name_layout(lv)
    return _describe(kt, kl, vt, vl, block_size=b, num_kv_heads=h, head_dim=d)


def to_tgi_kv_cache(cache: CacheDesc, *, attention: str, x: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `(key_cache, value_cache)` tuple TGI's `attention` backend expects, over a KVX cache (zero-copy).

    TGI allocates these contiguous and `KVCache.store` flattens them with `.view(-1, H, D)`, so the
    views must be contiguous: UNSUPPORTED otherwise. For `paged`, `x` defaults to TGI's
    `BLOCK_SIZE // element_size` (pass `x=1` for IPEX XPU).
    """
    _check_attention(attention)
    if attention == "paged":
        cache.validate()
        es = cache.k.tensor.element_size()
        return to_vllm_paged(cache, x=cache.block_size // es if x is None else x)
    cache.validate()
    k, v = _logical(cache, "k"), _logical(cache, "v")
    if attention not in _NHD:
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    for name, t in (("key_cache", k), ("value_cache", v)):
        require(t.is_contiguous(), Status.UNSUPPORTED,
                f"TGI {attention} {name} {tuple(t.shape)} would have strides {tuple(t.stride())}; TGI needs it "
                "contiguous, so this KVX cache has no zero-copy TGI view")
    return k, v


# ---------------------------------------------------------------- metadata
def block_tables_from_tgi(block_tables_tensor: torch.Tensor) -> BlockTable:
    """`FlashCausalLMBatch.block_tables_tensor` (int32 `[batch, max_blocks]`) -> KVX PACKED (zero-copy)."""
    return BlockTable.packed(_index_tensor(block_tables_tensor, "TGI block_tables_tensor", 2))


def seq_lens_from_tgi(input_lengths: torch.Tensor, cache_lengths: torch.Tensor, *, check: bool = True) -> SeqLens:
    """KV tokens per sequence, `input_lengths + cache_lengths` as in `Seqlen.cu_seqlen_k` (a new tensor).
    `check=False` skips the sign check (a host sync): TGI's decode runs under CUDA graph capture."""
    il = _index_tensor(input_lengths, "TGI input_lengths", 1)
    cl = _index_tensor(cache_lengths, "TGI cache_lengths", 1)
    require(il.shape == cl.shape, Status.INVALID_ARGUMENT,
            f"input_lengths {tuple(il.shape)} and cache_lengths {tuple(cl.shape)} differ in length")
    return _seq_lens(il.to(torch.int64) + cl.to(torch.int64), "TGI input_lengths + cache_lengths", check=check)


def block_tables_ragged_from_tgi(block_tables_ragged: torch.Tensor, input_lengths: torch.Tensor,
                                 cache_lengths: torch.Tensor, *, block_size: int = 1) -> tuple[BlockTable, SeqLens]:
    """TGI's flashinfer `block_tables_ragged` (one int32 block id per KV token) -> KVX RAGGED + SeqLens.

    The indices are used as they are (zero-copy); `indptr` is the prefix sum of
    `input_lengths + cache_lengths`, TGI's `cu_seqlen_k`. TGI builds this table only for flashinfer,
    whose BLOCK_SIZE is 1: `block_tables_to_ragged` takes the first `seq_len` *block* ids of each row,
    which is per-token only then, so `block_size` must be 1 (INVALID_ARGUMENT otherwise).
    """
    require(block_size == 1, Status.INVALID_ARGUMENT,
            f"TGI block_tables_ragged holds one entry per block and is per-token only with flashinfer's "
            f"BLOCK_SIZE of 1, got block_size={block_size}; use block_tables_from_tgi(block_tables_tensor)")
    idx = _index_tensor(block_tables_ragged, "TGI block_tables_ragged", 1)
    lens = seq_lens_from_tgi(input_lengths, cache_lengths)
    indptr = torch.zeros(lens.seq_count + 1, dtype=torch.int64, device=idx.device)
    indptr[1:] = torch.cumsum(lens.lengths.to(idx.device), 0)
    require(int(indptr[-1]) == idx.numel(), Status.INVALID_ARGUMENT,
            f"block_tables_ragged has {idx.numel()} entries but input_lengths + cache_lengths sum to "
            f"{int(indptr[-1])}")
    max_blocks = int(lens.lengths.max()) if lens.seq_count else 0
    return BlockTable.ragged(idx, indptr, max_blocks), lens


def slots_from_tgi(slots: torch.Tensor) -> SlotMapping:
    """TGI's int64 `slots` (`batch.slots[batch.slot_indices]`) -> KVX SlotMapping (zero-copy).

    TGI never pads with -1 (its NHD `store` would wrap a negative slot); KVX treats -1 as a no-op.
    """
    return SlotMapping(_index_tensor(slots, "TGI slots", 1), invalid_slot=-1)


def block_tables_to_tgi(table: BlockTable, *, block_size: int | None = None) -> torch.Tensor:
    """A KVX PACKED (zero-copy when int32) or RAGGED (converted) table as TGI's int32 `block_tables_tensor`."""
    return _int32(_packed_rows(table, block_size, "block_tables_to_tgi"), "block table")


def block_tables_ragged_to_tgi(table: BlockTable, seq_lens: SeqLens) -> tuple[torch.Tensor, torch.Tensor]:
    """`(block_tables_ragged int32 [total_tokens], cu_seqlen_k int32 [seqs + 1])` for TGI's flashinfer
    (BLOCK_SIZE 1) from a KVX table over a block-size-1 cache: RAGGED ones zero-copy when int32,
    PACKED ones converted."""
    lens = _index_tensor(seq_lens.lengths, "seq_lens", 1)
    if table.format == BlockTableFormat.RAGGED:
        ip = table.indptr.to(torch.int64)
        require(bool(((ip[1:] - ip[:-1]) == lens.to(ip.device, torch.int64)).all()), Status.INVALID_ARGUMENT,
                "TGI ragged tables cover exactly seq_len tokens per sequence; indptr spans differ from seq_lens")
        return _int32(table.indices, "block ids"), _int32(table.indptr, "indptr")
    rows = _packed_rows(table, 1, "block_tables_ragged_to_tgi")
    ragged, indptr = packed_to_ragged(rows, lens, 1)
    return _int32(ragged, "block ids"), _int32(indptr, "indptr")


def slots_to_tgi(slots: SlotMapping) -> torch.Tensor:
    """A KVX slot mapping as TGI's int64 `slots`; INVALID_ARGUMENT when it has invalid slots, which
    TGI's NHD `store` cannot skip (zero-copy when int64)."""
    t = _index_tensor(slots.slots, "slot_mapping", 1)
    bad = (t == slots.invalid_slot) | (t < 0)
    if bool(bad.any()):
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"{int(bad.sum())} invalid slots: TGI's KVCache.store indexes with slots directly and would "
                       "wrap negative ones; drop those tokens first")
    return t if t.dtype == torch.int64 else t.to(torch.int64)


__all__ = [
    "ATTENTION", "block_tables_from_tgi", "block_tables_ragged_from_tgi", "block_tables_ragged_to_tgi",
    "block_tables_to_tgi", "from_tgi_kv_cache", "seq_lens_from_tgi", "slots_from_tgi", "slots_to_tgi",
    "to_tgi_kv_cache",
]
