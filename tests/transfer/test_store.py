"""`BundleStore`: offload a sequence's KV to a directory and reload it, also from a new store object on the same
directory (a restart) and into another format; damaged entries refused with the cache untouched; the store never
takes over a directory it did not create."""
from __future__ import annotations

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.transfer import ModelFingerprint
from kvx_core.transfer.rows import read_rows
from kvx_core.transfer.store import MARKER, BundleStore

LAYERS, H, D, T = 2, 2, 32, 40
MODEL = ModelFingerprint("LlamaForCausalLM", LAYERS, H, D, {}, "c" * 64, "t" * 64)
IDS = list(range(7, 7 + T))


def _cache(fmt="nvfp4", fill=False):
    c = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=4, block_size=16, num_kv_heads=H, head_dim=D)
    if fill:
        g = torch.Generator().manual_seed(0)
        for layer in range(LAYERS):
            c.write(layer, torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.arange(T))
    return c


def _descs(c):
    return [c.descriptor(i) for i in range(LAYERS)]


def test_offload_and_reload_across_a_restart(tmp_path):
    src = _cache(fill=True)
    slots = torch.arange(T)
    path = BundleStore(tmp_path / "kv").put(_descs(src), slots, model=MODEL, token_ids=IDS)
    assert path.parent == tmp_path / "kv" and not list((tmp_path / "kv").glob(".tmp-*"))
    store = BundleStore(tmp_path / "kv")  # a new process would open the same directory
    assert (MODEL, IDS) in store and (MODEL, IDS[:-1]) not in store
    dst = _cache()
    back = torch.arange(T) + 20
    assert store.get(_descs(dst), back, model=MODEL, token_ids=IDS)
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots), read_rows(dst.descriptor(layer), back)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    assert not store.get(_descs(dst), back, model=MODEL, token_ids=IDS[:-1])
    into_bf16 = _cache("bf16")
    assert store.get(_descs(into_bf16), slots, model=MODEL, token_ids=IDS)  # converted on reload
    assert store.remove(MODEL, IDS) and not store.remove(MODEL, IDS) and (MODEL, IDS) not in store


def test_a_damaged_entry_is_refused_and_the_cache_untouched(tmp_path):
    store = BundleStore(tmp_path / "kv")
    path = store.put(_descs(_cache(fill=True)), torch.arange(T), model=MODEL, token_ids=IDS)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    dst = _cache(fill=True)
    before = [t.clone() for p in dst.layers for t in (p.k_data, p.v_scales)]
    with pytest.raises(KvxError, match="checksum") as e:
        store.get(_descs(dst), torch.arange(T), model=MODEL, token_ids=IDS)
    assert e.value.status == Status.INVALID_ARGUMENT
    after = [t for p in dst.layers for t in (p.k_data, p.v_scales)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_failed_put_leaves_no_file(tmp_path):
    store = BundleStore(tmp_path / "kv")
    with pytest.raises(KvxError):
        store.put(_descs(_cache(fill=True)), torch.arange(T), model=MODEL, token_ids=IDS[:-1])  # ids != slots
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == [MARKER]


def test_a_foreign_directory_is_never_taken_over(tmp_path):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "a.jpg").write_bytes(b"x")
    with pytest.raises(KvxError, match="did not create") as e:
        BundleStore(mine)
    assert e.value.status == Status.INVALID_ARGUMENT
    assert sorted(p.name for p in mine.iterdir()) == ["a.jpg"] and (mine / "a.jpg").read_bytes() == b"x"
    (tmp_path / "file").write_text("y")
    with pytest.raises(KvxError, match="not a directory"):
        BundleStore(tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    BundleStore(empty)
    assert (empty / MARKER).is_file()


def test_a_store_being_created_by_another_process_is_opened(tmp_path):
    """Ranks of one engine open a new store at once: one may see the directory holding only the other's marker in
    flight (`.tmp-XXXXXXXX.json`, before its rename). That is a store being created, opened; a look-alike name of
    another shape, or beside a user's file, is still a foreign directory."""
    creating = tmp_path / "creating"
    creating.mkdir()
    (creating / ".tmp-ab12_x9z.json").write_bytes(b"{")
    BundleStore(creating)
    assert (creating / MARKER).is_file()
    for names in ([".tmp-ab12_x9z.json", "a.jpg"], [".tmp-abc.json"], [".tmp-ab12_x9z.kvx"]):
        d = tmp_path / f"foreign{len(names)}{names[0][-4:]}"
        d.mkdir()
        for n in names:
            (d / n).write_bytes(b"x")
        with pytest.raises(KvxError, match="did not create"):
            BundleStore(d)
        assert sorted(p.name for p in d.iterdir()) == sorted(names)


def test_header_and_partial_reload(tmp_path):
    """`header` reads an entry's checked header without its chunks; `get(token_range=...)` reloads a slice."""
    src = _cache(fill=True)
    store = BundleStore(tmp_path / "kv")
    assert store.header(MODEL, IDS) is None
    store.put(_descs(src), torch.arange(T), model=MODEL, token_ids=IDS)
    h = store.header(MODEL, IDS)
    assert h["tokens"]["count"] == T and h["tokens"]["ids"] == IDS and h["cache"]["format"] == "nvfp4"
    dst = _cache()
    assert store.get(_descs(dst), torch.arange(10, 20), model=MODEL, token_ids=IDS, token_range=(10, 20))
    for layer in range(LAYERS):
        rows = torch.arange(10, 20)
        a, b = read_rows(src.descriptor(layer), rows), read_rows(dst.descriptor(layer), rows)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
