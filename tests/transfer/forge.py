"""A forger of KVX bundles, written from docs/bundle.md (not with `kvx_core.transfer.bundle`): take a bundle apart
into its header and chunk payloads, and put edited parts back together with every checksum recomputed, as an
attacker who wants a reader to accept forged fields would."""
from __future__ import annotations

import json
import struct

import xxhash

from tests.fuzz import DEEP

MAGIC = b"KVXBNDL\0"
DEEP_TEXT = "[" * 100_000 + "]" * 100_000


def split(blob: bytes) -> tuple[dict, list[bytes]]:
    """(the header, each chunk's payload) of a valid bundle."""
    (n,) = struct.unpack_from("<I", blob, 12)
    header = json.loads(blob[16:16 + n])
    pos, payloads = 16 + n + 8, []
    while blob[pos:pos + 4] == b"KVXC":
        (size,) = struct.unpack_from("<Q", blob, pos + 8)
        payloads.append(blob[pos + 16:pos + 16 + size])
        pos += 16 + size + 8
    return header, payloads


def header_bytes(header) -> bytes:
    """The canonical form of a (forged) header: sorted keys, no spaces, NaN / Infinity as Python writes them, each
    `tests.fuzz.DEEP` as a 100k-deep nesting. Canonical so that readers get past that check to the fields."""
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.replace(json.dumps(DEEP), DEEP_TEXT).encode()


def _segment(header) -> int:
    """The checksum segment the header declares, when it declares a usable one (the writers' 8 MiB otherwise)."""
    seg = header.get("checksum", {}).get("segment_bytes") if isinstance(header, dict) and isinstance(
        header.get("checksum"), dict) else None
    return seg if type(seg) is int and 1 << 16 <= seg <= 1 << 26 and not seg & (seg - 1) else 1 << 23


def build(header, payloads: list[bytes], raw_header: bytes | None = None) -> bytes:
    """A bundle of `header` (or the exact bytes `raw_header`) and `payloads`, checksums and trailer recomputed."""
    head = header_bytes(header) if raw_header is None else raw_header
    prefix = MAGIC + struct.pack("<HHI", 2, 0, len(head)) + head
    seed = xxhash.xxh64_intdigest(prefix)
    seg = _segment(header)
    out, sums = [prefix, struct.pack("<Q", seed)], []
    for i, p in enumerate(payloads):
        digests = [xxhash.xxh64_intdigest(p[a:a + seg], seed) for a in range(0, len(p), seg)]
        c = xxhash.xxh64_intdigest(struct.pack(f"<I{len(digests)}Q", i, *digests), seed)
        out += [b"KVXC", struct.pack("<IQ", i, len(p)), p, struct.pack("<Q", c)]
        sums.append(c)
    offset = sum(map(len, out))
    digest = xxhash.xxh64_intdigest(b"".join(struct.pack("<Q", c) for c in sums), seed)
    out.append(b"KVXE" + struct.pack("<IQQ", len(sums), offset, digest))
    return b"".join(out)


def tensor_at(header: dict, name: str) -> tuple[int, int]:
    """[start, stop) of tensor `name` in every chunk's payload (the header's order, `dtype size x shape` bytes each,
    x tokens.count when per token)."""
    sizes = {"uint8": 1, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
    pos = 0
    for t in header["tensors"]:
        n = sizes[t["dtype"]] * (header["tokens"]["count"] if t["per_token"] else 1)
        for s in t["shape"]:
            n *= s
        if t["name"] == name:
            return pos, pos + n
        pos += n
    raise KeyError(name)
