"""KV bundles of key-smoothed caches (`QuantDesc.k_smoothing`): a bundle carries each layer's smoothing vector
(`k_smoothing`, FP32 [H, D], header `cache.key_smoothing`); a cache of the same format, global scales and smoothing
takes the stored rows bit for bit, any other cache stores what writing the source's reads (decoded keys times s)
stores; a bundle's layers are all smoothed or none, refused before the first byte otherwise."""
from __future__ import annotations

import io

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.transfer import ModelFingerprint, convert_bundle, export_bundle, import_bundle
from kvx_core.transfer.bundle import BundleReader
from kvx_core.transfer.rows import read_rows

LAYERS, HEADS, DIM, TOKENS = 2, 2, 32, 11
MODEL = ModelFingerprint("LlamaForCausalLM", LAYERS, HEADS, DIM, {"rope_theta": 10000.0}, "c" * 64, "t" * 64)
FORMATS = ["nvfp4", "nvfp4_rot", "int4", "k8v4", "mxfp4"]


def _smoothing(seed: int) -> torch.Tensor:
    return torch.rand(HEADS, DIM, generator=torch.Generator().manual_seed(seed)) * 4 + 0.25


def _empty(fmt: str, block_size: int, smooth_seed: int | None, scales_seed: int = 0) -> PagedKVCache:
    """A cache with per-head global scales from `scales_seed` and smoothing vectors from `smooth_seed` + layer
    (None: unsmoothed)."""
    c = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=8, block_size=block_size, num_kv_heads=HEADS, head_dim=DIM,
                     per_head_global_scale=True)
    g = torch.Generator().manual_seed(scales_seed)
    for layer in range(LAYERS):
        if c.layers[layer].k_global is not None:
            c.set_global_scales(layer, torch.rand(HEADS, generator=g) * 0.02 + 0.004,
                                torch.rand(HEADS, generator=g) * 0.02 + 0.004)
        if smooth_seed is not None and c.format.quant.value != "none":
            c.set_key_smoothing(layer, _smoothing(smooth_seed + layer))
    return c


def _slots(block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of TOKENS tokens in random blocks -> (slots, block table row)."""
    blocks = torch.randperm(8, generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(TOKENS)
    return blocks[pos // block_size] * block_size + pos % block_size, blocks[: -(-TOKENS // block_size)]


def _source(fmt: str) -> tuple[PagedKVCache, torch.Tensor, bytes]:
    """A smoothed cache holding K with outlier channels, its slots, and its bundle."""
    c = _empty(fmt, 4, smooth_seed=10)
    slots, _ = _slots(4, 1)
    g = torch.Generator().manual_seed(2)
    for layer in range(LAYERS):
        k = torch.randn(TOKENS, HEADS, DIM, generator=g) * torch.logspace(-1.5, 0.5, DIM)
        c.write(layer, k, torch.randn(TOKENS, HEADS, DIM, generator=g) * 0.3, slots)
    buf = io.BytesIO()
    export_bundle(buf, [c.descriptor(i) for i in range(LAYERS)], slots, model=MODEL)
    return c, slots, buf.getvalue()


def _reads(c: PagedKVCache, block_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's FP32 K/V of the TOKENS tokens at `_slots(block_size, seed)`, through the cache's own gather."""
    _, table = _slots(block_size, seed)
    lens = torch.tensor([TOKENS], dtype=torch.int32)
    return [c.gather(layer, table.view(1, -1).int(), lens) for layer in range(LAYERS)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_smoothing_takes_the_rows_bit_for_bit(fmt):
    src, slots, blob = _source(fmt)
    header = BundleReader(io.BytesIO(blob)).header
    assert header["cache"]["key_smoothing"] is True
    assert {t["name"]: t["shape"] for t in header["tensors"]}["k_smoothing"] == [HEADS, DIM]
    dst = _empty(fmt, 8, smooth_seed=10)  # another block size, the same scales and smoothing
    dst_slots, _ = _slots(8, 3)
    import_bundle(io.BytesIO(blob), [dst.descriptor(i) for i in range(LAYERS)], dst_slots, model=MODEL)
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots), read_rows(dst.descriptor(layer), dst_slots)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    for (ka, va), (kb, vb) in zip(_reads(src, 4, 1), _reads(dst, 8, 3)):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dst_smoothing", [None, 20], ids=["unsmoothed", "other_smoothing"])
def test_another_smoothing_stores_what_writing_the_reads_stores(fmt, dst_smoothing):
    """The oracle: the destination's pools equal those of a cache of its configuration into which the source's
    reads (the cache's own gather: decode, inverse rotation, times s) were written."""
    src, _, blob = _source(fmt)
    dst, ref = (_empty(fmt, 8, smooth_seed=dst_smoothing) for _ in range(2))
    dst_slots, _ = _slots(8, 3)
    import_bundle(io.BytesIO(blob), [dst.descriptor(i) for i in range(LAYERS)], dst_slots, model=MODEL)
    for layer, (k, v) in enumerate(_reads(src, 4, 1)):
        ref.write(layer, k, v, dst_slots)
        a, b = read_rows(ref.descriptor(layer), dst_slots), read_rows(dst.descriptor(layer), dst_slots)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), layer
    smoothed_keys = _reads(src, 4, 1)[0][0]
    assert not torch.allclose(smoothed_keys / _smoothing(10), smoothed_keys)  # s is far from 1: the test can fail


def test_a_bf16_destination_holds_the_source_reads():
    src, _, blob = _source("nvfp4")
    dst = _empty("bf16", 8, smooth_seed=None)
    dst_slots, _ = _slots(8, 3)
    import_bundle(io.BytesIO(blob), [dst.descriptor(i) for i in range(LAYERS)], dst_slots, model=MODEL)
    for (k, v), (kd, vd) in zip(_reads(src, 4, 1), _reads(dst, 8, 3)):
        assert torch.equal(k.bfloat16().float(), kd) and torch.equal(v.bfloat16().float(), vd)


def test_convert_drops_the_smoothing_and_keeps_the_values():
    src, _, blob = _source("nvfp4_rot")
    out = io.BytesIO()
    header = convert_bundle(io.BytesIO(blob), out, "int8")
    assert header["cache"]["key_smoothing"] is False
    assert "k_smoothing" not in {t["name"] for t in header["tensors"]}
    dst, ref = (PagedKVCache("int8", num_layers=LAYERS, num_blocks=8, block_size=8, num_kv_heads=HEADS,
                             head_dim=DIM) for _ in range(2))
    dst_slots, _ = _slots(8, 3)
    import_bundle(io.BytesIO(out.getvalue()), [dst.descriptor(i) for i in range(LAYERS)], dst_slots, model=MODEL)
    for layer, (k, v) in enumerate(_reads(src, 4, 1)):
        ref.write(layer, k, v, dst_slots)
        a, b = read_rows(ref.descriptor(layer), dst_slots), read_rows(dst.descriptor(layer), dst_slots)
        assert all(torch.equal(a[n], b[n]) for n in a), layer


def test_layers_smoothed_or_none():
    c = _empty("nvfp4", 4, smooth_seed=10)
    c.set_key_smoothing(1, None)
    slots, _ = _slots(4, 1)
    out = io.BytesIO()
    with pytest.raises(KvxError) as e:
        export_bundle(out, [c.descriptor(i) for i in range(LAYERS)], slots, model=MODEL)
    assert e.value.status == Status.INVALID_ARGUMENT and "key smoothing" in str(e.value)
    assert out.getvalue() == b""
