"""`BundleStore` prefix reuse and eviction: `longest_prefix` finds the stored entry sharing the longest block-aligned
prefix with a prompt (or the whole entry a prompt extends), `get(token_range=(0, n))` loads those tokens bit for bit;
forged, damaged or stale links and markers are a miss or a KvxError, never another entry's KV; `max_bytes` evicts
least recently used entries and nothing else. Oracles: the prefix arithmetic written out per case, and the source
cache's rows (`read_rows`)."""
from __future__ import annotations

import atexit
import functools
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.transfer import ModelFingerprint, export_bundle
from kvx_core.transfer.rows import read_rows
from kvx_core.transfer.store import MARKER, BundleStore
from kvx_core.transfer.tp import tp_head_range
from tests.fuzz import DEEP, dumps_json, mutate_bytes, mutate_json, run_capped
from tests.transfer import test_tensor_parallel as tp

LAYERS, H, D, T = 2, 2, 32, 40
MODEL = ModelFingerprint("LlamaForCausalLM", LAYERS, H, D, {}, "c" * 64, "t" * 64)
BLOCK = 8
A = list(range(1000, 1000 + T))
OTHER = [7, 8, 9]


def _cache(seed: int | None = None) -> PagedKVCache:
    """A 4 x 16-slot nvfp4 cache; with `seed`, random K/V written at slots 0..T-1."""
    c = PagedKVCache("nvfp4", num_layers=LAYERS, num_blocks=4, block_size=16, num_kv_heads=H, head_dim=D)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            c.write(layer, torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.arange(T))
    return c


def _descs(c: PagedKVCache) -> list:
    return [c.descriptor(i) for i in range(LAYERS)]


def _put(store: BundleStore, ids: list[int], seed: int = 0) -> PagedKVCache:
    src = _cache(seed)
    store.put(_descs(src), torch.arange(len(ids)), model=MODEL, token_ids=ids)
    return src


def _rows(c: PagedKVCache, n: int) -> list[dict]:
    return [{k: t.view(torch.uint8).clone() for k, t in read_rows(c.descriptor(i), torch.arange(n)).items()}
            for i in range(LAYERS)]


def _same_rows(a: list[dict], b: list[dict]) -> bool:
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir()}


@pytest.mark.parametrize("prompt, n", [
    (OTHER + A, 0),                      # shares nothing
    (A[:5] + OTHER, 0),                  # part of the first block only
    (A[:8] + OTHER, 8),                  # exactly one block
    (A[:21] + OTHER, 16),                # a partial block is not matched
    (A[:39] + OTHER, 32),
    (A[:20], 16),                        # a shorter prompt, all of it stored
    (A, 40),                             # the entry itself (not block-aligned: the whole entry)
    (A + OTHER, 40),                     # longer than the stored entry: all of the entry
])
def test_prefix_hits_at_block_boundaries_and_load_bit_for_bit(tmp_path, prompt, n):
    store = BundleStore(tmp_path / "kv", prefix_block=BLOCK)
    src = _put(store, A)
    got, entry = store.longest_prefix(MODEL, prompt)
    assert got == n and entry == (A if n else None)
    if n:
        dst = _cache()
        assert store.get(_descs(dst), torch.arange(n), model=MODEL, token_ids=entry, token_range=(0, n))
        assert _same_rows(_rows(dst, n), _rows(src, n))


def test_two_entries_sharing_a_prefix_the_longest_wins(tmp_path):
    store = BundleStore(tmp_path / "kv", prefix_block=BLOCK)
    b = A[:16] + list(range(5000, 5000 + T - 16))  # shares A's first two blocks, then differs
    _put(store, A, seed=1)
    _put(store, b, seed=2)
    assert store.longest_prefix(MODEL, A[:30] + OTHER) == (24, A)
    assert store.longest_prefix(MODEL, b[:30] + OTHER) == (24, b)
    n, entry = store.longest_prefix(MODEL, A[:18] + OTHER)  # both hold 16 shared tokens: either serves them
    assert n == 16 and entry in (A, b)
    # the shared blocks' links name the later writer, `b`: removing it removes them (A's own blocks still match)
    assert store.remove(MODEL, b)
    assert store.key(MODEL, b) not in set(_links(store).values())
    assert store.longest_prefix(MODEL, A[:18] + OTHER) == (0, None)
    assert store.longest_prefix(MODEL, A[:30] + OTHER) == (24, A)
    assert store.longest_prefix(MODEL, b[:30] + OTHER) == (0, None)


def test_an_existing_store_keeps_its_prefix_block(tmp_path):
    BundleStore(tmp_path / "kv", prefix_block=BLOCK)
    assert BundleStore(tmp_path / "kv").prefix_block == BLOCK
    before = _snapshot(tmp_path / "kv")
    with pytest.raises(KvxError, match="prefix block is 8") as e:
        BundleStore(tmp_path / "kv", prefix_block=16)
    assert e.value.status == Status.INCOMPATIBLE and _snapshot(tmp_path / "kv") == before
    old = tmp_path / "old"  # a store written before prefix links: its marker gains the block
    old.mkdir()
    (old / MARKER).write_text(json.dumps({"kvx_bundle_store": 1}))
    assert BundleStore(old, prefix_block=4).prefix_block == 4 and BundleStore(old).prefix_block == 4


@pytest.mark.parametrize("marker", [b"", b"[1]", b"{\"kvx_bundle_store\": 1, \"prefix_block\": NaN}",
                                    b"{\"kvx_bundle_store\": 1, \"prefix_block\": 8.0}",
                                    b"{\"kvx_bundle_store\": 1, \"prefix_block\": true}",
                                    b"{\"kvx_bundle_store\": 1, \"prefix_block\": 0}",
                                    b"{\"kvx_bundle_store\": 1, \"prefix_block\": 1099511627776}",
                                    b"{\"kvx_bundle_store\": true, \"prefix_block\": 8}",
                                    b"{\"kvx_bundle_store\": 1, \"extra\": 1}",
                                    b"{\"kvx_bundle_store\": 1, \"prefix_block\": " + b"[" * 5000 + b"]" * 5000 + b"}",
                                    b" " * (1 << 13)])
def test_a_forged_marker_is_refused_and_nothing_changes(tmp_path, marker):
    root = tmp_path / "kv"
    root.mkdir()
    (root / MARKER).write_bytes(marker)
    with pytest.raises(KvxError) as e:
        BundleStore(root)
    assert e.value.status == Status.INVALID_ARGUMENT and _snapshot(root) == {MARKER: marker}


@pytest.mark.parametrize("value", [0, -1, 1 << 40, 8.0, True, "8"])
def test_bad_store_parameters_are_refused(tmp_path, value):
    for kw in ("prefix_block", "max_bytes"):
        if kw == "max_bytes" and value == 1 << 40:
            continue
        with pytest.raises(KvxError) as e:
            BundleStore(tmp_path / "kv", **{kw: value})
        assert e.value.status == Status.INVALID_ARGUMENT and not (tmp_path / "kv").exists()


def _links(store: BundleStore) -> dict[str, str]:
    return {p.name: p.read_text() for p in store.root.glob("*.kvxp")}


def test_forged_and_stale_links_are_misses_never_other_kv(tmp_path):
    """A link redirected to another entry (whose tokens differ from the prompt's prefix), or naming an entry file
    copied under another key, is no hit; a damaged link is a KvxError with nothing changed; links of an entry deleted
    behind the store's back (stale) are misses."""
    store = BundleStore(tmp_path / "kv", prefix_block=BLOCK)
    _put(store, A, seed=1)
    c = list(range(9000, 9000 + T))
    _put(store, c, seed=2)
    key_a, key_c = store.key(MODEL, A), store.key(MODEL, c)
    links = _links(store)
    assert sorted(links.values()) == sorted([key_a] * (T // BLOCK) + [key_c] * (T // BLOCK))
    prompt = A[:33] + OTHER
    for name, key in links.items():  # every link of A now names C: a forger's redirect
        if key == key_a:
            (store.root / name).write_text(key_c)
    assert store.longest_prefix(MODEL, prompt) == (0, None)
    # C's bundle copied over A's name: the name's key is not the key of the bundle's tokens
    shutil.copy(store.path(MODEL, c), store.root / "forged")
    os.replace(store.root / "forged", store.path(MODEL, A))
    for name, key in links.items():
        (store.root / name).write_text(key)
    assert store.longest_prefix(MODEL, prompt) == (0, None)
    # a damaged link: refused, nothing changed
    victim = f"{store._chain(MODEL, prompt)[-1]}.kvxp"  # the link of the prompt's last full block: probed first
    assert links[victim] == key_a
    for junk in (b"x" * 64, key_a.upper().encode(), key_a.encode() + b"\n", b"", bytes(1 << 20)):
        (store.root / victim).write_bytes(junk)
        before = _snapshot(store.root)
        with pytest.raises(KvxError, match="must hold an entry key") as e:
            store.longest_prefix(MODEL, prompt)
        assert e.value.status == Status.INVALID_ARGUMENT and _snapshot(store.root) == before
    (store.root / victim).write_text(key_a)
    # stale: A deleted behind the store's back; its links stay and are misses
    store.path(MODEL, A).unlink()
    assert store.longest_prefix(MODEL, prompt) == (0, None)
    assert store.longest_prefix(MODEL, c[:12]) == (8, c)


def _write_shard(store: BundleStore, ids: list[int], data, rank: int, tp_size: int = 2):
    """Rank `rank` of a TP=`tp_size` producer of `data` (`test_tensor_parallel`) writes its shard of `ids`."""
    heads = tp_head_range(tp.H, tp_size, rank)
    src = tp._caches("nvfp4", heads, *data)
    return store.write_shard(tp.MODEL, ids, tp_size, rank, lambda f: export_bundle(
        f, [src.descriptor(i) for i in range(tp.LAYERS)], tp.SLOTS, model=tp.MODEL, token_ids=ids, kv_heads=heads))


def test_tp_shard_set_serves_a_prefix_to_every_consumer_rank(tmp_path):
    """A TP=2 producer's set (links published with its manifest); each TP=2 consumer rank loads its heads of the
    shared prefix from both shards."""
    data = tp._data(3)
    full = tp._caches("nvfp4", (0, tp.H), *data)
    store = BundleStore(tmp_path / "kv", prefix_block=BLOCK)
    ids = list(range(300, 300 + tp.T))
    _write_shard(store, ids, data, 0)
    assert not _links(store)  # no links before the set is complete
    _write_shard(store, ids, data, 1)
    assert len(_links(store)) == tp.T // BLOCK
    n, entry = store.longest_prefix(tp.MODEL, ids[:17] + OTHER)
    assert (n, entry) == (16, ids)
    slots = tp.SLOTS[:n]
    for rank in range(2):
        heads = tp_head_range(tp.H, 2, rank)
        zero = torch.zeros(tp.LAYERS, tp.T, tp.H, D)
        dst = tp._caches("nvfp4", heads, zero, zero, data[2], data[3])
        past = [read_rows(dst.descriptor(i), tp.SLOTS[n:]) for i in range(tp.LAYERS)]
        assert store.get([dst.descriptor(i) for i in range(tp.LAYERS)], slots, model=tp.MODEL, token_ids=entry,
                         token_range=(0, n), kv_heads=heads)
        a, b = heads
        for layer in range(tp.LAYERS):
            got, want = read_rows(dst.descriptor(layer), slots), read_rows(full.descriptor(layer), slots)
            for name, t in got.items():
                w = want[name][a:b] if name.endswith("global") else want[name][:, a:b]
                assert torch.equal(t.view(torch.uint8), w.contiguous().view(torch.uint8)), (rank, layer, name)
            rest = read_rows(dst.descriptor(layer), tp.SLOTS[n:])  # the tokens past the prefix stay as they were
            assert all(torch.equal(t.view(torch.uint8), past[layer][k].view(torch.uint8)) for k, t in rest.items())


def _age(store: BundleStore, ids: list[int], t: float) -> None:
    os.utime(store.path(MODEL, ids), (t, t))


def test_eviction_is_least_recently_used_under_the_cap(tmp_path):
    root = tmp_path / "kv"
    probe = BundleStore(tmp_path / "probe")
    _put(probe, A)
    size = probe.path(MODEL, A).stat().st_size  # every entry below has as many tokens of as many digits
    store = BundleStore(root, prefix_block=BLOCK, max_bytes=3 * size)
    a, b, c, d = A, [x + 100 for x in A], [x + 200 for x in A], [x + 300 for x in A]
    for ids in (a, b, c):
        _put(store, ids)
    _age(store, a, 1000)
    _age(store, b, 2000)
    _age(store, c, 3000)
    (root / "notes.txt").write_text("mine")  # not the store's: never counted nor deleted
    (root / "x.kvx").write_bytes(b"y" * size)
    assert store.longest_prefix(MODEL, a[:20])[1] == a  # a hit makes `a` the most recently used
    _put(store, d)  # over the cap by one entry: `b`, the least recently used, goes
    assert (MODEL, a) in store and (MODEL, b) not in store and (MODEL, c) in store and (MODEL, d) in store
    assert store.key(MODEL, b) not in set(_links(store).values())  # its links swept
    assert len(_links(store)) == 3 * (T // BLOCK)
    assert (root / "notes.txt").read_text() == "mine" and (root / "x.kvx").read_bytes() == b"y" * size
    assert sum(p.stat().st_size for p in root.iterdir() if p.name.endswith((".kvx", ".kvxset"))
               and len(p.name) > 64) <= 3 * size
    # an entry larger than the whole cap: refused, nothing evicted, nothing left behind
    small = BundleStore(tmp_path / "small", prefix_block=BLOCK, max_bytes=size)
    _put(small, a)
    before = _snapshot(small.root)
    big = list(range(T)) + [1]
    with pytest.raises(KvxError, match="does not fit") as e:
        src = PagedKVCache("nvfp4", num_layers=LAYERS, num_blocks=4, block_size=16, num_kv_heads=H, head_dim=D)
        small.put(_descs(src), torch.arange(T + 1), model=MODEL, token_ids=big)
    assert e.value.status == Status.OUT_OF_RANGE and _snapshot(small.root) == before


def test_eviction_keeps_the_shard_set_being_written(tmp_path):
    """A TP=2 writer's own first shard is never evicted to make room for its second; another set is."""
    data = tp._data(4)
    ids, other = list(range(300, 300 + tp.T)), list(range(350, 350 + tp.T))
    shard = _write_shard(BundleStore(tmp_path / "probe"), ids, data, 0).stat().st_size
    store = BundleStore(tmp_path / "kv", prefix_block=BLOCK, max_bytes=2 * shard + 200)
    for rank in range(2):
        _write_shard(store, other, data, rank)
    for rank in range(2):
        _write_shard(store, ids, data, rank)
    assert (tp.MODEL, ids) in store and (tp.MODEL, other) not in store
    assert store.header(tp.MODEL, ids)["tokens"]["count"] == tp.T
    assert not [p for p in store.root.iterdir() if p.name.startswith(store.key(tp.MODEL, other))]


# ---------------------------------------------------------------------------------------------------- fuzzing
@functools.cache
def _template() -> Path:
    """A store holding A and an entry sharing its first two blocks, with their links (built once per process)."""
    root = Path(tempfile.mkdtemp(prefix="kvx-prefix-fuzz-")) / "kv"
    atexit.register(shutil.rmtree, root.parent, True)  # the fuzz child's template, removed when the child exits
    store = BundleStore(root, prefix_block=BLOCK)
    _put(store, A, seed=1)
    _put(store, A[:16] + list(range(5000, 5000 + T - 16)), seed=2)
    return root


def prefix_index(rng: random.Random) -> None:
    """Forge the marker (JSON mutations) or links (byte mutations, another entry's key, a missing one), then open
    the store and look a prompt up: only a KvxError or a hit whose entry's ids start with the prompt's prefix."""
    src = _template()
    root = Path(tempfile.mkdtemp(prefix="kvx-prefix-case-")) / "kv"
    try:
        shutil.copytree(src, root)
        links = sorted(root.glob("*.kvxp"))
        keys = sorted({p.read_text() for p in links})
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(4)
            if op == 0:
                doc = {"kvx_bundle_store": 1, "prefix_block": BLOCK}
                (root / MARKER).write_bytes(dumps_json(mutate_json(doc, rng)) if rng.random() < 0.9
                                            else dumps_json({"kvx_bundle_store": 1, "prefix_block": DEEP}))
            elif op == 1:
                p = rng.choice(links)
                p.write_bytes(mutate_bytes(p.read_bytes() if p.exists() else b"", rng))
            elif op == 2:
                rng.choice(links).write_text(rng.choice(keys))
            else:
                rng.choice(links).unlink(missing_ok=True)
        store = BundleStore(root)
        prompt = A[:rng.randrange(T + 1)] + OTHER
        n, entry = store.longest_prefix(MODEL, prompt)
        assert (n == 0 and entry is None) or (entry[:n] == prompt[:n] and n <= len(entry)), (n, entry)
    finally:
        shutil.rmtree(root.parent)


def test_fuzz_prefix_index():
    run_capped("tests.transfer.test_store_prefix:prefix_index", cases=1000)
