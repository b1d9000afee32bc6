"""Forging KVTC buffers and calibration files as an attacker would (every checksum and identity hash recomputed, so
the forgery reaches the parser), and the fuzz targets `tests/fuzz.py` runs on them under a memory cap.

A reader may refuse a forgery with KvxError or accept it; an accepted one must decode to what the header declares:
finite K/V of the declared shape (checked here, independently of the codec, with an AssertionError otherwise).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import random
import struct
import tempfile
import zlib
from pathlib import Path

import torch
import xxhash

from kvx_core.kvtc import calibrate, compress, decompress, load_calibration
from kvx_core.kvtc.codec import CHECKSUM_BYTES, HEADER, read_file, read_header
from kvx_core.tensor_file import content_hash

from ..fuzz import EXTREME_INTS, dumps_json, mutate_bytes, mutate_json

L, H, D = 2, 2, 8
MODEL = {"architecture": "LlamaForCausalLM", "num_layers": L, "num_kv_heads": H, "head_dim": D, "rope": {},
         "config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64}  # a ModelFingerprint as a dict
FIELDS = ("magic", "version", "flags", "calibration", "model", "num_layers", "num_kv_heads", "head_dim",
          "layers_per_group", "token_start", "token_count", "raw_head", "raw_tail", "dtype", "body_bytes",
          "raw_body_bytes")
"""The buffer header's fields in `HEADER` order (the codec's module doc)."""
# bytes of each integer field
_WIDTHS = dict(zip(FIELDS, (0, 2, 2, 0, 0, 4, 4, 4, 4, 8, 8, 4, 4, 1, 8, 8), strict=True))


def small_kv(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) `[n, H, D]` bf16 of rank-4 structure plus noise."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(2 * L, 4, H * D, generator=torch.Generator().manual_seed(7))
    return [tuple((torch.randn(n, 4, generator=g) @ basis[2 * i + j] + 0.05 * torch.randn(n, H * D, generator=g))
                  .view(n, H, D).bfloat16() for j in range(2)) for i in range(L)]


@functools.cache
def calibration():
    """A small valid calibration (2 layers in one group, 2 KV heads x 8, RoPE removed, 4 sinks, 8 recent)."""
    return calibrate([small_kv(96, s) for s in range(3)], layers_per_group=2, ratio=3, range_size=4, sink_tokens=4,
                     recent_tokens=8, model=MODEL, rope_theta=10000.0)


@functools.cache
def buffers() -> tuple[bytes, ...]:
    """Valid buffers of `calibration()`: plain, DEFLATE with token ids, all raw, starting past the sinks."""
    cal, kv = calibration(), small_kv(40, 11)
    return (compress(kv, cal, model=MODEL), compress(kv, cal, deflate=True, token_ids=list(range(40))),
            compress([(k[:5], v[:5]) for k, v in kv], cal), compress(kv, cal, token_start=100, deflate=True))


def fields(buf: bytes) -> dict:
    """The header fields of a buffer by name."""
    return dict(zip(FIELDS, HEADER.unpack_from(buf), strict=True))


def seal(f: dict, body: bytes) -> bytes:
    """A buffer of header fields `f` and stored `body`, with the checksum of its version recomputed (a forger's)."""
    head = HEADER.pack(*(f[k] for k in FIELDS))
    if f["version"] == 1:
        return head + body + hashlib.blake2b(head + body, digest_size=CHECKSUM_BYTES).digest()
    return head + body + xxhash.xxh3_128(head + body).digest()


def body_of(buf: bytes) -> bytes:
    """The stored body (still DEFLATEd when the flags say so)."""
    return buf[HEADER.size:-CHECKSUM_BYTES]


def forge(buf: bytes, **changes) -> bytes:
    """`buf` with header fields changed and its checksum recomputed."""
    return seal({**fields(buf), **changes}, body_of(buf))


def with_raw_body(buf: bytes, raw: bytes) -> bytes:
    """`buf` with its inflated body replaced by `raw` (DEFLATEd again when the flags say so), sizes and checksum
    recomputed: a forged body that passes every size check."""
    f = fields(buf)
    stored = zlib.compress(raw) if f["flags"] & 1 else raw
    return seal({**f, "body_bytes": len(stored), "raw_body_bytes": len(raw)}, stored)


def raw_body(buf: bytes) -> bytes:
    """The inflated body of a valid buffer."""
    b = body_of(buf)
    return zlib.decompress(b) if fields(buf)["flags"] & 1 else b


def _extreme(rng: random.Random, width: int) -> int:
    return rng.choice(EXTREME_INTS + [1 << 53, (1 << 53) - 1, 3, 2, 1 << 20]) & ((1 << (8 * width)) - 1)


def forged_buffer(rng: random.Random) -> bytes:
    """One forgery of a valid buffer: raw damage (checksum left stale), header fields set to extreme values, or the
    inflated body damaged (both with every size and the checksum recomputed)."""
    buf = rng.choice(buffers())
    how = rng.randrange(4)
    if how == 0:
        return mutate_bytes(buf, rng)
    if how == 1:
        f = fields(buf)
        for _ in range(rng.randint(1, 3)):
            name = rng.choice([k for k, w in _WIDTHS.items() if w])
            f[name] = _extreme(rng, _WIDTHS[name]) if rng.random() < 0.7 else f[name] + rng.choice((-1, 1, 4))
            f[name] &= (1 << (8 * _WIDTHS[name])) - 1
        return seal(f, body_of(buf))
    if how == 2:
        return with_raw_body(buf, mutate_bytes(raw_body(buf), rng))
    return seal(fields(buf), mutate_bytes(body_of(buf), rng))  # the stored (maybe DEFLATE) bytes, resealed


def _check_decoded(buf: bytes, decoded) -> None:
    """What an accepted buffer must give: its header's token count of finite K/V per layer."""
    f = fields(buf)
    assert len(decoded.kv) == L, "accepted: wrong layer count"
    for k, v in decoded.kv:
        for x in (k, v):
            assert tuple(x.shape) == (f["token_count"], H, D), f"accepted: shape {tuple(x.shape)}"
            assert bool(torch.isfinite(x.float()).all()), "accepted: non-finite K/V"


def fuzz_buffer(rng: random.Random) -> None:
    """Fuzz target: `read_header`, `read_file` and `decompress` of one forged buffer."""
    import io

    buf = forged_buffer(rng)
    which = rng.randrange(3)
    if which == 0:
        read_header(buf)
    elif which == 1:
        read_file(io.BytesIO(buf), keep=rng.random() < 0.5)
    else:
        _check_decoded(buf, decompress(buf, calibration()))


# ------------------------------------------------------------------ calibration files
@functools.cache
def _workdir() -> tempfile.TemporaryDirectory:
    """A directory for the forged files of one process (removed when it ends)."""
    return tempfile.TemporaryDirectory(prefix="kvx-fuzz-kvtc-")


def cal_parts() -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON parameters, tensors) of `calibration()`."""
    cal = calibration()
    return cal.params(), cal.tensors()


def write_cal(path: Path, params, tensors: dict[str, torch.Tensor]) -> Path:
    """A calibration file of `params` (written with `dumps_json`, so forged NaN / deep nesting reach the reader)
    and `tensors`, its identity hash recomputed as a forger would (over the forged parameters)."""
    from safetensors.torch import save_file

    meta = {"kvx_kvtc": dumps_json(params).decode(), "identity": content_hash(params, tensors)}
    path.unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def _forged_tensors(tensors: dict[str, torch.Tensor], rng: random.Random) -> dict[str, torch.Tensor]:
    """One to three tensors damaged: a value made NaN / inf / huge / 0 / negative, scaled, reshaped, another dtype,
    dropped, or an extra tensor added."""
    t = {k: v.clone() for k, v in tensors.items()}
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(sorted(t)) if t else None
        op = rng.randrange(6)
        if name is None or op == 5:
            t[f"g{rng.randrange(3)}.{rng.choice('kv')}.extra"] = torch.zeros(rng.randint(0, 40))
        elif op == 0:
            x = t[name].view(-1)
            if x.numel() and x.is_floating_point():
                x[rng.randrange(x.numel())] = rng.choice([math.nan, math.inf, -math.inf, 3e38, 0.0, -1.0, 1e-30])
        elif op == 1:
            t[name] = t[name] * rng.choice([0.0, -1.0, 2.0, 1e30])
        elif op == 2:
            t[name] = t[name].reshape(-1)[:max(0, t[name].numel() - rng.randint(1, 16))].clone()
        elif op == 3:
            t[name] = t[name].to(rng.choice([torch.float64, torch.float16, torch.int32]))
        else:
            del t[name]
    return t


def forged_cal_file(rng: random.Random) -> Path:
    """One forged calibration file of `calibration()`: its parameters JSON mutated, its tensors damaged (both with
    the identity recomputed), or the file's bytes damaged (the safetensors header included)."""
    path = Path(_workdir().name) / "cal.safetensors"
    params, tensors = cal_parts()
    how = rng.randrange(4)
    if how == 0:
        return write_cal(path, mutate_json(params, rng), tensors)
    if how == 1:
        return write_cal(path, params, _forged_tensors(tensors, rng))
    write_cal(path, params, tensors)
    data = path.read_bytes()
    if how == 2:
        path.write_bytes(mutate_bytes(data, rng))
    else:  # the safetensors header (its JSON of dtypes, shapes and offsets)
        n = struct.unpack_from("<Q", data)[0]
        head = mutate_json(json.loads(data[8:8 + n]), rng)
        text = dumps_json(head)
        path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    return path


def fuzz_calibration(rng: random.Random) -> None:
    """Fuzz target: `load_calibration` of one forged file; an accepted calibration must code and decode K/V of its
    geometry into finite values (or refuse them with KvxError)."""
    cal = load_calibration(str(forged_cal_file(rng)))
    if cal.num_layers * cal.num_kv_heads * cal.head_dim > 4096:
        return
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    kv = [tuple(torch.randn(24, cal.num_kv_heads, cal.head_dim, generator=g).bfloat16() for _ in range(2))
          for _ in range(cal.num_layers)]
    out = decompress(compress(kv, cal), cal)
    assert all(bool(torch.isfinite(x.float()).all()) for pair in out.kv for x in pair), "accepted: non-finite K/V"
