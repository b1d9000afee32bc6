"""KV block layouts (spec §4.2): canonical shapes and strides, detection, zero-copy views, conversion.

Every layout has one *logical* order, `[num_blocks, block_size, num_kv_heads, head_dim]`.
`block_view` turns a cache tensor of any layout into the 5-D zero-copy view
`[num_blocks, block_size, num_kv_heads, head_dim // pack, pack]` (pack = 1 except HND_PACKED),
which is what the reference ops index; `logical_view` merges the last two dims when strides allow.
CUSTOM tensors are given directly in logical order with arbitrary strides.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .enums import Layout
from .errors import KvxError, Status, require


@dataclass(frozen=True)
class Geometry:
    """Cache geometry shared by the K and V tensors of one layer."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def check(self) -> None:
        """Spec §7.1: every extent is non-zero."""
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            require(value > 0, Status.INVALID_ARGUMENT, f"{name} must be > 0, got {value}")


def ndim_of(layout: Layout) -> int:
    """Number of dimensions a tensor of `layout` has."""
    require(layout != Layout.UNSPECIFIED, Status.INVALID_ARGUMENT, "layout is UNSPECIFIED")
    return 5 if layout == Layout.HND_PACKED else 4


def canonical_shape(layout: Layout, geom: Geometry, pack: int = 1) -> tuple[int, ...]:
    """Shape of a `layout` tensor holding `geom` (spec §4.2); CUSTOM is in logical order."""
    n, b, h, d = geom.num_blocks, geom.block_size, geom.num_kv_heads, geom.head_dim
    if layout in (Layout.NHD, Layout.CUSTOM):
        return (n, b, h, d)
    if layout == Layout.HND:
        return (n, h, b, d)
    if layout == Layout.HND_PACKED:
        require(pack > 0 and d % pack == 0, Status.INVALID_ARGUMENT,
                f"HND_PACKED needs head_dim % pack == 0, got head_dim={d}, pack={pack}")
        return (n, h, d // pack, b, pack)
    raise KvxError(Status.INVALID_ARGUMENT, f"unknown layout {layout!r}")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements, last dim contiguous."""
    strides, acc = [], 1
    for extent in reversed(shape):
        strides.append(acc)
        acc *= max(extent, 1)
    return tuple(reversed(strides))


def canonical_strides(layout: Layout, geom: Geometry, pack: int = 1) -> tuple[int, ...]:
    """Canonical contiguous strides of `layout` (spec §4.2)."""
    return contiguous_strides(canonical_shape(layout, geom, pack))


def pack_of(layout: Layout, shape: tuple[int, ...]) -> int:
    """The HND_PACKED pack factor (`shape[4]`), 1 for the other layouts."""
    return int(shape[4]) if layout == Layout.HND_PACKED else 1


def check_shape(layout: Layout, shape: tuple[int, ...], geom: Geometry, what: str = "tensor") -> None:
    """Spec §4.2/§7.1: `ndim` matches the layout and `shape` agrees with the cache geometry."""
    want_ndim = ndim_of(layout)
    require(len(shape) == want_ndim, Status.INVALID_ARGUMENT,
            f"{what}: layout {layout.name} needs ndim {want_ndim}, got shape {tuple(shape)}")
    pack = pack_of(layout, shape)
    if layout == Layout.HND_PACKED:
        require(pack > 0 and geom.head_dim % pack == 0, Status.INVALID_ARGUMENT,
                f"{what}: HND_PACKED needs head_dim % pack == 0 (head_dim={geom.head_dim}, pack={pack})")
    want = canonical_shape(layout, geom, pack)
    require(tuple(shape) == want, Status.INVALID_ARGUMENT,
            f"{what}: shape {tuple(shape)} does not match {layout.name} geometry {want} "
            f"(num_blocks={geom.num_blocks}, block_size={geom.block_size}, "
            f"num_kv_heads={geom.num_kv_heads}, head_dim={geom.head_dim})")


# Permutation from a layout's own dim order to the 5-D block order [N, B, H, D/pack, pack].
_TO_BLOCK_ORDER = {
    Layout.NHD: (0, 1, 2, 3),
    Layout.CUSTOM: (0, 1, 2, 3),
    Layout.HND: (0, 2, 1, 3),
    Layout.HND_PACKED: (0, 3, 1, 2, 4),
}


def block_view(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Zero-copy `[num_blocks, block_size, heads, head_dim // pack, pack]` view of a cache tensor."""
    require(layout in _TO_BLOCK_ORDER, Status.INVALID_ARGUMENT, f"unknown layout {layout!r}")
    require(t.dim() == ndim_of(layout), Status.INVALID_ARGUMENT,
            f"layout {layout.name} needs a {ndim_of(layout)}-D tensor, got shape {tuple(t.shape)}")
    v = t.permute(*_TO_BLOCK_ORDER[layout])
    return v if layout == Layout.HND_PACKED else v.unsqueeze(-1)


def logical_view(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Zero-copy `[num_blocks, block_size, heads, head_dim]` view; UNSUPPORTED when strides forbid it.

    HND_PACKED with pack > 1 and block_size > 1 interleaves tokens inside head_dim, so no strided
    4-D view exists: use `block_view` (5-D) or `convert` (a copy) instead.
    """
    v5 = block_view(t, layout)
    n, b, h, dp, p = v5.shape
    try:
        return v5.view(n, b, h, dp * p)
    except RuntimeError:
        raise KvxError(Status.UNSUPPORTED,
                       f"{layout.name} tensor with strides {tuple(t.stride())} has no zero-copy "
                       "[blocks, block_size, heads, head_dim] view; use block_view() or convert()") from None


def _is_canonical(t: torch.Tensor) -> bool:
    return all(st == want for st, want, n in zip(t.stride(), contiguous_strides(tuple(t.shape)), t.shape)
               if n > 1)


def detect_layout(t: torch.Tensor, geom: Geometry) -> Layout:
    """Infer the layout of a cache tensor given in some layout's dim order.

    5-D tensors are HND_PACKED; 4-D tensors whose shape is `[N, H, B, D]` (and not also `[N, B, H, D]`)
    are HND; `[N, B, H, D]` tensors are NHD when canonical, else CUSTOM (logical order, own strides).
    When H == B the shape is ambiguous and strides decide: canonical HND strides mean HND.
    """
    n, b, h, d = geom.num_blocks, geom.block_size, geom.num_kv_heads, geom.head_dim
    shape = tuple(t.shape)
    if t.dim() == 5 and len(shape) == 5 and shape[0] == n and shape[1] == h and shape[3] == b \
            and shape[2] * shape[4] == d:
        return Layout.HND_PACKED
    if t.dim() == 4:
        nhd, hnd = shape == (n, b, h, d), shape == (n, h, b, d)
        if hnd and (not nhd or (h != b and _is_canonical(t))):
            return Layout.HND
        if nhd:
            return Layout.NHD if _is_canonical(t) else Layout.CUSTOM
    raise KvxError(Status.INVALID_ARGUMENT,
                   f"cannot detect a KVX layout for shape {shape} with geometry "
                   f"(blocks={n}, block_size={b}, heads={h}, head_dim={d})")


def from_logical(t: torch.Tensor) -> tuple[Layout, torch.Tensor]:
    """Name the layout of a logical-order `[N, B, H, D]` tensor from its strides.

    Returns `(NHD, t)` when it is canonical NHD, `(HND, t.permute(0, 2, 1, 3))` when its memory is
    canonical HND (how vLLM exposes an HND cache), else `(CUSTOM, t)`.
    """
    require(t.dim() == 4, Status.INVALID_ARGUMENT, f"logical cache tensor must be 4-D, got {tuple(t.shape)}")
    if _is_canonical(t):
        return Layout.NHD, t
    hnd = t.permute(0, 2, 1, 3)
    if _is_canonical(hnd):
        return Layout.HND, hnd
    return Layout.CUSTOM, t


def convert(src: torch.Tensor, src_layout: Layout, dst_layout: Layout, pack: int = 1) -> torch.Tensor:
    """Copy a cache tensor into a new contiguous tensor of `dst_layout` (`pack` for HND_PACKED)."""
    s5 = block_view(src, src_layout)
    n, b, h, dp, p = s5.shape
    geom = Geometry(n, b, h, dp * p)
    dst = torch.empty(canonical_shape(dst_layout, geom, pack), dtype=src.dtype, device=src.device)
    d5 = block_view(dst, dst_layout)
    d5.copy_(s5.reshape(n, b, h, dp * p).reshape(d5.shape))
    return dst
