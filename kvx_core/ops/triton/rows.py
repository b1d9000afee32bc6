"""Row gather / scatter of a KV bundle chunk: every pool of a layer (K / V payload and scale pools) in ONE launch.

A bundle chunk holds each pool's rows of the requested slots, packed `[T, H, X]` in the pool's own dtype
(`transfer.rows.read_rows`). The kernel copies those rows between the pools and per-pool chunk buffers, both ways
(`plan_layer_rows`): gather (export: pools -> chunk) and scatter (import: chunk -> pools), plus on gather up to four
per-layer tensors (global scales, key vectors) copied whole. Bits are moved as integers of the element's width (no float
arithmetic), so the chunk is bit-identical to the torch gather.

A pool is addressed through its 5-D block view `[blocks, block_size, H, Dp, pack]` with any element strides
(NHD, HND, HND_PACKED, regions of a page buffer), plus a token split for pools interleaved by G tokens
(`scale_layout.Interleave4Rows`): the element of (block, offset, head, dp, p) lies at
`block*s_b + (offset // G)*s_g + (offset % G)*s_o + head*s_h + dp*s_d + p*s_p`. A program moves a tile of
(token, head) rows by a block of row elements that divides the row (`_row_block`): grid `(cdiv(T * H, BR), 8,
max X / block)`, axis 1 picks one of four pools or four flat tensors (absent ones return at once). The address work
is per row (a slot load, its block and offset), not per element, and a pool whose head rows are contiguous runs of
elements (`PoolRows.contiguous`: every engine layout but the interleaved scales) moves in vectors of up to 16 bytes:
no element is masked, and row offsets that are multiples of 16 elements are known as such to the compiler (its
argument specialization; layer offsets are passed in units of 16 elements where they all are). One byte per load
instruction moved NVFP4 bundles at ~190 GB/s on an H200 (`profile_transfer.py` at 16k tokens x 8 layers).

Layers of one geometry (an engine's layers: the same pool strides and row shapes, each in its own allocation) move
in the same launch (`plan_layer_rows`): axis 1 runs over 8 x layers, and each layer's pointers are layer 0's plus
that layer's element offsets, read from a small device table (`[layers, 16]` int64: pools, chunk rows, flat sources,
flat destinations). One launch per bundle instead of one per layer: the host work and launch latency of a layer
(~40-60 us of Python per launch) no longer scale with the layers, which is what a short prompt's handoff pays.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from ...errors import KvxError, Status, require
from .launch import check_device, on_device

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype rows of each element width move as."""
MAX_POOLS = 4
"""Pools of one layer: K and V payload, K and V scales."""
MAX_FLAT = 4
"""Per-layer tensors a gather copies whole: K / V global scales, key smoothing, key centering."""
MOVES = tl.constexpr(MAX_POOLS + MAX_FLAT)
"""Programs of one layer on grid axis 1: a pool or a flat tensor each."""
LAYER_COLUMNS = tl.constexpr(2 * (MAX_POOLS + MAX_FLAT))
"""Element offsets per layer in a launch's layer table: pools, chunk rows, flat sources, flat destinations."""
ALIGN = 16
"""Layer offsets of pools and chunk rows go in units of 16 elements where they all are multiples of 16 (the compiler
then knows each layer's rows start as aligned as the first layer's: 16-byte vectors for byte pools)."""
TILE_BYTES = 16384
"""Bytes one program moves of the pool with the widest row block (BR rows): 128 per thread with 4 warps."""


@dataclass(frozen=True)
class PoolRows:
    """One pool as the kernel addresses it: `base`, an integer tensor of the element width starting at the pool's
    first element (its whole storage from there: strided views are read in place), the element strides of the
    block view (`block`, `group`, `offset`, `head`, `dp`, `pack`), the token group `g` (1 for linear pools) and
    the row shape (`heads`, `x` elements per head, `pk` pack)."""

    base: torch.Tensor
    block: int
    group: int
    offset: int
    head: int
    dp: int
    pack: int
    g: int
    heads: int
    x: int
    pk: int

    @property
    def row(self) -> int:
        """Elements per token row (the chunk holds `[T, row]`)."""
        return self.heads * self.x

    @functools.cached_property
    def key(self) -> tuple:
        """Its addressing and element type (what layers launched together share), made once per pool view: the
        views are kept per descriptor binding, so a bundle's layers reuse theirs call after call."""
        return (self.block, self.group, self.offset, self.head, self.dp, self.pack, self.g, self.heads, self.x,
                self.pk, self.base.dtype)

    @functools.cached_property
    def address(self) -> int:
        """The device address of its first element."""
        return self.base.data_ptr()

    @functools.cached_property
    def storage(self) -> int:
        """The address of the storage it lies in (layers whose pools share one must not scatter in one launch)."""
        return self.base.untyped_storage().data_ptr()

    @property
    def contiguous(self) -> bool:
        """Whether a head's `x` elements are one contiguous run (`dp * pack` in order): moved in vectors, without
        dividing the element index."""
        return self.dp == self.pk and (self.pk == 1 or self.pack == 1)


def int_view(t: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """The storage of `t` from its first element to the storage's end, as the integer dtype of `width` bytes (default:
    its element width; `t`'s first byte a multiple of it) -- a view: the kernel reads and writes the pool itself."""
    size = t.element_size() if width is None else width
    start = t.storage_offset() * t.element_size() // size
    storage = t.untyped_storage()
    return torch.empty(0, dtype=_INT[size], device=t.device).set_(storage, start, (storage.nbytes() // size - start,),
                                                                  (1,))


def block_rows(view5: torch.Tensor) -> PoolRows:
    """A linear pool from its 5-D block view `[blocks, block_size, H, Dp, pack]`."""
    sb, so, sh, sd, sp = view5.stride()
    _, _, h, dp, pk = view5.shape
    return PoolRows(int_view(view5), sb, so, 0, sh, sd, sp, 1, h, dp * pk, pk)


def interleaved_rows(pool: torch.Tensor, group: int) -> PoolRows:
    """An HND `[blocks, H, block_size, S]` byte pool whose (block, head) planes hold tokens interleaved by `group`
    (`scale_layout`: token t, byte j at `(t // group) * group * S + j * group + t % group`)."""
    _, h, _, s = pool.shape
    return PoolRows(int_view(pool), pool.stride(0), group * s, 1, pool.stride(1), group, 0, group, h, s, 1)


@triton.jit
def _move(P, s_b, s_g, s_o, s_h, s_d, s_p, C, SLOT, T, n0, e0, X, NH, BS,
          G: tl.constexpr, PK: tl.constexpr, CONTIG: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr,
          SCATTER: tl.constexpr):
    """(token, head) rows n0 .. n0+BR (token n // NH, head n % NH), row elements e0 .. e0+BE of one pool <-> its
    chunk rows `C [T * NH, X]` (CONTIG: a head's elements are contiguous in the pool). BE divides X: no element
    mask, so the row mask is constant along a row and contiguous elements move in vectors."""
    n = n0 + tl.arange(0, BR)
    r = e0 + tl.arange(0, BE)
    nm = n < T * NH
    t = n // NH
    h = (n - t * NH).to(tl.int64)
    slot = tl.load(SLOT + t, mask=nm, other=0).to(tl.int64)
    blk = slot // BS
    off = slot % BS
    row = blk * s_b + (off // G) * s_g + (off % G) * s_o + h * s_h
    if CONTIG:
        elem = r.to(tl.int64)
    else:
        elem = (r // PK).to(tl.int64) * s_d + (r % PK).to(tl.int64) * s_p
    m = tl.broadcast_to(nm[:, None], (BR, BE))
    p = P + row[:, None] + elem[None, :]
    c = C + n.to(tl.int64)[:, None] * X + r[None, :]
    if SCATTER:
        tl.store(p, tl.load(c, mask=m), mask=m)
    else:
        tl.store(c, tl.load(p, mask=m), mask=m)


@triton.jit
def _copy(F, C, N, BLOCK: tl.constexpr):
    """A flat tensor of N bytes, whole (they are small: global scales, key vectors)."""
    for e0 in range(0, N, BLOCK):
        e = e0 + tl.arange(0, BLOCK)
        tl.store(C + e, tl.load(F + e, mask=e < N), mask=e < N)


# T not specialized (Triton would compile T == 1 and T % 16 == 0 apart): a bundle length never met before must not
# compile a kernel inside a request (a 280 ms compile inside a P/D handoff on the H200, bench_pd --profile-phases)
@triton.jit(do_not_specialize=["T"])
def _rows_kernel(
    SLOT, T, BS, LT,
    P0, b0, g0, o0, h0, d0, p0, C0, X0, N0,
    P1, b1, g1, o1, h1, d1, p1, C1, X1, N1,
    P2, b2, g2, o2, h2, d2, p2, C2, X2, N2,
    P3, b3, g3, o3, h3, d3, p3, C3, X3, N3,
    F0, FC0, M0, F1, FC1, M1, F2, FC2, M2, F3, FC3, M3,
    G0: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr, G3: tl.constexpr,
    K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    L0: tl.constexpr, L1: tl.constexpr, L2: tl.constexpr, L3: tl.constexpr,
    E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, E3: tl.constexpr,
    A: tl.constexpr, BR: tl.constexpr, SCATTER: tl.constexpr,
):
    n0 = tl.program_id(0) * BR
    which = tl.program_id(1) % MOVES
    lt = LT + (tl.program_id(1) // MOVES).to(tl.int64) * LAYER_COLUMNS  # this layer's element offsets
    if which == 0:
        e0 = tl.program_id(2) * E0
        if e0 < X0:
            _move(P0 + tl.load(lt) * A, b0, g0, o0, h0, d0, p0, C0 + tl.load(lt + 4) * A, SLOT, T, n0, e0, X0, N0,
                  BS, G0, K0, L0, BR, E0, SCATTER)
    elif which == 1:
        e0 = tl.program_id(2) * E1
        if e0 < X1:
            _move(P1 + tl.load(lt + 1) * A, b1, g1, o1, h1, d1, p1, C1 + tl.load(lt + 5) * A, SLOT, T, n0, e0, X1,
                  N1, BS, G1, K1, L1, BR, E1, SCATTER)
    elif which == 2:
        e0 = tl.program_id(2) * E2
        if e0 < X2:
            _move(P2 + tl.load(lt + 2) * A, b2, g2, o2, h2, d2, p2, C2 + tl.load(lt + 6) * A, SLOT, T, n0, e0, X2,
                  N2, BS, G2, K2, L2, BR, E2, SCATTER)
    elif which == 3:
        e0 = tl.program_id(2) * E3
        if e0 < X3:
            _move(P3 + tl.load(lt + 3) * A, b3, g3, o3, h3, d3, p3, C3 + tl.load(lt + 7) * A, SLOT, T, n0, e0, X3,
                  N3, BS, G3, K3, L3, BR, E3, SCATTER)
    elif (tl.program_id(0) == 0) & (tl.program_id(2) == 0):
        if which == 4:
            _copy(F0 + tl.load(lt + 8), FC0 + tl.load(lt + 12), M0, 1024)
        elif which == 5:
            _copy(F1 + tl.load(lt + 9), FC1 + tl.load(lt + 13), M1, 1024)
        elif which == 6:
            _copy(F2 + tl.load(lt + 10), FC2 + tl.load(lt + 14), M2, 1024)
        else:
            _copy(F3 + tl.load(lt + 11), FC3 + tl.load(lt + 15), M3, 1024)


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Contiguous `t` viewed as `dtype` (of the same element width, or bytes); itself where it is one. No reshape to
    1-D: the kernel takes only its start (one tensor op at most per tensor and launch)."""
    if t.dtype == dtype:
        return t
    return (t if t.dim() else t.reshape(1)).view(dtype)


class LayerRows(NamedTuple):
    """One layer's moves (`plan_layer_rows`): its cache's block size, its `(pool, rows)` pairs and its flat
    `(src, dst)` tensors."""

    block_size: int
    pools: list[tuple[PoolRows, torch.Tensor]]
    flat: list[tuple[torch.Tensor, torch.Tensor]]


def plan_layer_rows(slots: torch.Tensor, layers: Sequence[LayerRows], *, scatter: bool) -> Callable[[], None]:
    """The launches that gather (`scatter=False`: pools -> chunk rows) or scatter (`True`: chunk rows -> pools) the
    rows of `slots` (int64 `[T]`, checked by the caller: in range and distinct) for every layer of `layers`: per layer
    up to four `(pool, rows)` pairs, `rows` a contiguous `[T, H, X]` tensor of the pool's element width, and up to
    four flat `(src, dst)` tensors of equal bytes (`dst` contiguous) copied whole (gather only). Layers of one
    geometry launch together (`_group`); everything is checked and built here, the returned callable only launches
    (one launch for an engine's layers)."""
    t = int(slots.numel())
    # a flat source is read from its start: a strided one (a key vector given as a view) is copied first
    layers = [LayerRows(bs, pools, [(s if s.is_contiguous() else s.contiguous(), d) for s, d in flat])
              for bs, pools, flat in layers]
    # per layer of a bundle: the messages are formatted only for a layer that fails
    for _, pools, flat in layers:
        if not (len(pools) <= MAX_POOLS and len(flat) <= MAX_FLAT and not (scatter and flat)):
            raise KvxError(Status.INVALID_ARGUMENT, f"plan_layer_rows: at most {MAX_POOLS} pools and {MAX_FLAT} flat "
                                                    "tensors (gather only)")
        for i, (p, c) in enumerate(pools):
            if not (c.is_contiguous() and c.numel() * c.element_size() == t * p.row * p.base.element_size()):
                raise KvxError(Status.INVALID_ARGUMENT, f"plan_layer_rows: rows {i} must be contiguous [{t}, "
                                                        f"{p.heads}, {p.x}] elements of {p.base.element_size()} bytes")
        for i, (src, dst) in enumerate(flat):
            if not (dst.is_contiguous() and src.numel() * src.element_size() == dst.numel() * dst.element_size()):
                raise KvxError(Status.INVALID_ARGUMENT,
                               f"plan_layer_rows: flat tensor {i}: a contiguous destination of equal bytes")
    check_device(slots, *(c for _, pools, _ in layers for _, c in pools),
                 *(x for _, _, flat in layers for f in flat for x in f))
    launches = [_plan_group(slots, t, group, scatter) for group in _group(layers, scatter)]
    launches = [f for f in launches if f is not None]

    def launch() -> None:
        for f in launches:
            f()
    return launch


def _signature(layer: LayerRows) -> tuple:
    """What layers launched together share: the block size, each pool's addressing and element width, each flat
    tensor's bytes."""
    block_size, pools, flat = layer
    return (block_size, tuple(p.key for p, _ in pools), tuple(src.numel() * src.element_size() for src, _ in flat))


def _group(layers: Sequence[LayerRows], scatter: bool) -> list[list[LayerRows]]:
    """`layers` in launch groups of one `_signature`, in order. A scatter never puts two layers whose pools share a
    storage in one group (their stores would race; in separate launches the later layer's land last, as one launch
    per layer did); a gather only reads the pools."""
    groups: list[tuple[tuple, set, list[LayerRows]]] = []
    for layer in layers:
        sig = _signature(layer)
        storages = {p.storage for p, _ in layer.pools} if scatter else set()
        # the last group of this signature, unless a later group aliases this layer (ordering: it must run after)
        home = None
        for g in reversed(groups):
            if g[0] == sig and not (storages & g[1]):
                home = g
                break
            if storages & g[1]:
                break
        if home is None:
            home = (sig, set(), [])
            groups.append(home)
        home[1].update(storages)
        home[2].append(layer)
    return [g[2] for g in groups]


_ZERO_TABLES: dict[torch.device, torch.Tensor] = {}


def _byte_offsets(group: list[LayerRows]) -> np.ndarray:
    """`[layers, LAYER_COLUMNS]` int64: per layer of `group`, the byte offsets of its tensors from the first
    layer's: pools, chunk rows, flat sources, flat destinations (absent ones 0)."""
    ptrs = np.zeros((len(group), LAYER_COLUMNS.value), dtype=np.int64)
    for row, (_, pools, flat) in zip(ptrs, group, strict=True):
        for i, (p, c) in enumerate(pools):
            row[i], row[MAX_POOLS + i] = p.address, c.data_ptr()
        for i, (src, dst) in enumerate(flat):
            row[2 * MAX_POOLS + i], row[2 * MAX_POOLS + MAX_FLAT + i] = src.data_ptr(), dst.data_ptr()
    return ptrs - ptrs[0]


def _layer_table(offsets: np.ndarray, widths: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """(`[layers, LAYER_COLUMNS]` int64 on `device`, A): `offsets` (`_byte_offsets`) in elements of each column's
    width (pools and chunk rows: as they move, `widths`; flat tensors: bytes), the pool and chunk columns in units of
    A elements: A = `ALIGN` where every one of them is a multiple of it (the kernel then knows each layer's rows start
    as aligned as the first layer's), else 1. A single layer: zeros, kept per device."""
    if len(offsets) == 1:
        if device not in _ZERO_TABLES:
            _ZERO_TABLES[device] = torch.zeros(1, LAYER_COLUMNS.value, dtype=torch.int64, device=device)
        return _ZERO_TABLES[device], ALIGN
    sizes = np.array(widths + widths + [1] * (2 * MAX_FLAT), dtype=np.int64)
    require(not (offsets % sizes).any(), Status.INTERNAL_ERROR,
            "plan_layer_rows: a layer's tensor is not aligned to its element width relative to the first layer's")
    rows = offsets // sizes
    scaled = 2 * MAX_POOLS  # pool and chunk columns
    align = ALIGN if not (rows[:, :scaled] % ALIGN).any() else 1
    rows[:, :scaled] //= align
    cuda = device.type == "cuda"
    table = torch.from_numpy(rows)
    return (table.pin_memory() if cuda else table).to(device, non_blocking=cuda), align


def _width(p: PoolRows, rows: torch.Tensor, offsets: np.ndarray) -> int:
    """The integer width (bytes) a pool and its chunk rows move as: for a contiguous pool whose head rows are shorter
    than 16 bytes (scale pools), the widest up to 8 that divides its rows, token and head strides, both starts and
    every layer's `offsets` (bytes, from the first layer's): a row of 8 scale bytes is then one 8-byte move, not
    eight byte moves. Otherwise its element width."""
    w = p.base.element_size()
    if not p.contiguous or p.x * w >= 16:
        return w
    starts = (p.base.storage_offset() * w, rows.storage_offset() * rows.element_size())
    for wide in (8, 4, 2):
        f = wide // w
        if (wide > w and (p.x * w) % wide == 0 and all(s % f == 0 for s in (p.block, p.group, p.offset, p.head))
                and all(o % wide == 0 for o in starts) and not (offsets % wide).any()):
            return wide
    return w


def _as_width(p: PoolRows, rows: torch.Tensor, wide: int) -> tuple[PoolRows, torch.Tensor]:
    """`p` and its chunk rows as integers of `wide` bytes (`_width`); as they are at their own width."""
    w = p.base.element_size()
    if wide == w:
        return p, _as_dtype(rows, p.base.dtype)
    f = wide // w
    return (PoolRows(int_view(p.base, wide), p.block // f, p.group // f, p.offset // f, p.head // f, 1, 1, p.g,
                     p.heads, p.x // f, 1),
            rows.reshape(-1).view(torch.uint8).view(_INT[wide]))


def _row_block(x: int) -> int:
    """Row elements one program moves of a pool with rows of `x` elements: the largest power of two <= 1024 that
    divides `x` (so no element is masked: its row mask holds along the row, and vectors form)."""
    return min(1024, x & -x) if x else 1


def _plan_group(slots: torch.Tensor, t: int, group: list[LayerRows], scatter: bool) -> Callable[[], None] | None:
    """One launch moving every layer of `group` (layers of one `_signature`, checked), or None: nothing to move.
    A program moves BR (token, head) rows by `_row_block` elements of each pool: `TILE_BYTES` for the pool of the
    widest such block."""
    block_size, pools, flat = group[0]
    offsets = _byte_offsets(group)
    widths = [_width(p, c, offsets[:, [i, MAX_POOLS + i]])
              for i, (p, c) in enumerate(pools)]
    pools = [_as_width(p, c, w) for (p, c), w in zip(pools, widths, strict=True)]
    pargs, consts, blocks, xs, heads, widest = [], [], [], [], 1, 1
    for i in range(MAX_POOLS):
        if i < len(pools):
            p, c = pools[i]
            pargs += [p.base, p.block, p.group, p.offset, p.head, p.dp, p.pack, c, p.x, p.heads]
            consts.append((p.g, p.pk, p.contiguous))
            blocks.append(_row_block(p.x))
            xs.append(p.x)
            heads = max(heads, p.heads)
            widest = max(widest, blocks[-1] * p.base.element_size())
        else:  # an absent pool: X = 0, its programs return at once
            pargs += [slots, 0, 0, 0, 0, 0, 0, slots, 0, 1]
            consts.append((1, 1, True))
            blocks.append(1)
    fargs = []
    for i in range(MAX_FLAT):
        if i < len(flat):
            src, dst = flat[i]
            src = _as_dtype(src, torch.uint8)
            fargs += [src, _as_dtype(dst, torch.uint8), src.numel()]
        else:
            fargs += [slots, slots, 0]
    spans = [x // b for x, b in zip(xs, blocks[:len(xs)], strict=True)]  # programs along a row, per pool
    if (t == 0 or not any(spans)) and not flat:
        return None
    require(len(group) * (MAX_POOLS + MAX_FLAT) < 65536, Status.INVALID_ARGUMENT,
            f"plan_layer_rows: {len(group)} layers in one launch exceed the grid (at most 8191)")
    require(t * heads < 2 ** 31, Status.INVALID_ARGUMENT,
            f"plan_layer_rows: {t} tokens x {heads} heads exceed the kernel's int32 row index")
    table, align = _layer_table(offsets, widths + [1] * (MAX_POOLS - len(widths)), slots.device)
    br = max(1, TILE_BYTES // widest)
    grid = (max(1, triton.cdiv(t * heads, br)), len(group) * (MAX_POOLS + MAX_FLAT), max([1, *spans]))

    def launch() -> None:
        with on_device(slots.device):
            _rows_kernel[grid](slots, t, block_size, table, *pargs, *fargs,
                               G0=consts[0][0], G1=consts[1][0], G2=consts[2][0], G3=consts[3][0],
                               K0=consts[0][1], K1=consts[1][1], K2=consts[2][1], K3=consts[3][1],
                               L0=consts[0][2], L1=consts[1][2], L2=consts[2][2], L3=consts[3][2],
                               E0=blocks[0], E1=blocks[1], E2=blocks[2], E3=blocks[3],
                               A=align, BR=br, SCATTER=scatter, num_warps=4)
    return launch
