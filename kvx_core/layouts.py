"""KV block layouts (spec §4.2): canonical shapes and strides, detection, zero-copy views, conversion.

Every layout has one *logical* order, `[num_blocks, block_size, num_kv_heads, head_dim]`.
`block_view` turns a cache tensor of any layout into the 5-D zero-copy view
`[num_blocks, block_size, num_kv_heads, head_dim // pack, pack]` (pack = 1 except HND_PACKED),
which is what the reference ops index; `logical_view` merges the last two dims when strides allow.
CUSTOM tensors are given directly in logical order with arbitrary strides.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .enums import Layout, require_enum
from .errors import KvxError, Status, int_value, require


@dataclass(frozen=True)
class Geometry:
    """Cache geometry shared by the K and V tensors of one layer."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def check(self) -> None:
        """Spec §7.1: every extent is a non-zero int (a float or bool would break indexing later)."""
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if int_value(value) is None or value <= 0:
                raise KvxError(Status.INVALID_ARGUMENT, f"{name} must be an int > 0, got {value!r}")


def _layout(layout: object) -> Layout:
    """`layout` as a Layout (a plain int as the C ABI passes it is fine); UNSPECIFIED and others refused."""
    member = require_enum(Layout, layout, "layout")
    require(member != Layout.UNSPECIFIED, Status.INVALID_ARGUMENT, "layout is UNSPECIFIED")
    return member


def _require_tensor(t: object, what: str) -> None:
    require(isinstance(t, torch.Tensor), Status.INVALID_ARGUMENT,
            f"{what} must be a torch.Tensor, got {type(t).__name__}")


def _require_int_seq(shape: object, what: str) -> None:
    require(isinstance(shape, (tuple, list)) and all(int_value(x) is not None for x in shape),
            Status.INVALID_ARGUMENT, f"{what} must be a sequence of ints, got {shape!r}")


def _check_geometry(geom: object) -> None:
    require(isinstance(geom, Geometry), Status.INVALID_ARGUMENT,
            f"geometry must be a Geometry, got {type(geom).__name__}")
    geom.check()


def ndim_of(layout: Layout) -> int:
    """Number of dimensions a tensor of `layout` has."""
    return 5 if _layout(layout) == Layout.HND_PACKED else 4


def canonical_shape(layout: Layout, geom: Geometry, pack: int = 1) -> tuple[int, ...]:
    """Shape of a `layout` tensor holding `geom` (spec §4.2); CUSTOM is in logical order."""
    layout = _layout(layout)
    _check_geometry(geom)
    n, b, h, d = geom.num_blocks, geom.block_size, geom.num_kv_heads, geom.head_dim
    if layout in (Layout.NHD, Layout.CUSTOM):
        return (n, b, h, d)
    if layout == Layout.HND:
        return (n, h, b, d)
    require(int_value(pack) is not None and pack > 0 and d % pack == 0,
            Status.INVALID_ARGUMENT, f"HND_PACKED needs head_dim % pack == 0, got head_dim={d}, pack={pack!r}")
    return (n, h, d // pack, b, pack)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements, last dim contiguous."""
    _require_int_seq(shape, "shape")
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
    if _layout(layout) != Layout.HND_PACKED:
        return 1
    _require_int_seq(shape, "shape")
    require(len(shape) == 5, Status.INVALID_ARGUMENT, f"HND_PACKED shape must have 5 dims, got {tuple(shape)}")
    return shape[4]


def check_shape(layout: Layout, shape: tuple[int, ...], geom: Geometry, what: str = "tensor") -> None:
    """Spec §4.2/§7.1: `ndim` matches the layout and `shape` agrees with the cache geometry."""
    layout = _layout(layout)
    _require_int_seq(shape, f"{what} shape")
    _check_geometry(geom)
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
    _require_tensor(t, "cache tensor")
    layout = _layout(layout)
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
    return all(st == want for st, want, n in zip(t.stride(), contiguous_strides(tuple(t.shape)), t.shape, strict=True)
               if n > 1)


def detect_layout(t: torch.Tensor, geom: Geometry) -> Layout:
    """Infer the layout of a cache tensor given in some layout's dim order.

    5-D tensors are HND_PACKED; 4-D tensors whose shape is `[N, H, B, D]` (and not also `[N, B, H, D]`)
    are HND; `[N, B, H, D]` tensors are NHD when canonical, else CUSTOM (logical order, own strides).
    When H == B the shape is ambiguous and strides decide: canonical HND strides mean HND.
    """
    _require_tensor(t, "cache tensor")
    _check_geometry(geom)
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
    _require_tensor(t, "logical cache tensor")
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


# ---------------------------------------------------------------- memory overlap
_CHUNK = 1 << 16
"""Most candidate offsets `tensors_overlap` holds at once (it works through larger sets in chunks)."""


@dataclass(frozen=True)
class ByteLattice:
    """The bytes a strided tensor touches, relative to its first byte:
    `{sum(i_k * stride_k) + u : 0 <= i_k < count_k, 0 <= u < run}`, dims `(count, byte stride)` outermost first."""

    dims: tuple[tuple[int, int], ...]
    run: int

    @functools.cached_property
    def span(self) -> int:
        """Bytes from the first touched byte to one past the last."""
        return sum((n - 1) * s for n, s in self.dims) + self.run

    @property
    def inner(self) -> ByteLattice:
        """The lattice without its outermost dim."""
        return ByteLattice(self.dims[1:], self.run)


def byte_lattice(t: torch.Tensor) -> ByteLattice:
    """The bytes `t` touches (non-empty `t`), with contiguous dims merged: fewer dims, same set."""
    return _byte_lattice(tuple(t.shape), t.stride(), t.element_size())


@functools.lru_cache(maxsize=1024)
def _byte_lattice(shape: tuple[int, ...], stride: tuple[int, ...], es: int) -> ByteLattice:
    run, merged = es, []
    for s, n in sorted((s * es, n) for n, s in zip(shape, stride, strict=True) if n > 1 and s != 0):
        if not merged and s == run:
            run *= n  # the next element starts where the run ends
        elif merged and s == merged[-1][0] * merged[-1][1]:
            merged[-1] = (merged[-1][0], merged[-1][1] * n)  # i1*s1 + i2*s1*n1 == i*s1
        else:
            merged.append((s, n))
    return ByteLattice(tuple((n, s) for s, n in reversed(merged)), run)


@dataclass(frozen=True)
class Footprint:
    """The bytes a tensor touches: `lattice` placed at address `base` on `device` (None: no bytes)."""

    device: torch.device | None
    base: int
    lattice: ByteLattice | None

    def overlaps(self, other: Footprint) -> bool:
        """Whether the two share a byte. Exact for any strides, including views that interleave (regions
        of one page buffer): an interval test, then a walk down both stride lattices that keeps only the
        offsets where the two can still meet (O(1) work for views sharing an outer stride)."""
        a, b = self.lattice, other.lattice
        if a is None or b is None:
            return False
        shift = self.base - other.base
        return -a.span < shift < b.span and self.device == other.device and _lattices_meet(a, b, shift)


def footprint(t: torch.Tensor) -> Footprint:
    """What `t` touches in memory (nothing for an empty or meta tensor)."""
    _require_tensor(t, "tensor")
    if t.numel() == 0 or t.device.type == "meta":
        return Footprint(None, 0, None)
    return Footprint(t.device, t.data_ptr(), byte_lattice(t))


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` touch a common byte (exact; see `Footprint.overlaps`)."""
    return footprint(a).overlaps(footprint(b))


@functools.lru_cache(maxsize=1024)
def _lattices_meet(a: ByteLattice, b: ByteLattice, shift: int) -> bool:
    """Whether `a` placed `shift` bytes after `b` shares a byte with `b` (cached: pools keep their addresses)."""
    return _meet(a, b, torch.tensor([shift], dtype=torch.int64))


def _meet(a: ByteLattice, b: ByteLattice, shifts: torch.Tensor) -> bool:
    """Whether `a`, placed at any of `shifts` bytes after `b`, shares a byte with `b`."""
    d = shifts[(shifts + a.span > 0) & (shifts < b.span)].unique()
    if d.numel() == 0:
        return False
    if not a.dims and not b.dims:
        return True  # two intervals that intersect
    if a.dims and b.dims and a.dims[0][1] == b.dims[0][1]:
        # same outer stride P: sub-blocks i of a and j of b meet only at shift d + (i - j) * P
        (na, p), (nb, _) = a.dims[0], b.dims[0]
        a, b = a.inner, b.inner
        lo = torch.clamp(_floordiv(-a.span - d, p) + 1, min=-(nb - 1))
        hi = torch.clamp(_floordiv(b.span - 1 - d, p), max=na - 1)
        step = p
    elif a.dims and (not b.dims or a.dims[0][1] > b.dims[0][1]):
        (na, p), a = a.dims[0], a.inner  # sub-block i of a sits at d + i * p
        lo = torch.clamp(_floordiv(-a.span - d, p) + 1, min=0)
        hi = torch.clamp(_floordiv(b.span - 1 - d, p), max=na - 1)
        step = p
    else:
        (nb, p), b = b.dims[0], b.inner  # a sits at d - j * p from sub-block j of b
        lo = torch.clamp(_floordiv(d - b.span, p) + 1, min=0)
        hi = torch.clamp(_floordiv(d + a.span - 1, p), max=nb - 1)
        step = -p
    return any(_meet(a, b, part) for part in _expand(d, lo, hi, step))


def _floordiv(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.div(x, n, rounding_mode="floor")


def _expand(d: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, step: int) -> Iterator[torch.Tensor]:
    """`d[e] + i * step` for every entry e and every i in `[lo[e], hi[e]]`, in chunks of at most _CHUNK."""
    cnt = (hi - lo + 1).clamp(min=0)
    keep = cnt > 0
    d, lo, cnt = d[keep], lo[keep], cnt[keep]
    while d.numel():
        take = cnt.clamp(max=_CHUNK)
        n = max(1, int((torch.cumsum(take, 0) <= _CHUNK).sum()))
        t = take[:n]
        ends = torch.cumsum(t, 0)
        r = torch.repeat_interleave(torch.arange(n), t)
        i = lo[:n][r] + torch.arange(int(ends[-1])) - (ends - t)[r]
        yield d[:n][r] + i * step
        lo, cnt = torch.cat([lo[:n] + t, lo[n:]]), torch.cat([cnt[:n] - t, cnt[n:]])
        left = cnt > 0
        d, lo, cnt = d[left], lo[left], cnt[left]
