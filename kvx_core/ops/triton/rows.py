"""Row gather / scatter of a KV bundle chunk: every pool of a layer (K / V payload and scale pools) in ONE launch.

A bundle chunk holds each pool's rows of the requested slots, packed `[T, H, X]` in the pool's own dtype
(`transfer.rows.read_rows`). The kernel copies those rows between the pools and per-pool chunk buffers, both ways
(`plan_rows`): gather (export: pools -> chunk) and scatter (import: chunk -> pools), plus on gather up to four
per-layer tensors (global scales, key vectors) copied whole. Bits are moved as integers of the element's width (no float
arithmetic), so the chunk is bit-identical to the torch gather.

A pool is addressed through its 5-D block view `[blocks, block_size, H, Dp, pack]` with any element strides
(NHD, HND, HND_PACKED, regions of a page buffer), plus a token split for pools interleaved by G tokens
(`scale_layout.Interleave4Rows`): the element of (block, offset, head, dp, p) lies at
`block*s_b + (offset // G)*s_g + (offset % G)*s_o + head*s_h + dp*s_d + p*s_p`. Grid `(cdiv(T, BT), 8,
cdiv(max row, BE))`: axis 1 picks one of four pools or four flat tensors; absent ones return at once. A pool whose
token rows are contiguous (`PoolRows.flat`) skips the index arithmetic.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...errors import Status, require
from .launch import check_device

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype rows of each element width move as."""
MAX_POOLS = 4
"""Pools of one layer: K and V payload, K and V scales."""
MAX_FLAT = 4
"""Per-layer tensors a gather copies whole: K / V global scales, key smoothing, key centering."""


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
    SLOT, T, BS,
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
    which = tl.program_id(1)
    e0 = tl.program_id(2) * BE
    if which == 0:
        if e0 < R0:
            _move(P0, b0, g0, o0, h0, d0, p0, C0, SLOT, T, t0, e0, X0, R0, BS, G0, K0, L0, BT,
                  BE, SCATTER)
    elif which == 1:
        if e0 < R1:
            _move(P1, b1, g1, o1, h1, d1, p1, C1, SLOT, T, t0, e0, X1, R1, BS, G1, K1, L1, BT,
                  BE, SCATTER)
    elif which == 2:
        if e0 < R2:
            _move(P2, b2, g2, o2, h2, d2, p2, C2, SLOT, T, t0, e0, X2, R2, BS, G2, K2, L2, BT,
                  BE, SCATTER)
    elif which == 3:
        if e0 < R3:
            _move(P3, b3, g3, o3, h3, d3, p3, C3, SLOT, T, t0, e0, X3, R3, BS, G3, K3, L3, BT,
                  BE, SCATTER)
    elif tl.program_id(0) == 0:
        if which == 4:
            _copy(F0, FC0, N0, e0, BE)
        elif which == 5:
            _copy(F1, FC1, N1, e0, BE)
        elif which == 6:
            _copy(F2, FC2, N2, e0, BE)
        else:
            _copy(F3, FC3, N3, e0, BE)


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Contiguous `t` viewed as `dtype` (of the same element width, or bytes); itself where it is one. No reshape to
    1-D: the kernel takes only its start (one tensor op at most per tensor and launch)."""
    if t.dtype == dtype:
        return t
    return (t if t.dim() else t.reshape(1)).view(dtype)


def plan_rows(slots: torch.Tensor, block_size: int, pools: list[tuple[PoolRows, torch.Tensor]], *, scatter: bool,
              flat: list[tuple[torch.Tensor, torch.Tensor]] = (), block_t: int = 16,
              block_e: int = 1024) -> Callable[[], None]:
    """The launch that gathers (`scatter=False`: pools -> chunk rows) or scatters (`True`: chunk rows -> pools) the
    rows of `slots` (int64 `[T]`, checked by the caller: in range and distinct) for up to four `(pool, rows)` pairs,
    `rows` a contiguous `[T, H, X]` tensor of the pool's element width; `flat`: up to four `(src, dst)` tensors of
    equal bytes (`dst` contiguous) copied whole (gather only). Everything is checked and built here; the returned
    callable only launches (one launch)."""
    require(len(pools) <= MAX_POOLS and len(flat) <= MAX_FLAT and not (scatter and flat), Status.INVALID_ARGUMENT,
            f"plan_rows: at most {MAX_POOLS} pools and {MAX_FLAT} flat tensors (gather only)")
    t = int(slots.numel())
    check_device(slots, *(c for _, c in pools), *(x for f in flat for x in f))
    pargs, consts, widest = [], [], 0
    for i in range(MAX_POOLS):
        if i < len(pools):
            p, c = pools[i]
            require(c.is_contiguous() and c.numel() * c.element_size() == t * p.row * p.base.element_size(),
                    Status.INVALID_ARGUMENT, f"plan_rows: rows {i} must be contiguous [{t}, {p.heads}, {p.x}] "
                                             f"elements of {p.base.element_size()} bytes")
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
            require(dst.is_contiguous() and src.numel() * src.element_size() == dst.numel() * dst.element_size(),
                    Status.INVALID_ARGUMENT, f"plan_rows: flat tensor {i}: a contiguous destination of equal bytes")
            src = _as_dtype(src.contiguous(), torch.uint8)
            fargs += [src, _as_dtype(dst, torch.uint8), src.numel()]
            widest = max(widest, src.numel())
        else:
            fargs += [slots, slots, 0]
    if widest == 0 or (t == 0 and not flat):
        return lambda: None
    grid = (max(1, triton.cdiv(t, block_t)), MAX_POOLS + MAX_FLAT, triton.cdiv(widest, block_e))

    def launch() -> None:
        _rows_kernel[grid](slots, t, block_size, *pargs, *fargs,
                           G0=consts[0][0], G1=consts[1][0], G2=consts[2][0], G3=consts[3][0],
                           K0=consts[0][1], K1=consts[1][1], K2=consts[2][1], K3=consts[3][1],
                           L0=consts[0][2], L1=consts[1][2], L2=consts[2][2], L3=consts[3][2],
                           BT=block_t, BE=block_e, SCATTER=scatter, num_warps=4)
    return launch
