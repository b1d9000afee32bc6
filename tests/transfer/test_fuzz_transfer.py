"""Fuzzing the readers of KV bundles under the memory cap of `tests/fuzz.py`: the bundle readers (import from a
stream or a host buffer, `verify`'s read from a pipe, convert), the store (`header`, `get`, over an entry forged,
emptied or replaced by a directory) and the NIXL ticket parser. Forged inputs start from a valid bundle (NVFP4, per-head
global scales, key smoothing and centering, token ids) or ticket: raw byte damage (checksums left stale), or header
fields and payload bytes mutated with every checksum recomputed (`forge.py`), so the fuzzer reaches the checks behind
the checksums. Anything but a KvxError, or a refused import that changed its destination, fails."""
from __future__ import annotations

import atexit
import functools
import io
import math
import random
import shutil
import struct
import tempfile

import torch

from kvx_core.transfer import BundleReader, convert_bundle, import_bundle
from kvx_core.transfer.nixl import MAX_DEVICE, parse_ticket
from kvx_core.transfer.store import BundleStore
from tests.fuzz import dumps_json, mutate_bytes, mutate_json, run_capped

from .forge import build, split
from .test_bundle import MODEL, _cache, _descs, _snapshot, _Trickle, _unchanged
from .test_forged import IDS, LOOKUP, TICKET, _transformed

EXTREME_FLOATS = [0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 3.4e38, 1e-45]


@functools.cache
def _valid() -> bytes:
    return _transformed()[0]


def _forged(rng: random.Random) -> bytes:
    """A bundle damaged raw (stale checksums), or with its header and / or payloads forged and checksums recomputed."""
    blob = _valid()
    op = rng.randrange(4)
    if op == 0:
        return mutate_bytes(blob, rng)
    header, payloads = split(blob)
    if op in (1, 3):
        header = mutate_json(header, rng)
    if op in (2, 3):
        i = rng.randrange(len(payloads))
        p = bytearray(payloads[i])
        if rng.random() < 0.5:
            p = bytearray(mutate_bytes(bytes(p), rng))
        else:  # an extreme float where a scale or key vector may be
            at = rng.randrange(len(p) // 4) * 4
            p[at:at + 4] = struct.pack("<f", rng.choice(EXTREME_FLOATS))
        payloads[i] = bytes(p)
    return build(header, payloads)


def _import_or_unchanged(src, token_ids=None) -> None:
    """Import `src` into a destination holding other data; a refusal must leave it as it was."""
    dst, _ = _cache("nvfp4", 16, 4, seed=9, tokens=10)
    before = _snapshot(dst)
    try:
        import_bundle(src, _descs(dst), torch.arange(3), model=MODEL, token_ids=token_ids)
    except Exception:
        assert _unchanged(dst, before), "a refused import changed its destination"
        raise


def bundle_readers(rng: random.Random) -> None:
    data = _forged(rng)
    reader = rng.randrange(4)
    if reader == 0:
        _import_or_unchanged(io.BytesIO(data), token_ids=IDS if rng.random() < 0.5 else None)
    elif reader == 1:
        _import_or_unchanged(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else data)
    elif reader == 2:
        BundleReader(_Trickle(data)).read_all()  # `kvx bundle verify`'s read, from a pipe (size unknown)
    else:
        convert_bundle(io.BytesIO(data), io.BytesIO(), "int8")


@functools.cache
def _store() -> BundleStore:
    root = tempfile.mkdtemp(prefix="kvx-fuzz-store-")
    atexit.register(shutil.rmtree, root, True)
    return BundleStore(root)


def store_entries(rng: random.Random) -> None:
    store = _store()
    path = store.path(MODEL, IDS)
    if path.is_dir():
        path.rmdir()
    path.unlink(missing_ok=True)
    kind = rng.randrange(10)
    if kind == 0:
        path.mkdir()
    elif kind == 1:
        path.write_bytes(b"")
    else:
        path.write_bytes(_forged(rng))
    assert ((MODEL, IDS) in store) == path.is_file()
    try:
        store.header(MODEL, IDS)
    except Exception as e:  # noqa: BLE001 - a KvxError is a refusal; get must still be tried
        if type(e).__name__ != "KvxError":
            raise
    dst, _ = _cache("nvfp4", 16, 4, seed=9, tokens=10)
    before = _snapshot(dst)
    try:
        store.get(_descs(dst), torch.arange(3), model=MODEL, token_ids=IDS)
    except Exception:
        assert _unchanged(dst, before), "a refused store entry changed the cache"
        raise


def nixl_tickets(rng: random.Random) -> None:
    """Host and device-memory tickets (direct and lookup) mutated: parsed into checked fields or refused."""
    seed = rng.choice([TICKET, LOOKUP, {**TICKET, "memory": "host"}, {**LOOKUP, "memory": "device", "device": 1}])
    t = mutate_json(seed, rng)
    p = parse_ticket(dumps_json(t) if rng.random() < 0.5 else t)
    assert type(p.seq) is int and isinstance(p.metadata, bytes)
    assert (type(p.nbytes) is int and type(p.addr) is int) or (type(p.directory) is int and type(p.slots) is int)
    assert (p.memory, p.device) == ("host", 0) or (p.memory == "device" and type(p.device) is int
                                                   and 0 <= p.device < MAX_DEVICE)


def test_fuzz_bundle_readers():
    run_capped("tests.transfer.test_fuzz_transfer:bundle_readers", cases=400)


def test_fuzz_store_entries():
    run_capped("tests.transfer.test_fuzz_transfer:store_entries", cases=300)


def test_fuzz_nixl_tickets():
    run_capped("tests.transfer.test_fuzz_transfer:nixl_tickets", cases=1000)
