"""vLLM <-> KVX: the per-layer KV cache tensors, block table and slot mapping of vLLM v1.

Shapes (vllm-project/vllm; layouts in docs/engine_layouts.md §17.1, commits in §17.6):
- `vllm/v1/attention/backends/flash_attn.py` `FlashAttentionBackend.get_kv_cache_shape` ->
  `(2, num_blocks, block_size, num_kv_heads, head_size)`; `get_kv_cache_stride_order` is the identity
  for NHD and `(0, 1, 3, 2, 4)` for HND (`VLLM_KV_CACHE_LAYOUT`).
- `vllm/v1/attention/backends/flashinfer.py` `FlashInferBackend.get_kv_cache_shape` ->
  `(num_blocks, 2, block_size, num_kv_heads, head_size)`, same stride orders.
- vLLM 0.26 packs K and V into the content dim instead: both backends' `get_kv_cache_shape` ->
  `(num_blocks, num_kv_heads, block_size, 2 * head_size)` (`from_vllm_packed_kv_cache`).
- `vllm/v1/worker/gpu_model_runner.py` allocates raw bytes, views them in the physical (stride-ordered)
  shape and exposes `.permute(*inv_order)`: the tensor a layer sees always has the *logical* shape
  above with the physical strides (and, with padded pages or the cross-layer layout, a larger block
  stride). The adapters therefore read the layout from strides, never from the shape.
- `csrc/cache_kernels.cu` `reshape_and_cache_flash` writes `cache[slot // bs, slot % bs, head, :]`
  through `block_stride/page_stride/head_stride` (head_size contiguous); `reshape_and_cache` writes
  the packed K `[num_blocks, num_heads, head_size / x, block_size, x]` and V
  `[num_blocks, num_heads, head_size, block_size]` assuming contiguous tensors, with
  `x = 16 // element_size` (`vllm/v1/attention/ops/paged_attn.py` `PagedAttention.split_kv_cache`,
  which views `kv_cache` `(2, num_blocks, block_size * num_kv_heads * head_size)`).
- `vllm/v1/worker/block_table.py`: `block_table` int32 `[max_num_reqs, max_num_blocks_per_req]`,
  `slot_mapping` int64 `[max_num_batched_tokens]`, `-1` for padded / non-local tokens.
- FP8 caches are uint8 tensors (`vllm/utils/torch_utils.py` `STR_DTYPE_TO_TORCH_DTYPE`): pass
  `cache_dtype` to reinterpret them.
"""
from __future__ import annotations

import torch

from kvx_core.descriptors import BlockTable, CacheDesc, SeqLens, SlotMapping
from kvx_core.enums import Layout
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
    _stack_views,
    _tensor,
)

BACKENDS = ("flash_attn", "flashinfer")
"""Backends whose `get_kv_cache_shape` the adapters understand, by the position of the K/V dim."""
_KV_DIM = {"flash_attn": 0, "flashinfer": 1}


def _kv_dim(backend: str) -> int:
    require(backend in _KV_DIM, Status.INVALID_ARGUMENT,
            f"unknown vLLM backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return _KV_DIM[backend]


# ---------------------------------------------------------------- flash / flashinfer caches
def from_vllm_kv_cache(kv_cache: torch.Tensor, *, backend: str = "flash_attn", num_kv_heads: int | None = None,
                       head_dim: int | None = None, block_size: int | None = None,
                       cache_dtype: torch.dtype | None = None) -> CacheDesc:
    """Describe one layer's vLLM KV cache tensor (zero-copy).

    `kv_cache` is the tensor vLLM binds to the layer: logical shape `(2, N, B, H, D)` for
    `backend="flash_attn"` (`flash_attn.py` `get_kv_cache_shape`) or `(N, 2, B, H, D)` for
    `"flashinfer"` (`flashinfer.py`), with whatever strides vLLM's stride order gave it. NHD memory
    becomes `Layout.NHD`, HND memory (`get_kv_cache_stride_order` `(0, 1, 3, 2, 4)`) `Layout.HND`, any
    other stride pattern `Layout.CUSTOM`; block strides are kept as they are (padded pages, the
    cross-layer layout). The geometry keywords, when given, are checked against the shape.
    """
    dim = _kv_dim(backend)
    t = _tensor(kv_cache, "vLLM kv_cache", 5)
    require(t.shape[dim] == 2, Status.INVALID_ARGUMENT,
            f"vLLM {backend} kv_cache must have 2 (K, V) at dim {dim}, got shape {tuple(t.shape)}")
    t = _as_cache_dtype(t, cache_dtype, "vLLM kv_cache")
    k, v = t.select(dim, 0), t.select(dim, 1)
    n, b, h, d = k.shape
    _check_geometry(f"vLLM {backend}", {"num_kv_heads": h, "head_dim": d, "block_size": b},
                    num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    (kl, kt), (vl, vt) = _name_layout(k), _name_layout(v)
    return _describe(kt, kl, vt, vl, block_size=b, num_kv_heads=h, head_dim=d)


def from_vllm_packed_kv_cache(kv_cache: torch.Tensor, *, num_kv_heads: int | None = None,
                              head_dim: int | None = None, block_size: int | None = None,
                              cache_dtype: torch.dtype | None = None) -> CacheDesc:
    """Describe one layer's cache of vLLM 0.26's FlashAttention backend (zero-copy).

    vLLM 0.26 `flash_attn.py` `get_kv_cache_shape` -> `(num_blocks, num_kv_heads, block_size, 2 * head_size)`:
    "K and V are packed into the content dim" (K the first `head_size` values of a token's row, V the rest);
    `get_kv_cache_stride_order` keeps that order for HND and puts the block's tokens first for NHD
    (`(0, 2, 1, 3)`). The layout is read from the strides, as in `from_vllm_kv_cache`.
    """
    t = _tensor(kv_cache, "vLLM packed kv_cache", 4)
    t = _as_cache_dtype(t, cache_dtype, "vLLM packed kv_cache")
    n, h, b, c = t.shape
    require(c % 2 == 0, Status.INVALID_ARGUMENT, f"vLLM packed kv_cache: content dim {c} is not 2 x head_size")
    d = c // 2
    _check_geometry("vLLM packed flash_attn", {"num_kv_heads": h, "head_dim": d, "block_size": b},
                    num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    (kl, kt), (vl, vt) = (_name_layout(x.permute(0, 2, 1, 3)) for x in (t[..., :d], t[..., d:]))
    return _describe(kt, kl, vt, vl, block_size=b, num_kv_heads=h, head_dim=d)


def to_vllm_kv_cache(cache: CacheDesc, backend: str = "flash_attn") -> torch.Tensor:
    """The vLLM-shaped tensor over a KVX cache's memory (zero-copy).

    Returns the logical `(2, N, B, H, D)` (`flash_attn`) or `(N, 2, B, H, D)` (`flashinfer`) view that
    `reshape_and_cache_flash` and the attention kernels index. UNSUPPORTED when no such view exists:
    K and V must share one allocation with V a fixed number of elements after K and identical strides
    (how vLLM allocates them), head_dim contiguous, and K not packed. Use `torch.stack` of
    `kvx_core.layouts.logical_view`s when a copy is acceptable.
    """
    dim = _kv_dim(backend)
    cache.validate()
    k, v = _logical(cache, "k"), _logical(cache, "v")
    require(k.shape[-1] == 1 or (k.stride(-1) == 1 and v.stride(-1) == 1), Status.UNSUPPORTED,
            "vLLM kernels need head_dim contiguous (stride 1) in K and V")
    t = _stack_views(k, v, dim)
    if t is None:
        raise KvxError(Status.UNSUPPORTED,
                       f"K and V have no common zero-copy vLLM {backend} view: they must share one allocation with "
                       "identical strides and V at a fixed positive element offset from K (K strides "
                       f"{tuple(k.stride())}, V strides {tuple(v.stride())}); copy with torch.stack if acceptable")
    return t


# ---------------------------------------------------------------- packed reshape_and_cache layout
def from_vllm_paged(key_cache: torch.Tensor, value_cache: torch.Tensor, *, cache_dtype: torch.dtype | None = None,
                    num_kv_heads: int | None = None, head_dim: int | None = None,
                    block_size: int | None = None) -> CacheDesc:
    """Describe the packed-K paged cache written by `reshape_and_cache` (zero-copy).

    `key_cache` `[N, H, D // x, B, x]` becomes `Layout.HND_PACKED` with pack `x`; `value_cache`
    `[N, H, D, B]` becomes a `Layout.CUSTOM` view in logical `[N, B, H, D]` order (its strides put the
    token dim innermost). Shapes from `csrc/cache_kernels.cu` (`reshape_and_cache_kernel` comments and
    its `tgt_key_idx` / `tgt_value_idx` arithmetic); TGI's `paged` attention allocates the same shapes.
    """
    kc = _as_cache_dtype(_tensor(key_cache, "key_cache", 5), cache_dtype, "key_cache")
    vc = _as_cache_dtype(_tensor(value_cache, "value_cache", 4), cache_dtype, "value_cache")
    n, h, dx, b, x = kc.shape
    require(tuple(vc.shape) == (n, h, dx * x, b), Status.INVALID_ARGUMENT,
            f"value_cache must be [num_blocks, num_heads, head_size, block_size] = {(n, h, dx * x, b)} to match "
            f"key_cache {tuple(kc.shape)} = [num_blocks, num_heads, head_size // x, block_size, x], got "
            f"{tuple(vc.shape)}")
    _check_geometry("paged cache", {"num_kv_heads": h, "head_dim": dx * x, "block_size": b},
                    num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    vl, vt = _name_layout(vc.permute(0, 3, 1, 2))
    return _describe(kc, Layout.HND_PACKED, vt, vl, block_size=b, num_kv_heads=h, head_dim=dx * x)


def split_vllm_paged_kv_cache(kv_cache: torch.Tensor, *, num_kv_heads: int, head_dim: int,
                              cache_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `PagedAttention.split_kv_cache`: `(2, N, B * H * D)` -> packed K and V views (zero-copy).

    `x = 16 // element_size` as in `vllm/v1/attention/ops/paged_attn.py`.
    """
    t = _tensor(kv_cache, "vLLM paged kv_cache", 3)
    require(t.shape[0] == 2, Status.INVALID_ARGUMENT,
            f"paged kv_cache must be (2, num_blocks, ...), got {tuple(t.shape)}")
    t = _as_cache_dtype(t, cache_dtype, "vLLM paged kv_cache")
    x = 16 // t.element_size()
    per_block = t.shape[2]
    require(head_dim % x == 0 and per_block % (num_kv_heads * head_dim) == 0, Status.INVALID_ARGUMENT,
            f"paged kv_cache of {per_block} elements per block cannot hold {num_kv_heads} heads x {head_dim} dims "
            f"packed by x={x} (head_dim % x must be 0)")
    n = t.shape[1]
    try:
        k = t[0].view(n, num_kv_heads, head_dim // x, -1, x)
        v = t[1].view(n, num_kv_heads, head_dim, -1)
    except RuntimeError as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"paged kv_cache cannot be split without a copy: {e}") from None
    return k, v


def to_vllm_paged(cache: CacheDesc, *, x: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(key_cache [N, H, D // x, B, x], value_cache [N, H, D, B])` over a KVX cache (zero-copy).

    `reshape_and_cache` and the paged-attention kernels index these tensors as contiguous, so the
    views must be contiguous: UNSUPPORTED otherwise. `x` defaults to vLLM's `16 // element_size`.
    """
    cache.validate()
    n, b, h, d = cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim
    es = cache.k.tensor.element_size()
    x = 16 // es if x is None else x
    require(x > 0 and d % x == 0, Status.UNSUPPORTED, f"head_dim {d} is not a multiple of the pack factor x={x}")
    if cache.k.layout == Layout.HND_PACKED and cache.k.shape[4] == x:
        kc = cache.k.tensor
    else:
        lk = _logical(cache, "k")
        sn, sb, sh, sd = lk.stride()
        kc = torch.as_strided(lk, (n, h, d // x, b, x), (sn, sh, x * sd, sb, sd), lk.storage_offset())
    vc = _logical(cache, "v").permute(0, 2, 3, 1)
    for name, t in (("key_cache", kc), ("value_cache", vc)):
        require(t.is_contiguous(), Status.UNSUPPORTED,
                f"{name} {tuple(t.shape)} would have strides {tuple(t.stride())}; reshape_and_cache needs it "
                "contiguous, so this KVX cache has no zero-copy vLLM paged view")
    return kc, vc


# ---------------------------------------------------------------- metadata
def block_table_from_vllm(block_table: torch.Tensor, num_reqs: int | None = None) -> BlockTable:
    """vLLM's int32 `[max_num_reqs, max_num_blocks_per_req]` block table -> KVX PACKED (zero-copy slice).

    From `vllm/v1/worker/block_table.py` (`BlockTable.block_table`, `get_device_tensor(num_reqs)`);
    rows past each request's blocks hold stale ids, which KVX never reads beyond `seq_lens`.
    """
    t = _index_tensor(block_table, "vLLM block_table", 2)
    if num_reqs is not None:
        require(0 <= num_reqs <= t.shape[0], Status.INVALID_ARGUMENT,
                f"num_reqs={num_reqs} but the block table has {t.shape[0]} rows")
        t = t[:num_reqs]
    return BlockTable.packed(t)


def seq_lens_from_vllm(seq_lens: torch.Tensor, num_reqs: int | None = None) -> SeqLens:
    """`CommonAttentionMetadata.seq_lens` (int32, cached + new tokens per request) -> KVX SeqLens."""
    return _seq_lens(seq_lens, "vLLM seq_lens", num_reqs)


def slot_mapping_from_vllm(slot_mapping: torch.Tensor, num_tokens: int | None = None) -> SlotMapping:
    """vLLM's int64 slot mapping (`-1` = padded / non-local token) -> KVX SlotMapping (zero-copy slice)."""
    t = _index_tensor(slot_mapping, "vLLM slot_mapping", 1)
    if num_tokens is not None:
        require(0 <= num_tokens <= t.numel(), Status.INVALID_ARGUMENT,
                f"num_tokens={num_tokens} but slot_mapping has {t.numel()} entries")
        t = t[:num_tokens]
    return SlotMapping(t, invalid_slot=-1)


def block_table_to_vllm(table: BlockTable, *, block_size: int | None = None) -> torch.Tensor:
    """A KVX PACKED (zero-copy when int32) or RAGGED (converted, needs `block_size`) table as vLLM's
    int32 `[num_reqs, max_blocks]` block table."""
    return _int32(_packed_rows(table, block_size, "block_table_to_vllm"), "block table")


def slot_mapping_to_vllm(slots: SlotMapping) -> torch.Tensor:
    """A KVX slot mapping as vLLM's int64 slot mapping, every invalid or negative slot as -1
    (zero-copy when it already is int64 with `invalid_slot == -1`)."""
    t = _index_tensor(slots.slots, "slot_mapping", 1)
    if t.dtype == torch.int64 and slots.invalid_slot == -1:
        return t
    t = t.to(torch.int64)
    return torch.where((t == slots.invalid_slot) | (t < 0), -1, t)


__all__ = [
    "BACKENDS", "block_table_from_vllm", "block_table_to_vllm", "from_vllm_kv_cache", "from_vllm_paged",
    "seq_lens_from_vllm", "slot_mapping_from_vllm", "slot_mapping_to_vllm", "split_vllm_paged_kv_cache",
    "to_vllm_kv_cache", "to_vllm_paged",
]
