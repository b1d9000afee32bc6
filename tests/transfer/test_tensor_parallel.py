"""Tensor-parallel resharding through bundles: each rank exports the KV heads it holds (`kv_heads`); an importer
takes any head range from whichever shards hold it (merge TP2 -> TP1, split TP1 -> TP2, TP2 -> a range across both
ranks). Oracle: the rows of one full cache holding the same K/V, sliced by head."""
from __future__ import annotations

import io

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.transfer import ModelFingerprint, export_bundle, import_bundle
from kvx_core.transfer.rows import read_rows

LAYERS, H, D, T = 2, 4, 32, 19
MODEL = ModelFingerprint("LlamaForCausalLM", LAYERS, H, D, {"rope_theta": 1e4}, "c" * 64, "t" * 64)
SLOTS = torch.arange(3, 3 + T)


def _caches(fmt: str, heads: tuple[int, int], k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor,
            slots: torch.Tensor = SLOTS, block_size: int = 8):
    """A cache of KV heads [a, b) holding those heads of `k`/`v` (and their global scales) at `slots` in every
    layer."""
    a, b = heads
    c = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=32 // block_size, block_size=block_size, num_kv_heads=b - a,
                     head_dim=D, per_head_global_scale=True)
    for layer in range(LAYERS):
        if c.layers[layer].k_global is not None:
            c.set_global_scales(layer, gk[layer, a:b], gv[layer, a:b])
        if k.shape[1]:
            c.write(layer, k[layer][:, a:b], v[layer][:, a:b], slots)
    return c


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(LAYERS, T, H, D, generator=g), torch.randn(LAYERS, T, H, D, generator=g)
    return k, v, torch.rand(LAYERS, H, generator=g) * 0.01 + 0.002, torch.rand(LAYERS, H, generator=g) * 0.01 + 0.002


def _export(c: PagedKVCache, heads) -> bytes:
    buf = io.BytesIO()
    export_bundle(buf, [c.descriptor(i) for i in range(LAYERS)], SLOTS, model=MODEL, kv_heads=heads)
    return buf.getvalue()


def _same_heads(dst: PagedKVCache, full: PagedKVCache, heads) -> None:
    a, b = heads
    for layer in range(LAYERS):
        got, want = read_rows(dst.descriptor(layer), SLOTS), read_rows(full.descriptor(layer), SLOTS)
        for name, t in got.items():
            w = want[name][a:b] if name.endswith("global") else want[name][:, a:b]
            assert torch.equal(t.view(torch.uint8), w.contiguous().view(torch.uint8)), (layer, name)


@pytest.mark.parametrize("fmt", ["int8", "nvfp4", "k8v4"])
@pytest.mark.parametrize("dst_heads", [(0, 4), (2, 4), (1, 3), (3, 4)])
def test_reshard_from_two_ranks(fmt, dst_heads):
    data = _data()
    full = _caches(fmt, (0, H), *data)
    shards = [_export(_caches(fmt, r, *data), r) for r in ((0, 2), (2, 4))]
    dst = _caches(fmt, dst_heads, torch.zeros(LAYERS, T, H, D), torch.zeros(LAYERS, T, H, D), data[2], data[3])
    headers = import_bundle([io.BytesIO(s) for s in shards], [dst.descriptor(i) for i in range(LAYERS)], SLOTS,
                            model=MODEL, kv_heads=dst_heads)
    assert [h["cache"]["kv_heads"] for h in headers] == [[0, 2], [2, 4]]
    _same_heads(dst, full, dst_heads)


def test_split_one_full_bundle_into_a_rank():
    data = _data(1)
    full = _caches("nvfp4", (0, H), *data)
    dst = _caches("nvfp4", (2, 4), torch.zeros(LAYERS, T, H, D), torch.zeros(LAYERS, T, H, D), data[2], data[3])
    import_bundle(io.BytesIO(_export(full, None)), [dst.descriptor(i) for i in range(LAYERS)], SLOTS, model=MODEL,
                  kv_heads=(2, 4))
    _same_heads(dst, full, (2, 4))


def test_missing_overlapping_or_misdeclared_shards_are_refused():
    data = _data(2)
    s0 = _export(_caches("int8", (0, 2), *data), (0, 2))
    s1 = _export(_caches("int8", (1, 3), *data), (1, 3))
    dst = _caches("int8", (0, H), *data)
    before = [t.clone() for t in (dst.layers[0].k_data, dst.layers[1].v_data)]
    descs = [dst.descriptor(i) for i in range(LAYERS)]
    with pytest.raises(KvxError, match=r"no shard holds KV heads \[2, 3\]") as e:
        import_bundle([io.BytesIO(s0)], descs, SLOTS, model=MODEL)
    assert e.value.status == Status.INCOMPATIBLE
    with pytest.raises(KvxError, match="shards overlap"):
        import_bundle([io.BytesIO(s0), io.BytesIO(s1)], descs, SLOTS, model=MODEL)
    with pytest.raises(KvxError, match="kv_heads must be a range"):
        import_bundle([io.BytesIO(s0)], descs, SLOTS, model=MODEL, kv_heads=(3, 2))
    with pytest.raises(KvxError, match="KV heads x 32, KV heads \\[0, 2\\) of the model are 2"):
        export_bundle(io.BytesIO(), descs, SLOTS, model=MODEL, kv_heads=(0, 2))
    assert torch.equal(before[0], dst.layers[0].k_data) and torch.equal(before[1], dst.layers[1].v_data)
