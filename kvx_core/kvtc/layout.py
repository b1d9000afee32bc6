"""Where each coded range of a KVTC body lies, and the coding of all ranges of a sequence in one pass.

The projections of every group and side sit side by side in one float32 matrix `Y [rows, columns]` (group-major,
K then V, each side's `kept` components; a dropped range's columns stay 0). A body's coded part is, per group, K then
V, per kept range: the 40-byte range header, the IntX metadata (fp16 min then fp16 step per component) and the packed
rows. `body_layout` computes those offsets from the calibration and the row count alone, so the encoder writes every
range straight into the body and the decoder reads them from it: with `backend="triton"` one kernel launch codes all
ranges (`kvx_core.ops.triton.kvtc`, the GPU codec), with `"torch"` the reference (`quant.pack_range` per range) does;
both give the same bytes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from ..errors import KvxError, Status, require
from .calibration import SIDES, Calibration
from .quant import RangeKind, column_meta, meta_bytes, pack_range, range_bytes, unpack_range

RANGE = struct.Struct("<iiQQQQ")
BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Section:
    """One kept range of one group side: its components `[lo, hi)`, its first column in `Y` and its body offsets."""

    kind: RangeKind
    lo: int
    hi: int
    column: int
    header_at: int
    meta_at: int
    data_at: int
    row_bytes: int

    @property
    def n(self) -> int:
        return self.hi - self.lo

    def header(self, rows: int) -> bytes:
        """The 40-byte range header: `(quant_type (0 FP8, 1 IntX), int_bits, start, end, data bytes, meta bytes)`."""
        qt, bits = (1, self.kind.bits) if self.kind.is_int else (0, 0)
        return RANGE.pack(qt, bits, self.lo, self.hi, self.row_bytes * rows, meta_bytes(self.kind, self.n))


@dataclass(frozen=True)
class BodyLayout:
    rows: int
    columns: int  # of Y
    side_columns: tuple[tuple[int, int], ...]  # per (group, side), group-major: (first column, kept)
    sections: tuple[Section, ...]
    end: int  # body bytes

    def table(self, device) -> torch.Tensor:
        """The kernels' per-section table `[R, 8]` int64: column, n, bits, is_fp8, header, meta, data, row bytes."""
        rows = [(s.column, s.n, s.kind.bits, int(not s.kind.is_int), s.header_at, s.meta_at, s.data_at, s.row_bytes)
                for s in self.sections]
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, 8).to(device)

    @property
    def widest(self) -> tuple[int, int]:
        """The largest (row bytes, components) of a section: the kernels' tile sizes."""
        return max((s.row_bytes for s in self.sections), default=0), max((s.n for s in self.sections), default=0)

    def headers(self) -> bytes:
        return b"".join(s.header(self.rows) for s in self.sections)


def body_layout(cal: Calibration, rows: int, start: int) -> BodyLayout:
    """The coded sections of `rows` tokens, the first at body offset `start` (after the token ids and raw tokens);
    none when every token is raw."""
    if rows == 0:
        return BodyLayout(0, 0, (), (), start)
    at, col, side_columns, sections = start, 0, [], []
    for gc in cal.groups:
        for s in SIDES:
            c = gc[s]
            side_columns.append((col, c.kept))
            for lo, hi, name in c.ranges:
                kind = RangeKind.parse(name)
                rb, mb = range_bytes(kind, hi - lo), meta_bytes(kind, hi - lo)
                sections.append(Section(kind, lo, hi, col + lo, at, at + RANGE.size, at + RANGE.size + mb, rb))
                at += RANGE.size + mb + rb * rows
            col += c.kept
    return BodyLayout(rows, col, tuple(side_columns), tuple(sections), at)


def column_params(cal: Calibration, layout: BodyLayout, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per column of `Y`: IntX levels (1 where not IntX), is-IntX, FP8 scale (1 where not FP8). Built once per
    calibration (the column order does not depend on the row count) and kept on the host."""
    key = cal.identity
    if key not in _COLUMN_CACHE:
        levels, is_int, scale = [1.0] * layout.columns, [False] * layout.columns, torch.ones(layout.columns)
        sides = [gc[s] for gc in cal.groups for s in SIDES]
        for (col, _), c in zip(layout.side_columns, sides, strict=True):
            for lo, hi, name in c.ranges:
                kind = RangeKind.parse(name)
                if kind.is_int:
                    levels[col + lo:col + hi] = [float((1 << kind.bits) - 1)] * (hi - lo)
                    is_int[col + lo:col + hi] = [True] * (hi - lo)
                else:
                    scale[col + lo:col + hi] = c.fp8_scale[lo:hi].float()
        while len(_COLUMN_CACHE) >= 8:
            _COLUMN_CACHE.pop(next(iter(_COLUMN_CACHE)))
        _COLUMN_CACHE[key] = (torch.tensor(levels), torch.tensor(is_int), scale)
    return tuple(t.to(device) for t in _COLUMN_CACHE[key])


_COLUMN_CACHE: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    require(backend in BACKENDS, Status.INVALID_ARGUMENT, f"KVTC backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def encode_sections(y: torch.Tensor, cal: Calibration, layout: BodyLayout, body: torch.Tensor, *,
                    backend: str | None = None) -> None:
    """Code `y [rows, columns]` (float32, finite) into the sections of `body` (uint8 on y's device). KvxError
    (OUT_OF_RANGE) before anything is written when an IntX component exceeds fp16."""
    require(tuple(y.shape) == (layout.rows, layout.columns) and y.dtype == torch.float32 and y.is_contiguous(),
            Status.INVALID_ARGUMENT, f"KVTC: projections must be contiguous float32 {(layout.rows, layout.columns)}")
    require(body.dtype == torch.uint8 and body.numel() >= layout.end and body.device == y.device,
            Status.INVALID_ARGUMENT, "KVTC: the body buffer is too small or on another device")
    levels, is_int, scale = column_params(cal, layout, y.device)
    mn, step = column_meta(y, levels, is_int)
    if _backend(backend, y.device) == "triton":
        from ..ops.triton.kvtc import pack_sections
        hdr = torch.frombuffer(bytearray(layout.headers()), dtype=torch.uint8).to(y.device)
        pack_sections(y, mn, step, scale, layout.table(y.device), hdr, body, layout.widest)
        return
    for s in layout.sections:
        body[s.header_at:s.meta_at] = torch.frombuffer(bytearray(s.header(layout.rows)), dtype=torch.uint8)
        cols = slice(s.column, s.column + s.n)
        if s.kind.is_int:
            body[s.meta_at:s.data_at] = torch.cat([mn[cols], step[cols]]).view(torch.uint8)
        packed = pack_range(y[:, cols], s.kind, mn[cols], step[cols], scale[cols])
        body[s.data_at:s.data_at + packed.numel()] = packed.reshape(-1)


def check_headers(body: bytes, layout: BodyLayout) -> None:
    """Every range header of a received body must be the one its calibration implies (KvxError otherwise)."""
    require(len(body) >= layout.end, Status.INVALID_ARGUMENT, "KVTC: body ends inside a section")
    require(len(body) == layout.end, Status.INVALID_ARGUMENT, "KVTC: bytes left after the last section")
    for s in layout.sections:
        got = body[s.header_at:s.meta_at]
        if got != s.header(layout.rows):
            qt, bits, lo, hi, _, _ = RANGE.unpack(got)
            raise KvxError(Status.INVALID_ARGUMENT, f"KVTC: range header ({lo}, {hi}, type {qt}, bits {bits}) "
                           f"disagrees with the calibration's ({s.lo}, {s.hi}, {s.kind})")


def decode_sections(body: torch.Tensor, cal: Calibration, layout: BodyLayout, *,
                    backend: str | None = None) -> torch.Tensor:
    """The sections of `body` (uint8 on the target device, headers checked) -> `Y [rows, columns]` float32."""
    y = torch.zeros(layout.rows, layout.columns, dtype=torch.float32, device=body.device)
    _, _, scale = column_params(cal, layout, body.device)
    if _backend(backend, body.device) == "triton":
        from ..ops.triton.kvtc import unpack_sections
        unpack_sections(body, scale, layout.table(body.device), y, layout.widest)
        return y
    for s in layout.sections:
        cols = slice(s.column, s.column + s.n)
        mn = step = None
        if s.kind.is_int:  # a section may start at an odd offset: copy before viewing as fp16
            mn, step = body[s.meta_at:s.data_at].clone().view(torch.float16).view(2, s.n)
        data = body[s.data_at:s.data_at + s.row_bytes * layout.rows].view(layout.rows, s.row_bytes)
        y[:, cols] = unpack_range(data, s.kind, s.n, mn, step, scale[cols])
    return y
