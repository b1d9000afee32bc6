"""xxh64 of many equal segments of a device buffer, one Triton program per segment: bundle checksums on the GPU.

A bundle chunk's checksum combines the xxh64 digests of its `checksum.segment_bytes` segments (`bundle.py`), so
with small segments (64 KiB) the digests are thousands of independent hashes that the GPU computes while the data
is still in device memory; the host then only combines 8-byte digests. Each program runs xxh64's four lanes over
its segment's 32-byte stripes (the segment length is a multiple of 32 here: the caller hashes a shorter tail
segment on the host) and finishes with xxh64's merge and avalanche; one launch hashes every chunk of a bundle
staged in one buffer. Reference: the `xxhash` package
(`tests/transfer/test_gpu_hash.py`, run under TRITON_INTERPRET=1 on CPU and compiled on the GPU machine).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import Status, require
from ..ops.triton.launch import on_device

P1 = tl.constexpr(11400714785074694791)
P2 = tl.constexpr(14029467366897019727)
P3 = tl.constexpr(1609587929392839161)
P4 = tl.constexpr(9650029242287828579)


@triton.jit
def _rotl(x, r: tl.constexpr):
    return (x << r) | (x >> (64 - r))


@triton.jit
def _round(acc, lane, p1, p2):
    return _rotl(acc + lane * p2, 31) * p1


# The seed differs per bundle, so it is not specialized (seed % 16 == 0 would compile another variant inside a
# request: a 280 ms compile in a P/D handoff on the H200, bench_pd --profile-phases) and comes as its two 32-bit
# halves in int32 bits (`_i32`): Triton types an int argument by its value (int32, int64 or uint64), each a variant.
@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _xxh64_segments(buf, out, seed_lo, seed_hi, row_words, SEG_WORDS: tl.constexpr):
    """out[r, s] = xxh64 (seeded) of the s-th segment of SEG_WORDS 8-byte words (a multiple of 4: whole stripes) of
    the chunk starting at word r * row_words."""
    s = tl.program_id(0)
    p1 = tl.full([4], P1, tl.uint64)
    p2 = tl.full([4], P2, tl.uint64)
    lane = tl.arange(0, 4)
    seed = (seed_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | seed_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    sd = tl.full([4], 0, tl.uint64) + seed
    init = tl.where(lane == 0, sd + p1 + p2, tl.where(lane == 1, sd + p2, tl.where(lane == 2, sd, sd - p1)))
    acc = init
    base = buf + tl.program_id(1).to(tl.int64) * row_words + s.to(tl.int64) * SEG_WORDS
    for i in tl.range(0, SEG_WORDS // 4, num_stages=4):
        acc = _round(acc, tl.load(base + i * 4 + lane).to(tl.uint64, bitcast=True), p1, p2)
    rot = tl.where(lane == 0, _rotl(acc, 1), tl.where(lane == 1, _rotl(acc, 7),
                                                       tl.where(lane == 2, _rotl(acc, 12), _rotl(acc, 18))))
    h = tl.sum(rot, axis=0)
    q1 = tl.full([], P1, tl.uint64)
    q4 = tl.full([], P4, tl.uint64)
    zero = tl.full([4], 0, tl.uint64)
    merged = _round(zero, acc, p1, p2)
    for j in tl.static_range(4):
        h = (h ^ tl.sum(tl.where(lane == j, merged, zero), axis=0)) * q1 + q4
    h = h + tl.full([], SEG_WORDS * 8, tl.uint64)
    h = h ^ (h >> 33)
    h = h * tl.full([], P2, tl.uint64)
    h = h ^ (h >> 29)
    h = h * tl.full([], P3, tl.uint64)
    h = h ^ (h >> 32)
    tl.store(out + tl.program_id(1).to(tl.int64) * tl.num_programs(0) + s, h.to(tl.int64, bitcast=True))


def _i32(x: int) -> int:
    """The low 32 bits of `x` as a signed int32 value (what Triton always types int32)."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def segment_digests(buf: torch.Tensor, segment: int, seed: int) -> torch.Tensor:
    """`[len(buf) // segment]` xxh64 digests (seeded; int64 holding the uint64 bits) of the whole segments of a
    uint8 device buffer; `segment` a multiple of 32. The tail after the last whole segment is the caller's."""
    return chunk_digests(buf, 1, 0, None, segment, seed)[0]


def chunk_digests(buf: torch.Tensor, count: int, stride: int, size: int | None, segment: int, seed: int
                  ) -> torch.Tensor:
    """`[count, size // segment]` digests as `segment_digests` gives them, of the `count` chunks of `size` bytes
    (None: the whole buffer) at byte offsets `0, stride, 2 * stride, ...` of `buf` (`stride` a multiple of 8):
    every layer of a bundle staged in one device buffer in ONE launch. Launched per layer, each launch is a few
    programs, each hashing its 64 KiB serially, and the launches queue one after another on the stream: a fixed
    time per layer whatever its bytes."""
    require(isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
            and buf.data_ptr() % 8 == 0, Status.INVALID_ARGUMENT,
            "segment_digests: a contiguous, 8-byte aligned 1-D uint8 buffer")
    require(segment >= 32 and segment % 32 == 0, Status.INVALID_ARGUMENT, "segment must be a multiple of 32 bytes")
    size = buf.numel() if size is None else size
    require(type(count) is int and type(stride) is int and type(size) is int and count >= 0 and size >= 0
            and stride >= 0 and stride % 8 == 0 and (count <= 1 or stride >= size)
            and (count == 0 or (count - 1) * stride + size <= buf.numel()), Status.INVALID_ARGUMENT,
            f"chunk_digests: {count} chunks of {size} bytes every {stride} bytes (a multiple of 8) do not fit a "
            f"buffer of {buf.numel()} bytes")
    n = size // segment
    out = torch.empty(count, n, dtype=torch.int64, device=buf.device)
    if n and count:
        words = buf[:buf.numel() // 8 * 8].view(torch.int64)
        with on_device(buf.device):
            _xxh64_segments[(n, count)](words, out, _i32(seed), _i32(seed >> 32), stride // 8,
                                        SEG_WORDS=segment // 8, num_warps=1)
    return out

