"""KVX engine adapters: pure, zero-copy translation between engine KV-cache tensors and KVX descriptors.

One module per engine (`vllm`, `tgi`, `trtllm`, `flashinfer`, `lmdeploy`: its quant_policy -> format). Each function
takes tensors shaped and typed exactly as the engine allocates them and returns KVX descriptors that *view* the same
memory (no copies), and the reverse. No engine is imported: these are tensor functions, testable anywhere.
The engine source each shape comes from is cited in the docstrings; docs/engine_layouts.md §17
describes the layouts and §17.6 (and compat_matrix.yaml) lists the engine files and commits read.

This module holds the private helpers the engine modules share.
"""
from __future__ import annotations

import torch

from kvx_core.descriptors import CACHE_DTYPES, INDEX_DTYPES, BlockTable, CacheDesc, PoolDesc, SeqLens
from kvx_core.enums import BlockTableFormat, DType, Layout, kvx_dtype
from kvx_core.errors import KvxError, Status, require
from kvx_core.layouts import logical_view

__all__ = ["flashinfer", "tgi", "trtllm", "vllm"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _tensor(t: object, what: str, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """`t` as a tensor of the expected rank, else INVALID_ARGUMENT naming the argument."""
    require(isinstance(t, torch.Tensor), Status.INVALID_ARGUMENT,
            f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else ndim
        require(t.dim() in dims, Status.INVALID_ARGUMENT,
                f"{what} must be {' or '.join(f'{d}-D' for d in dims)}, got shape {tuple(t.shape)}")
    return t


def _index_tensor(t: object, what: str, ndim: int | tuple[int, ...],
                  dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64)) -> torch.Tensor:
    """An integer index tensor (block table, slots, lengths) of rank `ndim` and one of `dtypes`."""
    t = _tensor(t, what, ndim)
    require(t.dtype in dtypes, Status.INVALID_ARGUMENT,
            f"{what} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    return t


def _as_cache_dtype(t: torch.Tensor, cache_dtype: torch.dtype | None, what: str) -> torch.Tensor:
    """View a cache tensor in its element dtype (zero-copy) and check KVX can describe it.

    Engines keep FP8 caches in byte tensors (vLLM: `STR_DTYPE_TO_TORCH_DTYPE["fp8"] = torch.uint8`);
    `cache_dtype` names the real element type so the bytes are reinterpreted in place.
    """
    if cache_dtype is not None and t.dtype != cache_dtype:
        require(t.dtype in (torch.uint8, torch.int8) and cache_dtype in _FP8, Status.INVALID_ARGUMENT,
                f"{what}: cannot reinterpret {t.dtype} as {cache_dtype} (only uint8/int8 byte caches can be "
                "viewed as float8_e4m3fn / float8_e5m2)")
        t = t.view(cache_dtype)
    if t.dtype in (torch.uint8, torch.int8):
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"{what} is a {t.dtype} byte tensor: pass cache_dtype to say what the bytes hold (vLLM keeps "
                       "'fp8' / 'fp8_e4m3' caches as uint8: torch.float8_e4m3fn; 'fp8_e5m2': torch.float8_e5m2)")
    try:
        dt = kvx_dtype(t.dtype)
    except KvxError:
        dt = DType.UNSPECIFIED
    require(dt in CACHE_DTYPES, Status.INVALID_ARGUMENT,
            f"{what}: dtype {t.dtype} is not a KVX cache dtype (float16, bfloat16, float32, float8_e4m3fn, "
            "float8_e5m2)")
    return t


def _descending(pairs: list[tuple[int, int]]) -> bool:
    """True when the strides of the non-trivial dims in `(stride, size)` order never increase."""
    prev = None
    for stride, size in pairs:
        if size == 1:
            continue
        if prev is not None and stride > prev:
            return False
        prev = stride
    return True


def _name_layout(logical: torch.Tensor) -> tuple[Layout, torch.Tensor]:
    """Name the KVX layout of a logical `[blocks, block_size, heads, head_dim]` view from its strides.

    NHD when token, head, dim strides descend (any block stride: vLLM pads pages and interleaves
    layers); HND when head, token, dim strides descend (returned permuted to HND order); otherwise
    CUSTOM in logical order. Both layouts keep the tensor's real strides, which KVX honours.
    """
    _, b, h, d = logical.shape
    sb, sh, sd = logical.stride()[1:]
    if _descending([(sb, b), (sh, h), (sd, d)]):
        return Layout.NHD, logical
    if _descending([(sh, h), (sb, b), (sd, d)]):
        return Layout.HND, logical.permute(0, 2, 1, 3)
    return Layout.CUSTOM, logical


def _describe(k: torch.Tensor, k_layout: Layout, v: torch.Tensor, v_layout: Layout, *, block_size: int,
              num_kv_heads: int, head_dim: int, pool: PoolDesc | None = None) -> CacheDesc:
    """A validated CacheDesc over `k`/`v` (already in their layouts' dim order)."""
    require(k.device == v.device, Status.INVALID_ARGUMENT, f"K is on {k.device}, V on {v.device}")
    return CacheDesc.from_torch(k, v, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                k_layout=k_layout, v_layout=v_layout, pool=pool)


def _check_geometry(engine: str, actual: dict[str, int], **given: int | None) -> None:
    """Every geometry value the caller passed must match the one read from the tensor's shape."""
    for name, want in given.items():
        if want is not None:
            require(int(want) == actual[name], Status.INVALID_ARGUMENT,
                    f"{engine}: the cache tensor has {name}={actual[name]}, but {name}={want} was given")


def _logical(cache: CacheDesc, which: str) -> torch.Tensor:
    """Zero-copy logical `[blocks, block_size, heads, head_dim]` view of the cache's K or V tensor."""
    desc = cache.k if which == "k" else cache.v
    require(desc.tensor is not None, Status.INVALID_ARGUMENT, f"cache.{which} has no tensor to view")
    return logical_view(desc.tensor, desc.layout)


def _stack_views(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor | None:
    """One tensor `t` with `t.select(dim, 0) is a` and `t.select(dim, 1) is b` memory-wise, or None.

    Possible without a copy only when `a` and `b` share storage, shape, strides and dtype and `b`
    starts a fixed (positive, non-aliasing) number of elements after `a`: how vLLM and FlashInfer
    allocate one tensor for K and V.
    """
    if (a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype or a.device != b.device
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()):
        return None
    delta = b.storage_offset() - a.storage_offset()
    if delta <= 0:
        return None
    size, stride = list(a.shape), list(a.stride())
    size.insert(dim, 2)
    stride.insert(dim, delta)
    pairs = sorted((s, n) for s, n in zip(stride, size, strict=True) if n > 1)
    span = 1
    for s, n in pairs:  # the stacked view must not alias: each dim steps past everything inside it
        if s < span:
            return None
        span = s * n
    return torch.as_strided(a, size, stride, a.storage_offset())


def _packed_rows(table: BlockTable, block_size: int | None, what: str) -> torch.Tensor:
    """A PACKED or RAGGED KVX block table as the 2-D `[seqs, max_blocks]` block-id matrix engines use.

    PACKED tables are returned as they are (zero-copy); RAGGED ones are converted (a copy).
    """
    from kvx_core.block_tables import ragged_to_packed

    if table.format == BlockTableFormat.PACKED:
        rows = table.indices
        require(rows.dim() == 2, Status.INVALID_ARGUMENT,
                f"{what}: PACKED indices must be 2-D [seqs, max_blocks], got {tuple(rows.shape)}")
        return rows
    require(table.format == BlockTableFormat.RAGGED, Status.UNSUPPORTED,
            f"{what}: a {table.format.name} table has per-(beam, K|V) pool offsets, not block ids; convert it "
            "with kvx_adapters.trtllm.packed_from_kv_offsets first")
    require(block_size is not None, Status.INVALID_ARGUMENT, f"{what}: converting a RAGGED table needs block_size")
    rows, _ = ragged_to_packed(table.indices, table.indptr, block_size, table.max_blocks_per_seq)
    return rows


def _seq_lens(lengths: object, what: str, count: int | None = None, check: bool = True) -> SeqLens:
    """Wrap a 1-D S32/S64 lengths tensor (optionally its first `count` entries) as SeqLens; `check=False` skips
    the value check (a host sync) for lengths the engine owns, e.g. while a CUDA graph is captured."""
    t = _index_tensor(lengths, what, 1)
    if count is not None:
        require(0 <= count <= t.numel(), Status.INVALID_ARGUMENT,
                f"{what} has {t.numel()} entries, {count} requested")
        t = t[:count]
    require(not check or not t.numel() or int(t.min()) >= 0, Status.INVALID_ARGUMENT, f"{what} must be >= 0")
    return SeqLens(t)


def _int32(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` as int32 (zero-copy when it already is); OUT_OF_RANGE if values do not fit."""
    if t.dtype == torch.int32:
        return t
    require(kvx_dtype(t.dtype) in INDEX_DTYPES, Status.INVALID_ARGUMENT, f"{what} must be S32 or S64")
    if t.numel():
        require(int(t.min()) >= -2**31 and int(t.max()) < 2**31, Status.OUT_OF_RANGE,
                f"{what} has values that do not fit in int32")
    return t.to(torch.int32)
