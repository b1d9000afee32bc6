"""`BundleStore` shard sets: the entry of a tensor-parallel producer (TP=M) is one bundle per distinct KV-head range
plus a manifest published last; a consumer rank of any TP=N takes its head range from them through the bundle
resharding. Oracle: one full cache holding the same K/V, sliced by head (bit-exact: same format and scales).
Forged manifests and missing, truncated, swapped, damaged or foreign shards are refused with a KvxError, the
destination cache and the store's files unchanged; `shard_sets` fuzzes both readers under the memory cap of
`tests/fuzz.py`."""
from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.transfer import export_bundle
from kvx_core.transfer.store import MAX_MANIFEST_BYTES, BundleStore
from kvx_core.transfer.tp import tp_head_range
from tests.fuzz import DEEP, dumps_json, mutate_bytes, mutate_json, run_capped
from tests.transfer.forge import build, split
from tests.transfer.test_tensor_parallel import LAYERS, MODEL, SLOTS, D, H, T, _caches, _data, _same_heads

IDS = list(range(100, 100 + T))
FMT = "nvfp4"  # per-head global scales: the slicing must carry them too


def _descs(c):
    return [c.descriptor(i) for i in range(LAYERS)]


def _write_rank(store: BundleStore, data, tp: int, rank: int, ids=IDS):
    heads = tp_head_range(H, tp, rank)
    src = _caches(FMT, heads, *data)
    return store.write_shard(MODEL, ids, tp, rank, lambda f: export_bundle(f, _descs(src), SLOTS, model=MODEL,
                                                                           token_ids=ids, kv_heads=heads))


def _produce(store: BundleStore, data, tp: int, ids=IDS) -> None:
    for rank in range(tp):
        _write_rank(store, data, tp, rank, ids)


def _empty(heads, data):
    zero = torch.zeros(LAYERS, T, H, D)
    return _caches(FMT, heads, zero, zero, data[2], data[3])


@pytest.mark.parametrize("producer_tp", [1, 2, 4, 8])
@pytest.mark.parametrize("consumer_tp", [1, 2, 4])
def test_a_tp_m_entry_loads_into_every_rank_of_a_tp_n_consumer(tmp_path, producer_tp, consumer_tp):
    """TP 8 over 4 KV heads replicates each head on two ranks: only the first of each pair writes."""
    data = _data(producer_tp)
    full = _caches(FMT, (0, H), *data)
    store = BundleStore(tmp_path / "kv")
    _produce(store, data, producer_tp)
    files = sorted(p.name for p in store.root.iterdir() if p.name != "kvx_bundle_store.json")
    key = store.key(MODEL, IDS)
    if producer_tp == 1:
        assert files == [f"{key}.kvx"]
    else:
        n = min(producer_tp, H)
        assert files == sorted([f"{key}.kvxset"] + [f"{key}.tp{producer_tp}-{i}.kvx" for i in range(n)])
    assert store.header(MODEL, IDS)["tokens"]["count"] == T
    for rank in range(consumer_tp):
        heads = tp_head_range(H, consumer_tp, rank)
        dst = _empty(heads, data)
        assert store.get(_descs(dst), SLOTS, model=MODEL, token_ids=IDS, kv_heads=heads)
        _same_heads(dst, full, heads)


def test_a_half_written_set_is_no_entry(tmp_path):
    """Shards land one by one; the manifest comes with the last, so until then the entry is absent."""
    data = _data(3)
    store = BundleStore(tmp_path / "kv")
    _write_rank(store, data, 4, 0)
    _write_rank(store, data, 4, 2)
    assert (MODEL, IDS) not in store and store.header(MODEL, IDS) is None
    assert not store.get(_descs(_empty((0, H), data)), SLOTS, model=MODEL, token_ids=IDS)
    _write_rank(store, data, 4, 3)
    _write_rank(store, data, 4, 1)
    assert (MODEL, IDS) in store
    with pytest.raises(KvxError, match="shard set") as e:
        store.open_entry(MODEL, IDS)
    assert e.value.status == Status.UNSUPPORTED
    assert store.remove(MODEL, IDS) and (MODEL, IDS) not in store
    assert [p.name for p in store.root.iterdir()] == ["kvx_bundle_store.json"]


def test_replicas_write_nothing(tmp_path):
    store = BundleStore(tmp_path / "kv")
    assert _write_rank(store, _data(4), 8, 1) is None
    assert [p.name for p in store.root.iterdir()] == ["kvx_bundle_store.json"]


@pytest.fixture
def tp2(tmp_path):
    """A TP=2 producer's set, the oracle cache, a consumer cache holding other K/V, and a snapshot of the store."""
    data = _data(5)
    store = BundleStore(tmp_path / "kv")
    _produce(store, data, 2)
    key = store.key(MODEL, IDS)
    paths = {"manifest": store.root / f"{key}.kvxset", 0: store.root / f"{key}.tp2-0.kvx",
             1: store.root / f"{key}.tp2-1.kvx"}
    return store, data, paths


def _manifest(paths) -> dict:
    return json.loads(paths["manifest"].read_text())


def _set_manifest(paths, doc) -> None:
    paths["manifest"].write_bytes(doc if isinstance(doc, bytes) else dumps_json(doc))


def _resize(paths) -> None:
    """Declare the shards' present sizes (a forger rewrites the manifest to match)."""
    doc = _manifest(paths)
    for i, s in enumerate(doc["shards"]):
        s["bytes"] = paths[i].stat().st_size
    _set_manifest(paths, doc)


def _refused(store: BundleStore, data, heads=(0, H), *, by_header: bool = True) -> KvxError:
    """`get` (and `header`, the scheduler's check, unless the damage is past the headers: `by_header`) refuse the
    entry with a KvxError; the destination cache and the store's files are unchanged."""
    dst = _caches(FMT, heads, *_data(99)[:2], data[2], data[3])
    before = [t.clone() for p in dst.layers for t in (p.k_data, p.v_data, p.k_scales, p.v_scales)]
    files = {p.name: p.read_bytes() for p in store.root.iterdir() if p.is_file()}
    with pytest.raises(KvxError) as e:
        store.get(_descs(dst), SLOTS, model=MODEL, token_ids=IDS, kv_heads=heads)
    if by_header:
        with pytest.raises(KvxError):
            store.header(MODEL, IDS)
    after = [t for p in dst.layers for t in (p.k_data, p.v_data, p.k_scales, p.v_scales)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert {p.name: p.read_bytes() for p in store.root.iterdir() if p.is_file()} == files
    return e.value


def test_a_missing_shard_refuses_the_entry(tp2):
    store, data, paths = tp2
    paths[1].unlink()
    assert "missing" in str(_refused(store, data))
    assert "missing" in str(_refused(store, data, (0, 2)))  # even for a rank that needs only the other shard


@pytest.mark.parametrize("resized", [False, True])
def test_a_truncated_shard_refuses_the_entry(tp2, resized):
    store, data, paths = tp2
    paths[0].write_bytes(paths[0].read_bytes()[:-40])
    if resized:
        _resize(paths)
    e = _refused(store, data)
    assert e.status == Status.INVALID_ARGUMENT
    assert ("bytes, the manifest says" in str(e)) != resized


def test_swapped_shards_are_refused(tp2):
    store, data, paths = tp2
    a, b = paths[0].read_bytes(), paths[1].read_bytes()
    paths[0].write_bytes(b)
    paths[1].write_bytes(a)
    _resize(paths)
    assert "swapped or foreign shard" in str(_refused(store, data))


def test_a_damaged_shard_fails_every_rank(tp2):
    """One byte of shard 1's payload flipped: the rank holding heads [0, 2), which shard 1 does not hold, refuses
    too, so no rank of the consumer writes half a request."""
    store, data, paths = tp2
    raw = bytearray(paths[1].read_bytes())
    raw[-100] ^= 0x10
    paths[1].write_bytes(bytes(raw))
    for heads in ((0, 2), (2, 4), (0, H)):
        assert "checksum" in str(_refused(store, data, heads, by_header=False))


def test_a_shard_of_other_tokens_is_refused(tp2, tmp_path):
    store, data, paths = tp2
    other = list(range(300, 300 + T))
    _produce(store, data, 2, other)
    shutil.copyfile(store.root / f"{store.key(MODEL, other)}.tp2-1.kvx", paths[1])
    _resize(paths)
    e = _refused(store, data)
    assert "other tokens" in str(e)


def _forged(doc: dict, forgery: str):
    s = doc["shards"]
    if forgery == "nan":
        s[0]["bytes"] = float("nan")
    elif forgery == "deep":
        doc["extra"] = DEEP
    elif forgery == "bool tp_size":
        doc["tp_size"] = True
    elif forgery == "float bytes":
        s[0]["bytes"] = float(s[0]["bytes"])
    elif forgery == "string bytes":
        s[0]["bytes"] = str(s[0]["bytes"])
    elif forgery == "float heads":
        s[0]["kv_heads"] = [0.0, 2]
    elif forgery == "overlap":
        s[0]["kv_heads"] = [0, 3]
    elif forgery == "gap":
        s[0]["kv_heads"] = [0, 1]
    elif forgery == "one shard":
        del s[1]
    elif forgery == "extra shard":
        s.append(dict(s[1]))
    elif forgery == "tp 3":
        doc["tp_size"] = 3
    elif forgery == "tp 4":
        doc["tp_size"] = 4
    elif forgery == "huge tp":
        doc["tp_size"] = 2**70
    elif forgery == "version 2":
        doc["kvx_shard_set"] = 2
    elif forgery == "extra key":
        doc["note"] = 1
    elif forgery == "shards object":
        doc["shards"] = {"0": s[0]}
    elif forgery == "huge bytes":
        s[0]["bytes"] = 2**64
    elif forgery == "array":
        return [doc]
    elif forgery == "oversized":
        return json.dumps(doc).encode() + b" " * MAX_MANIFEST_BYTES
    elif forgery == "not utf-8":
        return b"\xff" + json.dumps(doc).encode()
    return doc


FORGERIES = ["nan", "deep", "bool tp_size", "float bytes", "string bytes", "float heads", "overlap", "gap",
             "one shard", "extra shard", "tp 3", "tp 4", "huge tp", "version 2", "extra key", "shards object",
             "huge bytes", "array", "oversized", "not utf-8"]


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_manifest_is_refused(tp2, forgery):
    store, data, paths = tp2
    _set_manifest(paths, _forged(_manifest(paths), forgery))
    e = _refused(store, data)
    assert e.status == (Status.UNSUPPORTED if forgery == "tp 3" else Status.INVALID_ARGUMENT), e


def test_an_unreadable_manifest_is_refused(tp2):
    store, data, paths = tp2
    paths["manifest"].unlink()
    paths["manifest"].mkdir()
    assert "cannot be read" in str(_refused(store, data))


@functools.cache
def _fuzz_store() -> tuple[BundleStore, dict, dict]:
    """A store holding a valid TP=2 set of IDS, its files' valid bytes, and the K/V it was made of."""
    root = Path(tempfile.mkdtemp(prefix="kvx-fuzz-tp-"))
    atexit.register(shutil.rmtree, root, True)
    store, data = BundleStore(root / "kv"), _data(7)
    _produce(store, data, 2)
    return store, {p: p.read_bytes() for p in store.root.glob(f"{store.key(MODEL, IDS)}*")}, data


def shard_sets(rng: random.Random) -> None:
    """One forgery of the valid set (the manifest's JSON or bytes, a shard's bytes or its header with checksums
    recomputed, a shard deleted or two swapped; sizes re-declared half of the time), then the scheduler's
    `header` and a consumer rank's `get`, which must leave its cache unchanged when refused."""
    store, valid, data = _fuzz_store()
    for p, raw in valid.items():
        p.write_bytes(raw)
    manifest = next(p for p in valid if p.suffix == ".kvxset")
    shards = sorted(p for p in valid if p.suffix == ".kvx")
    op = rng.randrange(5)
    if op == 0:
        manifest.write_bytes(dumps_json(mutate_json(json.loads(valid[manifest]), rng)))
    elif op == 1:
        manifest.write_bytes(mutate_bytes(valid[manifest], rng))
    else:
        i = rng.randrange(len(shards))
        if op == 2:
            shards[i].write_bytes(mutate_bytes(valid[shards[i]], rng))
        elif op == 3:
            header, payloads = split(valid[shards[i]])
            shards[i].write_bytes(build(mutate_json(header, rng), payloads))
        elif rng.random() < 0.5:
            shards[i].unlink()
        else:
            shards[0].write_bytes(valid[shards[1]])
            shards[1].write_bytes(valid[shards[0]])
        if rng.random() < 0.5 and all(p.is_file() for p in shards):
            doc = json.loads(valid[manifest])
            for s, p in zip(doc["shards"], shards, strict=True):
                s["bytes"] = p.stat().st_size
            manifest.write_text(json.dumps(doc))
    try:
        store.header(MODEL, IDS)
    except KvxError:
        pass
    tp = rng.choice([1, 2, 4])
    heads = tp_head_range(H, tp, rng.randrange(tp))
    dst = _caches(FMT, heads, *_data(99)[:2], data[2], data[3])
    before = [t.clone() for p in dst.layers for t in (p.k_data, p.v_data, p.k_scales, p.v_scales)]
    try:
        store.get(_descs(dst), SLOTS, model=MODEL, token_ids=IDS, kv_heads=heads)
    except Exception:
        after = [t for p in dst.layers for t in (p.k_data, p.v_data, p.k_scales, p.v_scales)]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), \
            "a refused shard set changed the cache"
        raise


def test_fuzz_shard_sets():
    run_capped("tests.transfer.test_store_tp:shard_sets", cases=1000)
