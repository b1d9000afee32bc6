"""KVTC codec: one sequence's K/V (every layer) <-> a self-describing compressed buffer.

Tokens at absolute positions below the calibration's `sink_tokens` and the last `recent_tokens` of the range are
stored raw (attention sinks and the window the next steps attend most, as the paper keeps them); the others are
projected per layer group onto the calibrated PCA basis (mean subtracted) and quantized range by range
(`quant.py`). Decompression inverts it: dequantize, project back, add the mean. Torch ops only: the same code runs
on the CPU (CI) and on a GPU (matmuls on the device).

Buffer (little-endian): a fixed header (`HEADER`: magic `KVTC`, version, flags (bit 0: the body is DEFLATE
compressed; bit 1: the body starts with the tokens' ids, u32 each), the calibration identity (sha256), the model
fingerprint hash (sha256, zeros when none), geometry, token range, raw head / tail token counts, raw dtype, body sizes),
the body, and a 16-byte checksum of header and body. The body: the raw head tokens, then the raw tail tokens (per layer,
K then V, `[tokens, H, D]` in the raw dtype), then per group, K then V, per kept range a 40-byte range header (`i32
quant_type (0 FP8, 1 IntX), i32 int_bits, u64 start, u64 end, u64 packed_data_bytes, u64 metadata_bytes`), the range's
metadata (IntX: fp16 min and step per component) and packed data (rows in token order).

A buffer is untrusted even with a valid checksum (anyone can recompute one): `read_header` checks every header
field's range and the declared sizes against the bytes present and `MAX_BODY_BYTES`, `open_body` checks them against
the calibration's geometry before inflating a DEFLATE body (bounded by the declared size), and `decode_body` refuses
a buffer that decodes to non-finite K/V (what `compress` never writes).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, is_dataclass
from typing import BinaryIO, NamedTuple

import torch

from ..errors import KvxError, Status, require
from .calibration import MAX_POSITION, SIDES, Calibration, group_features
from .layout import body_layout, check_headers, decode_sections, encode_sections
from .rope import rotate

MAGIC = b"KVTC"
VERSION = 2
"""Version 2: the checksum is XXH3-128 (~20x faster than version 1's BLAKE2b-128, which capped the codec near 1.4 GB/s
of compressed bytes); version 1 buffers are still read."""
FLAG_DEFLATE = 1
FLAG_TOKEN_IDS = 2
HEADER = struct.Struct("<4sHH32s32sIIIIQQIIB3xQQ")
CHECKSUM_BYTES = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BODY_BYTES = 1 << 36
"""The largest body (stored or inflated) and the most K/V bytes one buffer may decode to, 64 GiB: a 128k-token
sequence of a 70B-class model (80 layers x 8 KV heads x 128) is ~40 GiB of BF16 K/V. Larger declared sizes are
refused before anything is allocated."""
_READ_CHUNK = 1 << 24


def model_hash(model) -> bytes:
    """sha256 of a model fingerprint (a ModelFingerprint or its dict) as canonical JSON; zeros for none."""
    if not model:
        return bytes(32)
    d = asdict(model) if is_dataclass(model) else dict(model)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).digest()


@dataclass(frozen=True)
class KvtcHeader:
    flags: int
    calibration: str
    model: bytes
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layers_per_group: int
    token_start: int
    token_count: int
    raw_head: int
    raw_tail: int
    dtype: torch.dtype
    body_bytes: int
    raw_body_bytes: int

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["model"], d["dtype"] = self.model.hex(), str(self.dtype).removeprefix("torch.")
        d["deflate"] = bool(self.flags & FLAG_DEFLATE)
        d["token_ids"] = bool(self.flags & FLAG_TOKEN_IDS)
        return d


def _checksum_state(version: int):
    """A hash object (`update`, `digest`) of the 16-byte checksum: XXH3-128 (canonical, big-endian) from version 2,
    BLAKE2b-128 in version 1."""
    if version == 1:
        return hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    try:
        import xxhash
    except ImportError:
        raise KvxError(Status.UNSUPPORTED, "KVTC buffers need the xxhash package: pip install 'kvx[kvtc]'") from None
    return xxhash.xxh3_128()


def _checksum(version: int, *parts) -> bytes:
    """The checksum of `parts` (bytes-like, hashed in place)."""
    h = _checksum_state(version)
    for p in parts:
        h.update(p)
    return h.digest()


def split_raw(n: int, start: int, cal: Calibration) -> tuple[int, int]:
    """(raw head, raw tail) token counts of `n` tokens starting at absolute position `start`."""
    head = min(max(cal.sink_tokens - start, 0), n)
    tail = min(cal.recent_tokens, n - head)
    return head, tail


def _write_raw(body: torch.Tensor, at: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], a: int, b: int) -> int:
    """Tokens `[a, b)` of every layer's K then V, raw, into `body` from byte `at`; returns the next offset."""
    for pair in kv:
        for x in pair:
            raw = x[a:b].contiguous().view(torch.uint8).reshape(-1)
            body[at:at + raw.numel()] = raw
            at += raw.numel()
    return at


def _project(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], cal: Calibration, a: int, b: int, token_start: int,
             columns: int) -> torch.Tensor:
    """Tokens `[a, b)` (keys with RoPE removed when calibrated so) projected onto every group's and side's kept
    components: `Y [b - a, columns]` float32, the layout's column order."""
    keys = [x[a:b] for x, _ in kv]
    if cal.rope_theta:
        pos = torch.arange(token_start + a, token_start + b, device=kv[0][0].device)
        keys = [rotate(x, pos, cal.rope_theta, inverse=True) for x in keys]
    sides = [keys, [v[a:b] for _, v in kv]]
    y = torch.empty(b - a, columns, dtype=torch.float32, device=kv[0][0].device)
    col = 0
    for g, gc in enumerate(cal.groups):
        for s, rows in zip(SIDES, sides, strict=True):
            c = gc[s]
            x = group_features(rows, g, cal.layers_per_group).float()
            y[:, col:col + c.kept] = (x - c.mean.to(x.device)) @ c.basis[:, :c.kept].to(x.device)
            col += c.kept
    return y


def _to_host(body: torch.Tensor) -> torch.Tensor:
    """A device body copied into pinned host memory (torch's caching host allocator reuses it across calls: a
    pageable copy into fresh memory ran at ~1.3 GB/s on an H100 host, page faults included)."""
    if body.device.type != "cuda":
        return body
    host = torch.empty(body.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(body)
    return host


def encode_body(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], cal: Calibration, token_start: int, ids: bytes,
                head: int, tail: int) -> torch.Tensor:
    """The device half of `compress` (inputs checked): the body as a uint8 tensor on the K/V's device (token ids, raw
    head and tail tokens, coded sections). `compress` adds the header and checksum on the host."""
    n, h, d = kv[0][0].shape
    a, b = head, n - tail
    layout = body_layout(cal, b - a, len(ids) + (head + tail) * 2 * cal.num_layers * h * d * kv[0][0].element_size())
    body = torch.empty(layout.end, dtype=torch.uint8, device=kv[0][0].device)
    if ids:
        body[:len(ids)] = torch.frombuffer(bytearray(ids), dtype=torch.uint8)
    _write_raw(body, _write_raw(body, len(ids), kv, 0, head), kv, b, n)
    if b > a:
        encode_sections(_project(kv, cal, a, b, token_start, layout.columns), cal, layout, body)
    return body


def decode_body(body: torch.Tensor, cal: Calibration, layout,
                hdr: KvtcHeader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The device half of `decompress` (header and range headers checked): a body on the target device -> K/V per
    layer `[token_count, H, D]` in the header's dtype on that device. KvxError when they are not all finite (forged
    IntX metadata, FP8 NaN codes or raw tokens, or a sum that overflows the dtype)."""
    dev = body.device
    n, h, d = hdr.token_count, hdr.num_kv_heads, hdr.head_dim
    a, b = hdr.raw_head, n - hdr.raw_tail
    out = [[torch.empty(n, h, d, dtype=hdr.dtype, device=dev) for _ in range(2)] for _ in range(hdr.num_layers)]
    at = 4 * n if hdr.flags & FLAG_TOKEN_IDS else 0
    for lo_tok, hi_tok in ((0, a), (b, n)):
        for pair in out:
            for x in pair:
                dst = x[lo_tok:hi_tok].view(torch.uint8).view(-1)
                dst.copy_(body[at:at + dst.numel()])
                at += dst.numel()
    if b > a:
        y = decode_sections(body, cal, layout)
        for k, (col, kept) in enumerate(layout.side_columns):
            g, i = divmod(k, len(SIDES))
            c = cal.groups[g][SIDES[i]]
            x = y[:, col:col + kept] @ c.basis[:, :kept].to(dev).T + c.mean.to(dev)
            per_layer = x.view(b - a, cal.layers_per_group, h, d)
            for j in range(cal.layers_per_group):
                rows = per_layer[:, j]
                if i == 0 and cal.rope_theta:
                    rows = rotate(rows, torch.arange(hdr.token_start + a, hdr.token_start + b, device=dev),
                                  cal.rope_theta)
                out[g * cal.layers_per_group + j][i][a:b] = rows.to(hdr.dtype)
    finite = torch.stack([torch.isfinite(x).all() for pair in out for x in pair]).cpu()  # one device sync
    if not bool(finite.all()):
        raise KvxError(Status.INVALID_ARGUMENT, f"KVTC: the buffer decodes to non-finite K/V in layer "
                       f"{int((~finite).nonzero()[0]) // 2} (compress writes finite values only: forged or damaged)")
    return [(k, v) for k, v in out]


def compress(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], cal: Calibration, *, model=None, token_start: int = 0,
             deflate: bool = False, token_ids: Sequence[int] | None = None) -> bytes:
    """One sequence's tokens `[token_start, token_start + n)`: `kv[layer] = (K, V)`, each `[n, H, D]` bf16 / fp16 /
    fp32 on any device (and optionally their token ids, carried along) -> the compressed buffer. KvxError for a
    geometry other than the calibration's or non-finite values (nothing is clamped silently)."""
    require(len(kv) == cal.num_layers, Status.INVALID_ARGUMENT,
            f"KVTC: {len(kv)} layers given, the calibration has {cal.num_layers}")
    n, h, d = kv[0][0].shape
    dtype = kv[0][0].dtype
    require(dtype in _DTYPES and (h, d) == (cal.num_kv_heads, cal.head_dim), Status.INVALID_ARGUMENT,
            f"KVTC: K/V must be [tokens, {cal.num_kv_heads}, {cal.head_dim}] bf16/fp16/fp32, got "
            f"{tuple(kv[0][0].shape)} {dtype}")
    for layer, pair in enumerate(kv):
        for x in pair:
            require(tuple(x.shape) == (n, h, d) and x.dtype == dtype and x.device == kv[0][0].device,
                    Status.INVALID_ARGUMENT, f"KVTC: layer {layer} K/V is {tuple(x.shape)} {x.dtype} on {x.device}, "
                    f"expected {(n, h, d)} {dtype} on {kv[0][0].device}")
    finite = torch.stack([torch.isfinite(x).all() for pair in kv for x in pair]).cpu()  # one device sync
    if not bool(finite.all()):
        raise KvxError(Status.INVALID_ARGUMENT, f"KVTC: layer {int((~finite).nonzero()[0]) // 2} holds non-finite "
                       "K/V values; KVTC codes finite values only")
    require(0 <= token_start and token_start + n <= MAX_POSITION, Status.INVALID_ARGUMENT,
            f"KVTC: token positions must lie in [0, 2^53), got [{token_start}, {token_start + n})")
    ids = b""
    if token_ids is not None:
        require(len(token_ids) == n and all(0 <= int(t) < 2**32 for t in token_ids), Status.INVALID_ARGUMENT,
                f"KVTC: {len(token_ids)} token ids for {n} tokens (u32 each)")
        ids = struct.pack(f"<{n}I", *(int(t) for t in token_ids))
    head, tail = split_raw(n, token_start, cal)
    body = encode_body(kv, cal, token_start, ids, head, tail)
    raw_body = memoryview(_to_host(body).numpy())  # one device -> host copy; hashed and joined in place
    stored = zlib.compress(raw_body, 6) if deflate else raw_body
    flags = (FLAG_DEFLATE if deflate else 0) | (FLAG_TOKEN_IDS if token_ids is not None else 0)
    header = HEADER.pack(MAGIC, VERSION, flags, bytes.fromhex(cal.identity),
                         model_hash(model), cal.num_layers, h, d, cal.layers_per_group, token_start, n, head, tail,
                         _DTYPES.index(dtype), len(stored), len(raw_body))
    return b"".join([header, stored, _checksum(VERSION, header, stored)])


def _parse_header(head) -> tuple[int, KvtcHeader]:
    """(version, header) of a buffer's first `HEADER.size` bytes, every field's range checked: magic, version,
    flags, dtype, a non-empty geometry whose groups divide the layers, token positions below `MAX_POSITION`, raw
    counts within the tokens, body sizes within `MAX_BODY_BYTES` and large enough for the token ids and raw tokens."""
    require(len(head) >= HEADER.size and head[:4] == MAGIC, Status.INVALID_ARGUMENT,
            "KVTC: not a KVTC buffer (bad magic or shorter than a header)")
    f = HEADER.unpack_from(head)
    require(f[1] in (1, VERSION), Status.INCOMPATIBLE,
            f"KVTC: buffer version {f[1]}, this KVX reads versions 1 and {VERSION}")
    require(f[13] < len(_DTYPES) and f[2] & ~(FLAG_DEFLATE | FLAG_TOKEN_IDS) == 0, Status.INVALID_ARGUMENT,
            "KVTC: unknown dtype or flags in the header")
    hdr = KvtcHeader(f[2], f[3].hex(), f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11], f[12], _DTYPES[f[13]],
                     f[14], f[15])
    require(min(hdr.num_layers, hdr.num_kv_heads, hdr.head_dim, hdr.layers_per_group) >= 1
            and hdr.num_layers % hdr.layers_per_group == 0, Status.INVALID_ARGUMENT,
            f"KVTC: header geometry {hdr.num_layers} layers (groups of {hdr.layers_per_group}) x {hdr.num_kv_heads} "
            f"KV heads x {hdr.head_dim} is not a model's")
    require(hdr.token_start + hdr.token_count <= MAX_POSITION, Status.INVALID_ARGUMENT,
            f"KVTC: header token range [{hdr.token_start}, +{hdr.token_count}) passes position 2^53")
    require(hdr.raw_head + hdr.raw_tail <= hdr.token_count, Status.INVALID_ARGUMENT,
            f"KVTC: header declares {hdr.raw_head} + {hdr.raw_tail} raw tokens of {hdr.token_count}")
    require(max(hdr.body_bytes, hdr.raw_body_bytes) <= MAX_BODY_BYTES, Status.INVALID_ARGUMENT,
            f"KVTC: header declares a body of {max(hdr.body_bytes, hdr.raw_body_bytes)} bytes, more than the "
            f"{MAX_BODY_BYTES} a buffer may hold")
    require(hdr.flags & FLAG_DEFLATE or hdr.body_bytes == hdr.raw_body_bytes, Status.INVALID_ARGUMENT,
            "KVTC: header sizes of a body stored without DEFLATE disagree")
    require(_raw_bytes(hdr) <= hdr.raw_body_bytes, Status.INVALID_ARGUMENT,
            f"KVTC: header declares a {hdr.raw_body_bytes}-byte body, too small for its token ids and raw tokens")
    return f[1], hdr


def _raw_bytes(hdr: KvtcHeader) -> int:
    """Body bytes before the coded sections: the token ids (when carried) and the raw head and tail tokens."""
    es = torch.empty((), dtype=hdr.dtype).element_size()
    ids = 4 * hdr.token_count if hdr.flags & FLAG_TOKEN_IDS else 0
    return ids + (hdr.raw_head + hdr.raw_tail) * 2 * hdr.num_layers * hdr.num_kv_heads * hdr.head_dim * es


def read_header(buf: bytes) -> KvtcHeader:
    """The header of a buffer, checked for magic, version, every field's range, length and checksum (no
    calibration needed)."""
    require(isinstance(buf, (bytes, bytearray, memoryview)), Status.INVALID_ARGUMENT, "KVTC: a buffer is bytes")
    buf = memoryview(buf).cast("B")  # no copy
    require(len(buf) >= HEADER.size + CHECKSUM_BYTES, Status.INVALID_ARGUMENT,
            "KVTC: not a KVTC buffer (bad magic or shorter than a header)")
    version, hdr = _parse_header(buf[:HEADER.size])
    end = HEADER.size + hdr.body_bytes
    require(len(buf) == end + CHECKSUM_BYTES, Status.INVALID_ARGUMENT,
            f"KVTC: buffer is {len(buf)} bytes, its header says {end + CHECKSUM_BYTES} (truncated or padded)")
    require(_checksum(version, buf[:HEADER.size], buf[HEADER.size:end]) == buf[end:], Status.INVALID_ARGUMENT,
            "KVTC: checksum mismatch (the buffer is damaged)")
    return hdr


def _file_bytes(f: BinaryIO, consumed: int) -> int | None:
    """The bytes of `f` from where reading began (`consumed` bytes ago) when it is a regular file; None when
    unknown (a BytesIO, a pipe)."""
    try:
        st = os.fstat(f.fileno())
        return st.st_size - f.tell() + consumed if stat.S_ISREG(st.st_mode) else None
    except (AttributeError, OSError, ValueError):  # no descriptor (io.UnsupportedOperation is both)
        return None


def read_file(f: BinaryIO, *, keep: bool = True) -> tuple[KvtcHeader, bytearray | None]:
    """A buffer read from a binary file: the header is read and checked first, then the declared size against the
    file's (a regular file) and exactly the declared bytes are read, in chunks through the checksum. Returns the
    checked header and, with `keep`, the whole buffer (for `decompress`); without, nothing past the header is held
    (`kvx kvtc inspect`). KvxError as `read_header`."""
    head = f.read(HEADER.size)
    version, hdr = _parse_header(head)
    total = HEADER.size + hdr.body_bytes + CHECKSUM_BYTES
    size = _file_bytes(f, len(head))
    require(size is None or size == total, Status.INVALID_ARGUMENT,
            f"KVTC: the file holds {size} bytes, its header says {total} (truncated or padded)")
    h = _checksum_state(version)
    h.update(head)
    out = bytearray(head) if keep else None
    left = hdr.body_bytes
    while left:
        chunk = f.read(min(left, _READ_CHUNK))
        require(len(chunk) > 0, Status.INVALID_ARGUMENT, f"KVTC: the buffer ends {left} bytes before its header says")
        h.update(chunk)
        if out is not None:
            out += chunk
        left -= len(chunk)
    digest = f.read(CHECKSUM_BYTES)
    require(len(digest) == CHECKSUM_BYTES and not f.read(1), Status.INVALID_ARGUMENT,
            f"KVTC: the buffer's length differs from the {total} bytes its header says (truncated or padded)")
    require(h.digest() == digest, Status.INVALID_ARGUMENT, "KVTC: checksum mismatch (the buffer is damaged)")
    if out is not None:
        out += digest
    return hdr, out


class KvtcDecoded(NamedTuple):
    header: KvtcHeader
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V) `[token_count, H, D]` in the raw dtype
    token_ids: list[int] | None


def decompress(buf: bytes, cal: Calibration, *, model=None, device: torch.device | str | None = None) -> KvtcDecoded:
    """A buffer -> its header, K/V per layer on `device` and token ids (when carried). KvxError (INCOMPATIBLE) for a
    buffer of another calibration or model; INVALID_ARGUMENT when damaged or truncated."""
    hdr, layout, on_dev, ids = open_body(buf, cal, model=model, device=device)
    return KvtcDecoded(hdr, decode_body(on_dev, cal, layout, hdr), ids)


def _inflate(data: memoryview, size: int) -> bytes:
    """`data` inflated, refused unless it is exactly one DEFLATE (zlib) stream of `size` bytes: at most `size + 1`
    bytes are ever inflated, so a small forged body cannot expand into gigabytes."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, size + 1)
    except zlib.error as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"KVTC: the DEFLATE body does not decode ({e})") from None
    require(len(out) <= size, Status.INVALID_ARGUMENT,
            f"KVTC: the DEFLATE body inflates to more than the {size} bytes its header declares")
    require(d.eof and len(out) == size and not d.unused_data, Status.INVALID_ARGUMENT,
            f"KVTC: the DEFLATE body is not one stream of the {size} bytes its header declares")
    return out


def open_body(buf: bytes, cal: Calibration, *, model=None, device: torch.device | str | None = None):
    """The host half of `decompress`: every check (header, checksum, calibration, model, range headers), then
    (header, body layout, the body copied to `device`, token ids or None)."""
    hdr = read_header(buf)
    require(hdr.calibration == cal.identity, Status.INCOMPATIBLE,
            f"KVTC: the buffer was compressed with calibration {hdr.calibration[:12]}..., this one is "
            f"{cal.identity[:12]}...")
    if model is not None:
        require(hdr.model == model_hash(model), Status.INCOMPATIBLE, "KVTC: the buffer belongs to another model")
    require((hdr.num_layers, hdr.num_kv_heads, hdr.head_dim, hdr.layers_per_group) ==
            (cal.num_layers, cal.num_kv_heads, cal.head_dim, cal.layers_per_group), Status.INVALID_ARGUMENT,
            "KVTC: the header's geometry disagrees with its calibration")
    n, h, d, L = hdr.token_count, hdr.num_kv_heads, hdr.head_dim, hdr.num_layers
    require((hdr.raw_head, hdr.raw_tail) == split_raw(n, hdr.token_start, cal), Status.INVALID_ARGUMENT,
            f"KVTC: the header's {hdr.raw_head} + {hdr.raw_tail} raw tokens are not its calibration's sinks and "
            "recent window")
    kv_bytes = 2 * L * n * h * d * torch.empty((), dtype=hdr.dtype).element_size()
    require(kv_bytes <= MAX_BODY_BYTES, Status.INVALID_ARGUMENT,
            f"KVTC: the buffer decodes to {kv_bytes} bytes of K/V, more than the {MAX_BODY_BYTES} a buffer may hold")
    layout = body_layout(cal, n - hdr.raw_head - hdr.raw_tail, _raw_bytes(hdr))
    require(layout.end == hdr.raw_body_bytes, Status.INVALID_ARGUMENT,
            f"KVTC: the header declares a {hdr.raw_body_bytes}-byte body, its geometry and calibration make "
            f"{layout.end}")
    body = memoryview(buf).cast("B")[HEADER.size:HEADER.size + hdr.body_bytes]  # no copy
    if hdr.flags & FLAG_DEFLATE:
        body = _inflate(body, hdr.raw_body_bytes)
    check_headers(body, layout)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    ids = list(struct.unpack_from(f"<{n}I", body)) if hdr.flags & FLAG_TOKEN_IDS else None
    with warnings.catch_warnings():  # a read-only buffer: only ever read (copied out of) below
        warnings.simplefilter("ignore", UserWarning)
        on_dev = torch.frombuffer(body, dtype=torch.uint8).to(dev) if len(body) else \
            torch.empty(0, dtype=torch.uint8, device=dev)
    return hdr, layout, on_dev, ids
