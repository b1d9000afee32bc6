"""FlashInfer <-> KVX: paged KV caches (NHD / HND) and the `indptr / indices / last_page_len` page table.

Shapes (flashinfer-ai/flashinfer; layouts in docs/engine_layouts.md §17.4, commit in §17.6):
- `flashinfer/page.py` `append_paged_kv_cache` docstring: `paged_kv_cache` is a tuple `(k_cache,
  v_cache)` of `[max_num_pages, page_size, num_kv_heads, head_dim]` (NHD) or `[max_num_pages,
  num_kv_heads, page_size, head_dim]` (HND), or one tensor `[max_num_pages, 2, page_size, num_kv_heads,
  head_dim]` (NHD) / `[max_num_pages, 2, num_kv_heads, page_size, head_dim]` (HND) with K at `[:, 0]`.
  `flashinfer/utils.py` `_expand_4d` / `_expand_5d` also accept rank-3 / rank-4 tensors for
  `page_size == 1`.
- `include/flashinfer/page.cuh` `paged_kv_t`: custom strides are honoured (`stride_page`,
  `stride_n`, `stride_h`); head_dim is contiguous.
- Page table: request `b` owns pages `indices[indptr[b]:indptr[b + 1]]`, the last one holding
  `last_page_len[b]` tokens (`get_seq_lens`: `(pages - 1) * page_size + last_page_len`); int32 in
  FlashInfer and in vLLM's FlashInfer backend (`paged_kv_indptr`, `paged_kv_indices`,
  `paged_kv_last_page_len`).
"""
from __future__ import annotations

import torch

from kvx_core.block_tables import flashinfer_to_packed, packed_to_flashinfer
from kvx_core.descriptors import BlockTable, CacheDesc, SeqLens
from kvx_core.errors import KvxError, Status, require

from . import (
    _as_cache_dtype,
    _check_geometry,
    _describe,
    _index_tensor,
    _logical,
    _name_layout,
    _packed_rows,
    _stack_views,
    _tensor,
)

KV_LAYOUTS = ("NHD", "HND")


def _check_layout(kv_layout: str) -> None:
    require(kv_layout in KV_LAYOUTS, Status.INVALID_ARGUMENT, f"kv_layout must be NHD or HND, got {kv_layout!r}")


def _to_logical(t: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """A 4-D (or page_size-1 3-D) FlashInfer K or V cache as a logical `[N, B, H, D]` view."""
    if t.dim() == 3:
        t = t.unsqueeze(1 if kv_layout == "NHD" else 2)
    return t if kv_layout == "NHD" else t.permute(0, 2, 1, 3)


def from_flashinfer_paged_kv_cache(paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                                   kv_layout: str = "NHD", *, num_kv_heads: int | None = None,
                                   head_dim: int | None = None, page_size: int | None = None,
                                   cache_dtype: torch.dtype | None = None) -> CacheDesc:
    """Describe a FlashInfer paged KV cache, one tensor or a `(k_cache, v_cache)` tuple (zero-copy).

    The layout is named from the strides (NHD / HND / CUSTOM), so an NHD-indexed tensor with HND
    memory is described correctly too.
    """
    _check_layout(kv_layout)
    if isinstance(paged_kv_cache, (tuple, list)):
        require(len(paged_kv_cache) == 2, Status.INVALID_ARGUMENT, "paged_kv_cache tuple must be (k_cache, v_cache)")
        k = _tensor(paged_kv_cache[0], "FlashInfer k_cache", (3, 4))
        v = _tensor(paged_kv_cache[1], "FlashInfer v_cache", (3, 4))
    else:
        t = _tensor(paged_kv_cache, "FlashInfer paged_kv_cache", (4, 5))
        require(t.shape[1] == 2, Status.INVALID_ARGUMENT,
                f"FlashInfer paged_kv_cache must be [pages, 2, ...] with K at [:, 0], got {tuple(t.shape)}")
        k, v = t[:, 0], t[:, 1]
    k = _as_cache_dtype(k, cache_dtype, "FlashInfer k_cache")
    v = _as_cache_dtype(v, cache_dtype, "FlashInfer v_cache")
    require(k.shape == v.shape, Status.INVALID_ARGUMENT,
            f"FlashInfer k_cache {tuple(k.shape)} and v_cache {tuple(v.shape)} must have one shape")
    lk, lv = _to_logical(k, kv_layout), _to_logical(v, kv_layout)
    _, b, h, d = lk.shape
    _check_geometry(f"FlashInfer {kv_layout}", {"num_kv_heads": h, "head_dim": d, "page_size": b},
                    num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size)
    (kl, kt), (vl, vt) = _name_layout(lk), _name_layout(lv)
    return _describe(kt, kl, vt, vl, block_size=b, num_kv_heads=h, head_dim=d)


def to_flashinfer_paged_kv_cache(cache: CacheDesc, kv_layout: str = "NHD", *, stacked: bool = False
                                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's `(k_cache, v_cache)` (or, `stacked=True`, the single `[pages, 2, ...]` tensor) over a
    KVX cache (zero-copy). FlashInfer honours page/token/head strides but needs head_dim contiguous;
    the stacked form also needs K and V in one allocation at a fixed distance: UNSUPPORTED otherwise."""
    _check_layout(kv_layout)
    cache.validate()
    k, v = _logical(cache, "k"), _logical(cache, "v")
    require(k.shape[-1] == 1 or (k.stride(-1) == 1 and v.stride(-1) == 1), Status.UNSUPPORTED,
            "FlashInfer needs head_dim contiguous (stride 1) in K and V")
    if kv_layout == "HND":
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    if not stacked:
        return k, v
    t = _stack_views(k, v, 1)
    if t is None:
        raise KvxError(Status.UNSUPPORTED,
                       "K and V have no common zero-copy [pages, 2, ...] view (separate allocations or different "
                       "strides); use stacked=False (the tuple form) instead")
    return t


# ---------------------------------------------------------------- page table
def from_flashinfer_page_table(indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                               page_size: int) -> tuple[BlockTable, SeqLens]:
    """`(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)` -> KVX PACKED table + SeqLens.

    A new `[batch, max_pages]` table (unused entries 0); lengths `(pages - 1) * page_size +
    last_page_len`, 0 for requests without pages.
    """
    ip = _index_tensor(indptr, "FlashInfer indptr", 1)
    idx = _index_tensor(indices, "FlashInfer indices", 1)
    last = _index_tensor(last_page_len, "FlashInfer last_page_len", 1)
    require(ip.numel() == last.numel() + 1, Status.INVALID_ARGUMENT,
            f"indptr has {ip.numel()} entries for {last.numel()} requests (needs batch + 1)")
    require(int(ip[0]) == 0 and bool((ip[1:] >= ip[:-1]).all()) and int(ip[-1]) <= idx.numel(),
            Status.INVALID_ARGUMENT,
            f"indptr must start at 0, not decrease and end at most at len(indices)={idx.numel()}")
    table, lens = flashinfer_to_packed(ip, idx[:int(ip[-1])], last, page_size)
    return BlockTable.packed(table), SeqLens(lens)


def to_flashinfer_page_table(table: BlockTable, seq_lens: SeqLens, page_size: int, *,
                             block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A KVX PACKED (or RAGGED, with `block_size`) table + SeqLens -> int32 `(indptr, indices, last_page_len)`."""
    rows = _packed_rows(table, block_size, "to_flashinfer_page_table")
    lens = _index_tensor(seq_lens.lengths, "seq_lens", 1)
    require(lens.numel() == rows.shape[0], Status.INVALID_ARGUMENT,
            f"{lens.numel()} sequence lengths for {rows.shape[0]} block-table rows")
    return packed_to_flashinfer(rows, lens, page_size)


__all__ = ["KV_LAYOUTS", "from_flashinfer_page_table", "from_flashinfer_paged_kv_cache",
           "to_flashinfer_page_table", "to_flashinfer_paged_kv_cache"]
