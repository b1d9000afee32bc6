"""Row gather / scatter of a KV bundle chunk: every pool of a layer (K / V payload and scale pools) in ONE launch.

A bundle chunk holds each pool's rows of the requested slots, packed `[T, H, X]` in the pool's own dtype
(`transfer.rows.read_rows`). The kernel copies those rows between the pools and per-pool chunk buffers, both ways
(`plan_layer_rows`): gather (export: pools -> chunk) and scatter (import: chunk -> pools), plus on gather up to four
per-layer tensors (global scales, key vectors) copied whole. Bits are moved as integers of the element's width (no float
arithmetic), so the chunk is bit-identical to the torch gather.

A pool is addressed through its 5-D block view `[blocks, block_size, H, Dp, pack]` with any element strides
(NHD, HND, HND_PACKED, regions of a page buffer), plus a token split for pools interleaved by G tokens
(`scale_layout.Interleave4Rows`): the element of (block, offset, head, dp, p) lies at
`block*s_b + (offset // G)*s_g + (offset % G)*s_o + head*s_h + dp*s_d + p*s_p`. Grid `(cdiv(T, BT), 8,
cdiv(max row, BE))`: axis 1 picks one of four pools or four flat tensors; absent ones return at once. A pool whose
token rows are contiguous (`PoolRows.flat`) skips the index arithmetic.

Layers of one geometry (an engine's layers: the same pool strides and row shapes, each in its own allocation) move
in the same launch (`plan_layer_rows`): axis 1 runs over 8 x layers, and each layer's pointers are layer 0's plus
that layer's element offsets, read from a small device table (`[layers, 16]` int64: pools, chunk rows, flat sources,
flat destinations). One launch per bundle instead of one per layer: the host work and launch latency of a layer
(~40-60 us of Python per launch) no longer scale with the layers, which is what a short prompt's handoff pays.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...errors import Status, require
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

    @property
    def flat(self) -> bool:
        """Whether a token's row is one contiguous run of elements (NHD pools, vLLM pages): the kernel then
        addresses it without dividing the element index, and its loads and stores vectorize."""
        return self.g == 1 and self.pk == 1 and self.dp == 1 and (self.heads == 1 or self.head == self.x)


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The storage of `t` from its first element to the storage's end, as the integer dtype of its element width
    (a view: the kernel reads and writes the pool itself)."""
    size = t.element_size()
    dt = _INT[size]
    storage = t.untyped_storage()
    count = storage.nbytes() // size - t.storage_offset()
    return torch.empty(0, dtype=dt, device=t.device).set_(storage, t.storage_offset(), (count,), (1,))


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
def _move(P, s_b, s_g, s_o, s_h, s_d, s_p, C, SLOT, T, t0, e0, X, R, BS,
          G: tl.constexpr, PK: tl.constexpr, FLAT: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
          SCATTER: tl.constexpr):
    """Tokens t0 .. t0+BT, row elements e0 .. e0+BE of one pool <-> its chunk rows `C [T, R]` (FLAT: each token's
    row is contiguous in the pool)."""
    t = t0 + tl.arange(0, BT)
    e = e0 + tl.arange(0, BE)
    tm = t < T
    m = tm[:, None] & (e < R)[None, :]
    slot = tl.load(SLOT + t, mask=tm, other=0).to(tl.int64)
    blk = slot // BS
    off = slot % BS
    tok = blk * s_b + (off // G) * s_g + (off % G) * s_o
    if FLAT:
        elem = e.to(tl.int64)
    else:
        h = (e // X).to(tl.int64)
        r = e % X
        elem = h * s_h + (r // PK).to(tl.int64) * s_d + (r % PK).to(tl.int64) * s_p
    p = P + tok[:, None] + elem[None, :]
    c = C + t.to(tl.int64)[:, None] * R + e[None, :]
    if SCATTER:
        tl.store(p, tl.load(c, mask=m), mask=m)
    else:
        tl.store(c, tl.load(p, mask=m), mask=m)


@triton.jit
def _copy(F, C, N, e0, BE: tl.constexpr):
    e = e0 + tl.arange(0, BE)
    tl.store(C + e, tl.load(F + e, mask=e < N), mask=e < N)


# T not specialized (Triton would compile T == 1 and T % 16 == 0 apart): a bundle length never met before must not
# compile a kernel inside a request (a 280 ms compile inside a P/D handoff on the H200, bench_pd --profile-phases)
@triton.jit(do_not_specialize=["T"])
def _rows_kernel(
    SLOT, T, BS, LT,
    P0, b0, g0, o0, h0, d0, p0, C0, X0, R0,
    P1, b1, g1, o1, h1, d1, p1, C1, X1, R1,
    P2, b2, g2, o2, h2, d2, p2, C2, X2, R2,
    P3, b3, g3, o3, h3, d3, p3, C3, X3, R3,
    F0, FC0, N0, F1, FC1, N1, F2, FC2, N2, F3, FC3, N3,
    G0: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr, G3: tl.constexpr,
    K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    L0: tl.constexpr, L1: tl.constexpr, L2: tl.constexpr, L3: tl.constexpr,
    BT: tl.constexpr, BE: tl.constexpr, SCATTER: tl.constexpr,
):
    t0 = tl.program_id(0) * BT
    which = tl.program_id(1) % MOVES
    lt = LT + (tl.program_id(1) // MOVES).to(tl.int64) * LAYER_COLUMNS  # this layer's element offsets
    e0 = tl.program_id(2) * BE
    if which == 0:
        if e0 < R0:
            _move(P0 + tl.load(lt), b0, g0, o0, h0, d0, p0, C0 + tl.load(lt + 4), SLOT, T, t0, e0, X0, R0, BS, G0,
                  K0, L0, BT, BE, SCATTER)
    elif which == 1:
        if e0 < R1:
            _move(P1 + tl.load(lt + 1), b1, g1, o1, h1, d1, p1, C1 + tl.load(lt + 5), SLOT, T, t0, e0, X1, R1, BS, G1,
                  K1, L1, BT, BE, SCATTER)
    elif which == 2:
        if e0 < R2:
            _move(P2 + tl.load(lt + 2), b2, g2, o2, h2, d2, p2, C2 + tl.load(lt + 6), SLOT, T, t0, e0, X2, R2, BS, G2,
                  K2, L2, BT, BE, SCATTER)
    elif which == 3:
        if e0 < R3:
            _move(P3 + tl.load(lt + 3), b3, g3, o3, h3, d3, p3, C3 + tl.load(lt + 7), SLOT, T, t0, e0, X3, R3, BS, G3,
                  K3, L3, BT, BE, SCATTER)
    elif tl.program_id(0) == 0:
        if which == 4:
            _copy(F0 + tl.load(lt + 8), FC0 + tl.load(lt + 12), N0, e0, BE)
        elif which == 5:
            _copy(F1 + tl.load(lt + 9), FC1 + tl.load(lt + 13), N1, e0, BE)
        elif which == 6:
            _copy(F2 + tl.load(lt + 10), FC2 + tl.load(lt + 14), N2, e0, BE)
        else:
            _copy(F3 + tl.load(lt + 11), FC3 + tl.load(lt + 15), N3, e0, BE)


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


def plan_layer_rows(slots: torch.Tensor, layers: Sequence[LayerRows], *, scatter: bool, block_t: int = 16,
                    block_e: int = 1024) -> Callable[[], None]:
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
    for _, pools, flat in layers:
        require(len(pools) <= MAX_POOLS and len(flat) <= MAX_FLAT and not (scatter and flat),
                Status.INVALID_ARGUMENT, f"plan_layer_rows: at most {MAX_POOLS} pools and {MAX_FLAT} flat tensors "
                                         "(gather only)")
        check_device(slots, *(c for _, c in pools), *(x for f in flat for x in f))
        for i, (p, c) in enumerate(pools):
            require(c.is_contiguous() and c.numel() * c.element_size() == t * p.row * p.base.element_size(),
                    Status.INVALID_ARGUMENT, f"plan_layer_rows: rows {i} must be contiguous [{t}, {p.heads}, {p.x}] "
                                             f"elements of {p.base.element_size()} bytes")
        for i, (src, dst) in enumerate(flat):
            require(dst.is_contiguous() and src.numel() * src.element_size() == dst.numel() * dst.element_size(),
                    Status.INVALID_ARGUMENT,
                    f"plan_layer_rows: flat tensor {i}: a contiguous destination of equal bytes")
    launches = [_plan_group(slots, t, group, scatter, block_t, block_e)
                for group in _group(layers, scatter)]
    launches = [f for f in launches if f is not None]

    def launch() -> None:
        for f in launches:
            f()
    return launch


def _signature(layer: LayerRows) -> tuple:
    """What layers launched together share: the block size, each pool's addressing and element width, each flat
    tensor's bytes."""
    block_size, pools, flat = layer
    return (block_size, tuple((p.block, p.group, p.offset, p.head, p.dp, p.pack, p.g, p.heads, p.x, p.pk, p.base.dtype)
                  for p, _ in pools),
            tuple(src.numel() * src.element_size() for src, _ in flat))


def _group(layers: Sequence[LayerRows], scatter: bool) -> list[list[LayerRows]]:
    """`layers` in launch groups of one `_signature`, in order. A scatter never puts two layers whose pools share a
    storage in one group (their stores would race; in separate launches the later layer's land last, as one launch
    per layer did); a gather only reads the pools."""
    groups: list[tuple[tuple, set, list[LayerRows]]] = []
    for layer in layers:
        sig = _signature(layer)
        storages = {p.base.untyped_storage().data_ptr() for p, _ in layer.pools} if scatter else set()
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


def _layer_table(group: list[LayerRows], device: torch.device) -> torch.Tensor:
    """`[layers, LAYER_COLUMNS]` int64 on `device`: each layer's element offsets from the group's first layer, per
    pool, chunk rows, flat source and flat destination (a single layer: zeros, kept per device)."""
    if len(group) == 1:
        if device not in _ZERO_TABLES:
            _ZERO_TABLES[device] = torch.zeros(1, LAYER_COLUMNS.value, dtype=torch.int64, device=device)
        return _ZERO_TABLES[device]

    def ptrs(layer: LayerRows) -> list[tuple[int, int]]:
        _, pools, flat = layer
        cols = [(p.base.data_ptr(), p.base.element_size()) for p, _ in pools] + [(0, 1)] * (MAX_POOLS - len(pools))
        cols += [(c.data_ptr(), p.base.element_size()) for p, c in pools] + [(0, 1)] * (MAX_POOLS - len(pools))
        cols += [(s.data_ptr(), 1) for s, _ in flat] + [(0, 1)] * (MAX_FLAT - len(flat))
        return cols + [(d.data_ptr(), 1) for _, d in flat] + [(0, 1)] * (MAX_FLAT - len(flat))

    first = ptrs(group[0])
    rows = []
    for layer in group:
        row = []
        for (a, size), (b, _) in zip(ptrs(layer), first, strict=True):
            require((a - b) % size == 0, Status.INTERNAL_ERROR, "plan_layer_rows: a layer's tensor is not aligned "
                                                                "to its element width relative to the first layer's")
            row.append((a - b) // size)
        rows.append(row)
    cuda = device.type == "cuda"
    return torch.tensor(rows, dtype=torch.int64, pin_memory=cuda).to(device, non_blocking=cuda)


def _plan_group(slots: torch.Tensor, t: int, group: list[LayerRows], scatter: bool, block_t: int, block_e: int
                ) -> Callable[[], None] | None:
    """One launch moving every layer of `group` (layers of one `_signature`, checked), or None: nothing to move."""
    block_size, pools, flat = group[0]
    pargs, consts, widest = [], [], 0
    for i in range(MAX_POOLS):
        if i < len(pools):
            p, c = pools[i]
            pargs += [p.base, p.block, p.group, p.offset, p.head, p.dp, p.pack, _as_dtype(c, p.base.dtype), p.x, p.row]
            consts.append((p.g, p.pk, p.flat))
            widest = max(widest, p.row)
        else:  # an absent pool: R = 0, its programs return at once
            pargs += [slots, 0, 0, 0, 0, 0, 0, slots, 1, 0]
            consts.append((1, 1, True))
    fargs = []
    for i in range(MAX_FLAT):
        if i < len(flat):
            src, dst = flat[i]
            src = _as_dtype(src, torch.uint8)
            fargs += [src, _as_dtype(dst, torch.uint8), src.numel()]
            widest = max(widest, src.numel())
        else:
            fargs += [slots, slots, 0]
    if widest == 0 or (t == 0 and not flat):
        return None
    require(len(group) * (MAX_POOLS + MAX_FLAT) < 65536, Status.INVALID_ARGUMENT,
            f"plan_layer_rows: {len(group)} layers in one launch exceed the grid (at most 8191)")
    table = _layer_table(group, slots.device)
    grid = (max(1, triton.cdiv(t, block_t)), len(group) * (MAX_POOLS + MAX_FLAT), triton.cdiv(widest, block_e))

    def launch() -> None:
        with on_device(slots.device):
            _rows_kernel[grid](slots, t, block_size, table, *pargs, *fargs,
                               G0=consts[0][0], G1=consts[1][0], G2=consts[2][0], G3=consts[3][0],
                               K0=consts[0][1], K1=consts[1][1], K2=consts[2][1], K3=consts[3][1],
                               L0=consts[0][2], L1=consts[1][2], L2=consts[2][2], L3=consts[3][2],
                               BT=block_t, BE=block_e, SCATTER=scatter, num_warps=4)
    return launch
