"""The KVX bundle: a self-describing, checksummed container of one sequence's KV cache (docs/bundle.md).

    MAGIC "KVXBNDL\\0" | u16 major | u16 minor | u32 header_len | header (canonical JSON) | u64 xxh64(all before)
    CHUNK* : "KVXC" | u32 layer | u64 payload_len | payload | u64 checksum
    TRAILER: "KVXE" | u32 chunks | u64 offset of the trailer | u64 xxh64(chunk checksums, seed=header hash)

A chunk's checksum is xxh64(u32 layer || the xxh64 of each `segment_bytes` segment of the payload, seed=header
hash), each segment hashed with seed=header hash: the segments of one payload hash in parallel (`host`).

Little-endian. One chunk per layer, in layer order; a payload is the layer's tensors in the header's order, each
exactly the size the header gives it. Everything a reader accepts is checked before it is returned: magic,
version, header size and schema (strict JSON, then what it means: `schema`), header hash, the bundle's size against
the bytes present (before anything sized by the header is allocated), chunk tags, layer order, payload sizes, chunk
checksums, each layer's scales and key vectors, chunk count, trailer offset and digest, and end of file right after
the trailer. Any failure is a KvxError naming it. No pickle: the header is JSON, payloads are raw little-endian
tensor bytes.
"""
from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import torch

from ..errors import KvxError, Status, require
from ..jsonsafe import loads_object
from .schema import check_header, check_layer, rejected, short
from .views import StorageViews

MAGIC = b"KVXBNDL\0"
CHUNK_TAG = b"KVXC"
TRAILER_TAG = b"KVXE"
VERSION = (2, 0)
SEGMENT_BYTES = 1 << 23
"""Segment size of chunk checksums that writers use (`checksum.segment_bytes` in the header; readers take any
power of two in [64 KiB, 64 MiB])."""
MAX_HEADER_BYTES = 64 << 20
"""A header larger than this is refused before it is read (the token ids of a 1M-token sequence take ~8 MB)."""
MAX_TOKENS = 1 << 24
"""`tokens.count` above this (16M tokens) is refused by readers and writers."""
MAX_CHUNK_BYTES = 1 << 36
"""A layer's payload above this (64 GiB) is refused by readers and writers. Below it, a reader still allocates
nothing the header sizes before checking it against the bytes present: the stream's size when it can seek (files),
the buffer's length (host bundles); from a pipe, buffers grow with the bytes that actually arrive."""
READ_STEP = 16 << 20
"""From a stream of unknown size, a part larger than this is read into a buffer that grows as bytes arrive."""

DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _hasher(seed: int = 0):
    """An incremental xxh64 (`update(bytes-like)`, `intdigest()`): payloads are hashed in place, never joined."""
    try:
        import xxhash
    except ImportError:
        raise KvxError(Status.UNSUPPORTED, "KVX bundles need the xxhash package: pip install xxhash") from None
    return xxhash.xxh64(seed=seed)


def _xxh64(*parts, seed: int = 0) -> int:
    h = _hasher(seed)
    for p in parts:
        h.update(p)
    return h.intdigest()


def canonical_json(obj) -> bytes:
    """The header's byte form: sorted keys, no spaces, UTF-8 (so its hash is reproducible)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of every chunk: `per_token` tensors are `[tokens, *shape]`, the others `shape`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    per_token: bool

    def nbytes(self, tokens: int) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n * (tokens if self.per_token else 1)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": DTYPE_NAMES[self.dtype], "shape": list(self.shape),
                "per_token": self.per_token}


_bad = rejected


def _uint(v, what: str, limit: int = 2**63) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < limit:
        raise _bad(f"header field {what} must be an integer in [0, {limit}), got {short(v)}")
    return v


def parse_specs(header: dict) -> tuple[int, int, list[TensorSpec], int]:
    """(num_layers, tokens, tensor specs, checksum segment bytes) of a header, checked."""
    try:
        cache, tensors, tokens = header["cache"], header["tensors"], header["tokens"]
        check = header.get("checksum")
        segment = check.get("segment_bytes") if isinstance(check, dict) else None
        if (not isinstance(check, dict) or check.get("algorithm") != "xxh64" or type(segment) is not int
                or not 1 << 16 <= segment <= 1 << 26 or segment & (segment - 1)):
            raise _bad(f"checksum {check!r}: expected xxh64 over power-of-two segments of 64 KiB to 64 MiB")
        layers = _uint(cache["num_layers"], "cache.num_layers", 1 << 16)
        count = _uint(tokens["count"], "tokens.count", MAX_TOKENS + 1)
        specs = []
        for t in tensors:
            if (not isinstance(t, dict) or not isinstance(t["name"], str) or not isinstance(t["dtype"], str)
                    or t["dtype"] not in DTYPES or not isinstance(t["per_token"], bool)
                    or not isinstance(t["shape"], list) or len(t["shape"]) > 8):
                raise _bad(f"tensor entry {short(t)}")
            shape = tuple(_uint(s, f"tensors[{short(t['name'])}].shape", 1 << 20) for s in t["shape"])
            specs.append(TensorSpec(t["name"], DTYPES[t["dtype"]], shape, t["per_token"]))
    except (KeyError, TypeError, AttributeError) as e:
        raise _bad(f"header misses or mistypes a required field ({short(e)})") from None
    require(len({s.name for s in specs}) == len(specs), Status.INVALID_ARGUMENT,
            "KVX bundle rejected: a tensor name repeats in the header")
    payload = sum(s.nbytes(count) for s in specs)
    if payload > MAX_CHUNK_BYTES:
        raise _bad(f"a layer of {payload} bytes exceeds {MAX_CHUNK_BYTES}")
    return layers, count, specs, segment


def chunk_at(first: int, payload: int, layer: int) -> int:
    """Offset of chunk `layer`'s 16-byte head (its payload follows, then its 8-byte checksum) in a bundle whose
    first chunk starts at `first`."""
    return first + layer * (16 + payload + 8)


def bundle_bytes(first: int, payload: int, layers: int) -> int:
    """The size of a bundle of `layers` chunks of `payload` bytes whose first chunk starts at `first`."""
    return chunk_at(first, payload, layers) + 24


def bundle_prefix(header: dict) -> tuple[bytes, int]:
    """(the bundle's bytes up to its first chunk, the header hash that seeds every chunk checksum)."""
    head = canonical_json(header)
    require(len(head) <= MAX_HEADER_BYTES, Status.INVALID_ARGUMENT,
            f"bundle header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    prefix = MAGIC + struct.pack("<HHI", *VERSION, len(head)) + head
    seed = _xxh64(prefix)  # the header hash covers magic, version and length too: every byte is checked
    return prefix + struct.pack("<Q", seed), seed


def chunk_head(layer: int, nbytes: int) -> bytes:
    return CHUNK_TAG + struct.pack("<IQ", layer, nbytes)


def segment_digest(segment, seed: int) -> int:
    """xxh64 of one payload segment (any buffer), seeded with the header hash."""
    return _xxh64(segment, seed=seed)


def combine_segments(layer: int, digests: list[int], seed: int) -> int:
    """A chunk's checksum from its segments' digests in order."""
    return _xxh64(struct.pack(f"<I{len(digests)}Q", layer, *digests), seed=seed)


def segments(nbytes: int, segment: int, start: int = 0) -> list[tuple[int, int]]:
    """[start, stop) byte ranges of a payload's checksum segments, from byte `start` (a segment boundary) on."""
    return [(a, min(a + segment, nbytes)) for a in range(start, nbytes, segment)]


def chunk_checksum(layer: int, payload, seed: int, segment: int) -> int:
    """The checksum of chunk `layer` whose payload is the buffer `payload`, hashed segment by segment here."""
    mv = memoryview(payload).cast("B")
    return combine_segments(layer, [segment_digest(mv[a:b], seed) for a, b in segments(len(mv), segment)], seed)


class ChunkHasher:
    """`chunk_checksum` of a payload given in pieces (`update` with any buffers, then `intdigest`)."""

    def __init__(self, layer: int, seed: int, segment: int):
        self.layer, self.seed, self.segment = layer, seed, segment
        self.digests: list[int] = []
        self.cur, self.fill = _hasher(seed), 0

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            take = min(self.segment - self.fill, len(mv))
            self.cur.update(mv[:take])
            self.fill += take
            mv = mv[take:]
            if self.fill == self.segment:
                self.digests.append(self.cur.intdigest())
                self.cur, self.fill = _hasher(self.seed), 0

    def intdigest(self) -> int:
        tail = [self.cur.intdigest()] if self.fill else []
        return combine_segments(self.layer, self.digests + tail, self.seed)


def trailer(sums: list[int], offset: int, seed: int) -> bytes:
    digest = _xxh64(b"".join(struct.pack("<Q", c) for c in sums), seed=seed)
    return TRAILER_TAG + struct.pack("<IQQ", len(sums), offset, digest)


def check_chunk_head(raw: bytes, layer: int, size: int) -> None:
    """The 16-byte head of chunk `layer`, whose payload must be `size` bytes."""
    tag, idx, n = struct.unpack("<4sIQ", raw)
    if tag != CHUNK_TAG:
        raise _bad(f"chunk {layer}: bad tag (expected a chunk, found {tag!r})")
    if idx != layer:
        raise _bad(f"chunk {layer}: holds layer {idx} (chunks reordered, duplicated or missing)")
    if n != size:
        raise _bad(f"chunk {layer}: payload of {n} bytes, the header gives {size}")


def check_chunk_sum(layer: int, computed: int, raw: bytes) -> int:
    (checksum,) = struct.unpack("<Q", raw)
    if computed != checksum:
        raise _bad(f"chunk {layer}: checksum mismatch (corrupted payload)")
    return checksum


def check_trailer(raw: bytes, num_layers: int, start: int, sums: list[int], seed: int) -> None:
    """The 24-byte trailer found at offset `start` after `num_layers` chunks with checksums `sums`."""
    tag, count, at, digest = struct.unpack("<4sIQQ", raw)
    if tag != TRAILER_TAG:
        raise _bad(f"expected the trailer after {num_layers} chunks, found {tag!r} (extra chunks?)")
    if count != num_layers or at != start:
        raise _bad(f"trailer declares {count} chunks at offset {at}, found {num_layers} at {start}")
    if raw != trailer(sums, start, seed):
        raise _bad("trailer digest mismatch")


def split_payload(payload: torch.Tensor, specs: list[TensorSpec], tokens: int) -> dict[str, torch.Tensor]:
    """A chunk's tensors as views of its uint8 payload (a copy only where a tensor's offset is not aligned)."""
    out, pos = {}, 0
    for s in specs:
        n = s.nbytes(tokens)
        shape = (tokens, *s.shape) if s.per_token else s.shape
        raw = payload[pos:pos + n]
        aligned = raw.storage_offset() % s.dtype.itemsize == 0
        out[s.name] = (raw if aligned else raw.clone()).view(s.dtype).reshape(shape)
        pos += n
    return out


def split_chunks(buf: torch.Tensor, start: int, step: int, count: int, specs: list[TensorSpec], tokens: int
                 ) -> list[dict[str, torch.Tensor]]:
    """`split_payload` of the `count` chunk payloads of a contiguous 1-D uint8 `buf` at byte offsets `start + i *
    step`, one strided view per tensor (`StorageViews`). A tensor whose offset is not aligned to its dtype in some
    chunk is copied for every chunk at once (one strided copy per tensor name, not per layer), as `split_payload`
    copies it."""
    views, out, pos = StorageViews(buf), [{} for _ in range(count)], start
    for s in specs:
        n, shape = s.nbytes(tokens), ((tokens, *s.shape) if s.per_token else s.shape)
        at, src = [pos + i * step for i in range(count)], views
        if any((buf.storage_offset() + a) % s.dtype.itemsize for a in at):
            packed = buf.as_strided((count, n), (step, 1), buf.storage_offset() + pos).clone()
            at, src = [i * n for i in range(count)], StorageViews(packed.view(-1))
        for layer, t in zip(out, src.views(at, s.dtype, shape), strict=True):
            layer[s.name] = t
        pos += n
    return out


class BundleWriter:
    """Streams a bundle: the header, then `add_layer` once per layer in order, then `close` (the trailer)."""

    def __init__(self, out: BinaryIO, header: dict):
        self.out = out
        self.num_layers, self.tokens, self.specs, self.segment = parse_specs(header)
        prefix, self.seed = bundle_prefix(header)
        self.sums: list[int] = []
        self.offset = 0
        self._put(prefix)

    def _put(self, b) -> None:
        self.out.write(b)
        self.offset += b.nbytes if isinstance(b, memoryview) else len(b)

    def add_layer(self, tensors: dict[str, torch.Tensor]) -> None:
        """The next layer's tensors (each as its spec says; any device, copied to the host)."""
        layer = len(self.sums)
        require(layer < self.num_layers, Status.INVALID_ARGUMENT, f"bundle declares {self.num_layers} layers")
        parts = []
        for s in self.specs:
            t = tensors.get(s.name)
            want = (self.tokens, *s.shape) if s.per_token else s.shape
            require(isinstance(t, torch.Tensor) and t.dtype == s.dtype and tuple(t.shape) == tuple(want),
                    Status.INVALID_ARGUMENT, f"layer {layer} tensor {s.name} must be {s.dtype} {tuple(want)}")
            parts.append(memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()))
        h = ChunkHasher(layer, self.seed, self.segment)
        self._put(chunk_head(layer, sum(p.nbytes for p in parts)))
        for p in parts:  # streamed: each tensor's bytes go out as they are, no joined copy
            h.update(p)
            self._put(p)
        checksum = h.intdigest()
        self._put(struct.pack("<Q", checksum))
        self.sums.append(checksum)

    def close(self) -> None:
        require(len(self.sums) == self.num_layers, Status.INVALID_ARGUMENT,
                f"bundle has {len(self.sums)} of its {self.num_layers} layers")
        self._put(trailer(self.sums, self.offset, self.seed))


def _stream_left(src) -> int | None:
    """The bytes from a seekable stream's position to its end; None for pipes, sockets and other streams."""
    try:
        if not src.seekable():
            return None
        here = src.tell()
        end = src.seek(0, io.SEEK_END)
        src.seek(here)
    except (AttributeError, OSError, ValueError):
        return None
    return end - here


class BundleReader:
    """Reads and checks a bundle from a binary stream: `header` at once, `layers()` one verified chunk at a time
    (the trailer is checked after the last; the stream must end there). `size`: the bytes the stream holds from
    here, when the caller knows (a buffer's length); else a seekable stream's own, else unknown (pipes)."""

    def __init__(self, src: BinaryIO, size: int | None = None):
        if not hasattr(src, "readinto") and not hasattr(src, "read"):
            raise KvxError(Status.INVALID_ARGUMENT, f"a KVX bundle is read from a binary stream (a file opened 'rb', "
                                                    f"io.BytesIO), got {type(src).__name__}")
        self.src = src
        self.offset = 0
        self.left = _stream_left(src) if size is None else size
        head = self._take(16, "the fixed header")
        if head[:8] != MAGIC:
            raise _bad("not a KVX bundle (bad magic)")
        major, minor, n = struct.unpack("<HHI", head[8:])
        if major != VERSION[0]:
            raise KvxError(Status.UNSUPPORTED, f"KVX bundle version {major}.{minor}: this reader reads {VERSION[0]}.x")
        if n > MAX_HEADER_BYTES:
            raise _bad(f"header length {n} exceeds {MAX_HEADER_BYTES}")
        raw = self._take(n, "the header")
        (seed,) = struct.unpack("<Q", self._take(8, "the header hash"))
        if _xxh64(head + raw) != seed:
            raise _bad("header checksum mismatch (corrupted header)")
        self.header = loads_object(raw, "KVX bundle rejected: the header")
        if canonical_json(self.header) != raw:
            raise _bad("header is not canonical JSON (keys sorted, no spaces)")
        self.version = (major, minor)
        self.seed = seed
        self.num_layers, self.tokens, self.specs, self.segment = parse_specs(self.header)
        self.format = check_header(self.header, self.specs)
        self.payload = sum(s.nbytes(self.tokens) for s in self.specs)
        self.total = bundle_bytes(self.offset, self.payload, self.num_layers)
        if self.left is not None and self.left != self.total:
            raise _bad(f"its header declares {self.total} bytes, the input holds {self.left} "
                       f"({'truncated' if self.left < self.total else 'larger than declared'})")

    def _take(self, n: int, what: str) -> bytes:
        return bytes(self._take_into(n, what))

    def _take_into(self, n: int, what: str) -> bytearray:
        """Exactly `n` bytes read into a new buffer (the chunk's tensors become views of it), over as many reads as
        the stream needs (pipes and sockets return short reads); fewer before end of stream is a truncation. The
        buffer is allocated whole only where the input is known to hold the bytes; else it grows as they arrive."""
        if self.left is not None and self.offset + n > self.left:
            raise _bad(f"truncated in {what} (offset {self.offset}: {n} bytes needed, {self.left - self.offset} "
                       f"left)")
        buf = bytearray(n if self.left is not None else min(n, READ_STEP))
        got = 0
        while got < n:
            if got == len(buf):  # unknown size: double the buffer, as far as the bytes that came
                buf.extend(bytes(min(n - got, len(buf))))
            with memoryview(buf) as view:
                if hasattr(self.src, "readinto"):
                    k = self.src.readinto(view[got:])
                else:
                    data = self.src.read(len(buf) - got)
                    k = len(data)
                    view[got:got + k] = data
            if not k:
                raise _bad(f"truncated in {what} (offset {self.offset + got})")
            got += k
        self.offset += n
        return buf

    def layers(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each layer's tensors (host memory), checked, in order; then the trailer and end of stream."""
        size = self.payload
        sums = []
        for layer in range(self.num_layers):
            check_chunk_head(self._take(16, f"chunk {layer}"), layer, size)
            payload = self._take_into(size, f"chunk {layer}'s payload")
            sums.append(check_chunk_sum(layer, chunk_checksum(layer, payload, self.seed, self.segment),
                                        self._take(8, f"chunk {layer}'s checksum")))
            tensors = split_payload(torch.frombuffer(payload, dtype=torch.uint8) if payload else
                                    torch.empty(0, dtype=torch.uint8), self.specs, self.tokens)
            check_layer(layer, tensors, self.format)
            yield tensors
        start = self.offset
        check_trailer(self._take(24, "the trailer"), self.num_layers, start, sums, self.seed)
        if self.src.read(1):
            raise _bad(f"bytes after the trailer (the bundle is larger than declared: {start + 24} bytes)")

    def read_all(self, device: torch.device | str | None = None) -> list[dict[str, torch.Tensor]]:
        """Every layer (moved to `device` when given), after the whole bundle (trailer and end included) checked."""
        layers = list(self.layers())
        return layers if device is None else [{k: v.to(device) for k, v in t.items()} for t in layers]
