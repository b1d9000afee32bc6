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


class LayerPools(NamedTuple):
    """One layer's side of the moves that does not change between requests (`bind_layer_rows`): its cache's block
    size, its pools and the bytes of each flat tensor it copies (gather only)."""

    block_size: int
    pools: list[PoolRows]
    flat: list[int]


@dataclass
class BoundGroup:
    """Layers of one `_signature` that launch together, bound once (the plan / run split of issue 36: an engine's
    layers are the same pools request after request): the indices of its layers in what was bound, the first
    layer's pools and the bytes of its flat tensors, per layer the byte offsets of its pools from the first layer's
    (`[layers, MAX_POOLS]`: the chunk and flat columns are a request's, `plan_bound`), and the widest integer each
    pool's side allows its rows to move as (`_pool_width`)."""

    layers: list[int]
    block_size: int
    pools: list[PoolRows]
    flat: list[int]
    offsets: np.ndarray
    widths: list[int]
    wide: dict[tuple[int, int], PoolRows]
    tables: dict[bytes, tuple[torch.Tensor, int]]


def bind_layer_rows(layers: Sequence[LayerPools], *, scatter: bool) -> list[BoundGroup]:
    """The launch groups of `layers` (`_group`) with the request-independent half of each launch (`BoundGroup`)."""
    groups = []
    for members in _group(layers, scatter):
        block_size, pools, flat = layers[members[0]]
        offsets = np.zeros((len(members), MAX_POOLS), dtype=np.int64)
        for row, i in zip(offsets, members, strict=True):
            ps = layers[i].pools
            row[:len(ps)] = [p.address for p in ps]
        offsets -= offsets[0]
        groups.append(BoundGroup(members, block_size, pools, flat, offsets,
                                 [_pool_width(p, offsets[:, i]) for i, p in enumerate(pools)], {}, {}))
    return groups


def plan_layer_rows(slots: torch.Tensor, layers: Sequence[LayerRows], *, scatter: bool) -> Callable[[], None]:
    """The launches that gather (`scatter=False`: pools -> chunk rows) or scatter (`True`: chunk rows -> pools) the
    rows of `slots` (int64 `[T]`, checked by the caller: in range and distinct) for every layer of `layers`: per layer
    up to four `(pool, rows)` pairs, `rows` a contiguous `[T, H, X]` tensor of the pool's element width, and up to
    four flat `(src, dst)` tensors of equal bytes (`dst` contiguous) copied whole (gather only). Layers of one
    geometry launch together (`_group`); everything is checked and built here, the returned callable only launches
    (one launch for an engine's layers). Layers bound once launch through `plan_bound` instead."""
    t = int(slots.numel())
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
    # a flat source is read from its start: a strided one (a key vector given as a view) is copied first
    layers = [LayerRows(bs, pools, [(s if s.is_contiguous() else s.contiguous(), d) for s, d in flat])
              for bs, pools, flat in layers]
    bound = bind_layer_rows([LayerPools(bs, [p for p, _ in pools], [s.numel() * s.element_size() for s, _ in flat])
                             for bs, pools, flat in layers], scatter=scatter)
    launches = []
    for g in bound:
        chunks = np.array([[c.data_ptr() for _, c in layers[i].pools] + [0] * (MAX_POOLS - len(layers[i].pools))
                           for i in g.layers], dtype=np.int64)
        flats = np.array([[t.data_ptr() for pair in layers[i].flat for t in pair] for i in g.layers],
                         dtype=np.int64).reshape(len(g.layers), -1, 2)
        _, pools, flat = layers[g.layers[0]]
        launches.append(plan_bound(slots, g, [c for _, c in pools], chunks - chunks[0], flat,
                                   flats - flats[0], scatter=scatter))
    launches = [f for f in launches if f is not None]

    def launch() -> None:
        for f in launches:
            f()
    return launch


def _signature(layer: LayerPools) -> tuple:
    """What layers launched together share: the block size, each pool's addressing and element width, each flat
    tensor's bytes."""
    block_size, pools, flat = layer
    return (block_size, tuple(p.key for p in pools), tuple(flat))


def _group(layers: Sequence[LayerPools], scatter: bool) -> list[list[int]]:
    """The indices of `layers` in launch groups of one `_signature`, in order. A scatter never puts two layers whose
    pools share a storage in one group (their stores would race; in separate launches the later layer's land last,
    as one launch per layer did); a gather only reads the pools."""
    groups: list[tuple[tuple, set, list[int]]] = []
    for i, layer in enumerate(layers):
        sig = _signature(layer)
        storages = {p.storage for p in layer.pools} if scatter else set()
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
        home[2].append(i)
    return [g[2] for g in groups]


_ZERO_TABLES: dict[torch.device, torch.Tensor] = {}


def _layer_table(offsets: np.ndarray, widths: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """(`[layers, LAYER_COLUMNS]` int64 on `device`, A): byte `offsets` from the first layer's (pools, chunk rows,
    flat sources, flat destinations) in elements of each column's width (pools and chunk rows: as they move,
    `widths`; flat tensors: bytes), the pool and chunk columns in units of A elements: A = `ALIGN` where every one
    of them is a multiple of it (the kernel then knows each layer's rows start as aligned as the first layer's),
    else 1. A single layer: zeros, kept per device."""
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


_KEPT_TABLES = 8
"""Device layer tables kept per bound group: one per chunk stride and flat-tensor arrangement a request met (a chunk
stride follows from the request's token count; an engine meets a few often)."""


def _table(group: BoundGroup, offsets: np.ndarray, widths: list[int], device: torch.device
           ) -> tuple[torch.Tensor, int]:
    """`_layer_table` of a bound group's `offsets`, kept on the group: the same offsets (the same stride, the
    flat tensors laid out alike) reuse the device table instead of uploading another (never written after)."""
    key = offsets.tobytes() + bytes(widths)
    if key not in group.tables:
        while len(group.tables) >= _KEPT_TABLES:
            group.tables.pop(next(iter(group.tables)))
        group.tables[key] = _layer_table(offsets, widths, device)
    return group.tables[key]


def _pool_width(p: PoolRows, offsets: np.ndarray) -> int:
    """The widest integer (bytes) a pool's side lets its rows move as: for a contiguous pool whose head rows are
    shorter than 16 bytes (scale pools), the widest up to 8 that divides its rows, token and head strides, its start
    and every layer's pool `offsets` (bytes, from the first layer's): a row of 8 scale bytes is then one 8-byte move,
    not eight byte moves. Otherwise its element width. The chunk side may narrow it (`_chunk_width`)."""
    w = p.base.element_size()
    if not p.contiguous or p.x * w >= 16:
        return w
    for wide in (8, 4, 2):
        f = wide // w
        if (wide > w and (p.x * w) % wide == 0 and all(s % f == 0 for s in (p.block, p.group, p.offset, p.head))
                and (p.base.storage_offset() * w) % wide == 0 and not (offsets % wide).any()):
            return wide
    return w


def _chunk_width(wide: int, w: int, rows: torch.Tensor, offsets: np.ndarray) -> int:
    """`_pool_width`'s `wide` narrowed (to at least the element width `w`) until it divides the first layer's chunk
    rows' start and every layer's chunk `offsets` (bytes, from the first layer's)."""
    start = rows.storage_offset() * rows.element_size()
    while wide > w and (start % wide or (offsets % wide).any()):
        wide //= 2
    return wide


def _row_block(x: int) -> int:
    """Row elements one program moves of a pool with rows of `x` elements: the largest power of two <= 1024 that
    divides `x` (so no element is masked: its row mask holds along the row, and vectors form)."""
    return min(1024, x & -x) if x else 1


def _wide_pool(group: BoundGroup, i: int, wide: int) -> PoolRows:
    """Pool `i` of `group` addressed as integers of `wide` bytes (made once per group and width)."""
    p = group.pools[i]
    w = p.base.element_size()
    if wide == w:
        return p
    if (i, wide) not in group.wide:
        f = wide // w
        group.wide[i, wide] = PoolRows(int_view(p.base, wide), p.block // f, p.group // f, p.offset // f, p.head // f,
                                       1, 1, p.g, p.heads, p.x // f, 1)
    return group.wide[i, wide]


def plan_bound(slots: torch.Tensor, group: BoundGroup, chunks: list[torch.Tensor], chunk_offsets: np.ndarray,
               flat: Sequence[tuple[torch.Tensor, torch.Tensor]], flat_offsets: np.ndarray, *, scatter: bool
               ) -> Callable[[], None] | None:
    """The launch moving every layer of a bound `group` for one request, or None: nothing to move. `slots`: int64
    `[T]` on the pools' device, checked by the caller (in range, distinct); `chunks`: the first layer's chunk rows
    (contiguous `[T, H, X]` of each pool's element width) and `chunk_offsets` every layer's from them (bytes,
    `[layers, MAX_POOLS]`); `flat`: the first layer's contiguous flat `(src, dst)` pairs (gather) of `group.flat`
    bytes, and `flat_offsets` every layer's from them (bytes, `[layers, len(flat), 2]`). A program moves BR
    (token, head) rows by `_row_block` elements of each pool: `TILE_BYTES` for the pool of the widest such block.
    Only launches run in the returned callable."""
    t = int(slots.numel())
    offsets = np.zeros((len(group.layers), LAYER_COLUMNS.value), dtype=np.int64)
    offsets[:, :MAX_POOLS] = group.offsets
    offsets[:, MAX_POOLS:2 * MAX_POOLS] = chunk_offsets
    if len(flat):
        offsets[:, 2 * MAX_POOLS:2 * MAX_POOLS + len(flat)] = flat_offsets[:, :, 0]
        offsets[:, 2 * MAX_POOLS + MAX_FLAT:2 * MAX_POOLS + MAX_FLAT + len(flat)] = flat_offsets[:, :, 1]
    pargs, consts, blocks, xs, widths, heads, widest = [], [], [], [], [], 1, 1
    for i in range(MAX_POOLS):
        if i < len(group.pools):
            w = group.pools[i].base.element_size()
            wide = _chunk_width(group.widths[i], w, chunks[i], chunk_offsets[:, i])
            p = _wide_pool(group, i, wide)
            c = _as_dtype(chunks[i], p.base.dtype) if wide == w else chunks[i].reshape(-1).view(torch.uint8).view(
                p.base.dtype)
            pargs += [p.base, p.block, p.group, p.offset, p.head, p.dp, p.pack, c, p.x, p.heads]
            consts.append((p.g, p.pk, p.contiguous))
            blocks.append(_row_block(p.x))
            xs.append(p.x)
            widths.append(wide)
            heads = max(heads, p.heads)
            widest = max(widest, blocks[-1] * wide)
        else:  # an absent pool: X = 0, its programs return at once
            pargs += [slots, 0, 0, 0, 0, 0, 0, slots, 0, 1]
            consts.append((1, 1, True))
            blocks.append(1)
            widths.append(1)
    fargs = []
    for i in range(MAX_FLAT):
        if i < len(flat):
            src = _as_dtype(flat[i][0], torch.uint8)
            fargs += [src, _as_dtype(flat[i][1], torch.uint8), src.numel()]
        else:
            fargs += [slots, slots, 0]
    spans = [x // b for x, b in zip(xs, blocks[:len(xs)], strict=True)]  # programs along a row, per pool
    if (t == 0 or not any(spans)) and not len(flat):
        return None
    require(len(group.layers) * (MAX_POOLS + MAX_FLAT) < 65536, Status.INVALID_ARGUMENT,
            f"plan_layer_rows: {len(group.layers)} layers in one launch exceed the grid (at most 8191)")
    require(t * heads < 2 ** 31, Status.INVALID_ARGUMENT,
            f"plan_layer_rows: {t} tokens x {heads} heads exceed the kernel's int32 row index")
    table, align = _table(group, offsets, widths, slots.device)
    br = max(1, TILE_BYTES // widest)
    grid = (max(1, triton.cdiv(t * heads, br)), len(group.layers) * (MAX_POOLS + MAX_FLAT), max([1, *spans]))

    def launch() -> None:
        with on_device(slots.device):
            _rows_kernel[grid](slots, t, group.block_size, table, *pargs, *fargs,
                               G0=consts[0][0], G1=consts[1][0], G2=consts[2][0], G3=consts[3][0],
                               K0=consts[0][1], K1=consts[1][1], K2=consts[2][1], K3=consts[3][1],
                               L0=consts[0][2], L1=consts[1][2], L2=consts[2][2], L3=consts[3][2],
                               E0=blocks[0], E1=blocks[1], E2=blocks[2], E3=blocks[3],
                               A=align, BR=br, SCATTER=scatter, num_warps=4)
    return launch
