"""KV bundles of caches with a key transform: smoothing (`QuantDesc.k_smoothing`, s) and centering
(`QuantDesc.k_center`, c), either or both. A bundle carries each layer's vectors (`k_smoothing`, `k_center`: FP32
[H, D]; header `cache.key_smoothing`, `cache.key_centering`); a cache of the same format, global scales and key
transform takes the stored rows bit for bit, any other cache stores what writing the source's reads (decoded keys
times s plus c) stores; a bundle's layers all carry the same transform, refused before the first byte otherwise;
a bundle without `cache.key_centering` (written before it) reads as uncentered, and one whose header hides a
tensor it carries is refused (as a reader that predates the field refuses a centered bundle)."""
from __future__ import annotations

import io

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.transfer import BundleWriter, ModelFingerprint, convert_bundle, export_bundle, import_bundle
from kvx_core.transfer.bundle import BundleReader
from kvx_core.transfer.header import bundle_header
from kvx_core.transfer.rows import read_rows

LAYERS, HEADS, DIM, TOKENS = 2, 2, 32, 11
MODEL = ModelFingerprint("LlamaForCausalLM", LAYERS, HEADS, DIM, {"rope_theta": 10000.0}, "c" * 64, "t" * 64)
FORMATS = ["nvfp4", "nvfp4_rot", "int4", "k8v4", "mxfp4"]

#: A key transform: (smoothing seed, centering seed); None: without that vector.
Transform = tuple[int | None, int | None]
NONE: Transform = (None, None)
SOURCES: dict[str, Transform] = {"smoothed": (10, None), "centered": (None, 30), "centered_smoothed": (10, 30)}
#: Destinations other than the source: none, another vector, one of the two dropped or added.
DESTINATIONS: dict[str, Transform] = {"none": NONE, "other_smoothing": (20, None), "other_center": (None, 40),
                                      "smoothed": (10, None), "centered": (None, 30), "other_both": (20, 40),
                                      "same_smoothing_other_center": (10, 40)}


def _smoothing(seed: int) -> torch.Tensor:
    return torch.rand(HEADS, DIM, generator=torch.Generator().manual_seed(seed)) * 4 + 0.25


def _center(seed: int) -> torch.Tensor:
    """Offsets as large as the keys' outlier channels (so a reader that forgets c is far off)."""
    return torch.randn(HEADS, DIM, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-1, 0.7, DIM)


def _empty(fmt: str, block_size: int, transform: Transform, scales_seed: int = 0) -> PagedKVCache:
    """A cache with per-head global scales from `scales_seed` and, per layer, smoothing / centering vectors from
    their seeds + layer (None: without)."""
    smooth_seed, center_seed = transform
    c = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=8, block_size=block_size, num_kv_heads=HEADS, head_dim=DIM,
                     per_head_global_scale=True)
    g = torch.Generator().manual_seed(scales_seed)
    for layer in range(LAYERS):
        if c.layers[layer].k_global is not None:
            c.set_global_scales(layer, torch.rand(HEADS, generator=g) * 0.02 + 0.004,
                                torch.rand(HEADS, generator=g) * 0.02 + 0.004)
        if c.format.quant.value != "none":
            c.set_key_smoothing(layer, None if smooth_seed is None else _smoothing(smooth_seed + layer))
            c.set_key_center(layer, None if center_seed is None else _center(center_seed + layer))
    return c


def _slots(block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of TOKENS tokens in random blocks -> (slots, block table row)."""
    blocks = torch.randperm(8, generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(TOKENS)
    return blocks[pos // block_size] * block_size + pos % block_size, blocks[: -(-TOKENS // block_size)]


def _reads(c: PagedKVCache, block_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's FP32 K/V of the TOKENS tokens at `_slots(block_size, seed)`, through the cache's own gather."""
    _, table = _slots(block_size, seed)
    lens = torch.tensor([TOKENS], dtype=torch.int32)
    return [c.gather(layer, table.view(1, -1).int(), lens) for layer in range(LAYERS)]


def _source(fmt: str, transform: Transform) -> tuple[PagedKVCache, torch.Tensor, bytes]:
    """A cache with `transform` holding K with outlier channels around an offset, its slots, and its bundle. Its
    reads are checked against the written K (the cache's own reads, the oracle below, add c back)."""
    c = _empty(fmt, 4, transform)
    slots, _ = _slots(4, 1)
    g = torch.Generator().manual_seed(2)
    written = []
    for layer in range(LAYERS):
        k = torch.randn(TOKENS, HEADS, DIM, generator=g) * torch.logspace(-1.5, 0.5, DIM) + _center(99 + layer)
        c.write(layer, k, torch.randn(TOKENS, HEADS, DIM, generator=g) * 0.3, slots)
        written.append(k)
    for layer, (k, (got, _)) in enumerate(zip(written, _reads(c, 4, 1), strict=True)):
        center = c.layers[layer].k_center
        if center is not None:  # closer to K than a read that forgot c
            assert float((got - k).abs().mean()) < float((got - center - k).abs().mean())
    buf = io.BytesIO()
    export_bundle(buf, [c.descriptor(i) for i in range(LAYERS)], slots, model=MODEL)
    return c, slots, buf.getvalue()


def _import(blob: bytes, dst: PagedKVCache, dst_slots: torch.Tensor) -> list[dict]:
    return import_bundle(io.BytesIO(blob), [dst.descriptor(i) for i in range(LAYERS)], dst_slots, model=MODEL)


def _assert_holds_the_reads(src: PagedKVCache, dst: PagedKVCache, transform: Transform, dst_slots: torch.Tensor):
    """The oracle: `dst`'s rows equal those of a fresh cache of its configuration (`transform`) into which the
    source's reads (the cache's own gather: decode, inverse rotation, times s, plus c) were written."""
    ref = _empty(dst.format.name, dst.block_size, transform)
    for layer, (k, v) in enumerate(_reads(src, 4, 1)):
        ref.write(layer, k, v, dst_slots)
        a, b = read_rows(ref.descriptor(layer), dst_slots), read_rows(dst.descriptor(layer), dst_slots)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), layer


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("transform", list(SOURCES.values()), ids=list(SOURCES))
def test_same_transform_takes_the_rows_bit_for_bit(fmt, transform):
    src, slots, blob = _source(fmt, transform)
    header = BundleReader(io.BytesIO(blob)).header
    assert (header["cache"]["key_smoothing"], header["cache"]["key_centering"]) == tuple(
        seed is not None for seed in transform)
    shapes = {t["name"]: t["shape"] for t in header["tensors"] if not t["per_token"]}
    assert [n for n in shapes if n.startswith("k_") and n != "k_global"] == [
        n for n, seed in zip(("k_smoothing", "k_center"), transform, strict=True) if seed is not None]
    assert all(shapes[n] == [HEADS, DIM] for n in ("k_smoothing", "k_center") if n in shapes)
    dst = _empty(fmt, 8, transform)  # another block size, the same scales and transform
    dst_slots, _ = _slots(8, 3)
    _import(blob, dst, dst_slots)
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots), read_rows(dst.descriptor(layer), dst_slots)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    for (ka, va), (kb, vb) in zip(_reads(src, 4, 1), _reads(dst, 8, 3), strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("source, dest",
                         [(s, d) for s in SOURCES for d in DESTINATIONS if SOURCES[s] != DESTINATIONS[d]])
def test_another_transform_stores_what_writing_the_reads_stores(fmt, source, dest):
    src, _, blob = _source(fmt, SOURCES[source])
    dst = _empty(fmt, 8, DESTINATIONS[dest])
    dst_slots, _ = _slots(8, 3)
    _import(blob, dst, dst_slots)
    _assert_holds_the_reads(src, dst, DESTINATIONS[dest], dst_slots)


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("fmt, dst_fmt, dest", [("nvfp4", "int4", NONE), ("nvfp4_rot", "nvfp4", (None, 40)),
                                                 ("int4", "k8v4", (20, 40)), ("mxfp4", "nvfp4_rot", (10, 30)),
                                                 ("k8v4", "mxfp4", (20, None))])
def test_another_format_stores_what_writing_the_reads_stores(source, fmt, dst_fmt, dest):
    src, _, blob = _source(fmt, SOURCES[source])
    dst = _empty(dst_fmt, 8, dest)
    dst_slots, _ = _slots(8, 3)
    _import(blob, dst, dst_slots)
    _assert_holds_the_reads(src, dst, dest, dst_slots)


@pytest.mark.parametrize("transform", list(SOURCES.values()), ids=list(SOURCES))
def test_a_bf16_destination_holds_the_source_reads(transform):
    src, _, blob = _source("nvfp4", transform)
    dst = _empty("bf16", 8, NONE)
    dst_slots, _ = _slots(8, 3)
    _import(blob, dst, dst_slots)
    for (k, v), (kd, vd) in zip(_reads(src, 4, 1), _reads(dst, 8, 3), strict=True):
        assert torch.equal(k.bfloat16().float(), kd) and torch.equal(v.bfloat16().float(), vd)


@pytest.mark.parametrize("transform", list(SOURCES.values()), ids=list(SOURCES))
def test_convert_drops_the_transform_and_keeps_the_values(transform):
    src, _, blob = _source("nvfp4_rot", transform)
    out = io.BytesIO()
    header = convert_bundle(io.BytesIO(blob), out, "int8")
    assert header["cache"]["key_smoothing"] is False and header["cache"]["key_centering"] is False
    assert not {"k_smoothing", "k_center"} & {t["name"] for t in header["tensors"]}
    dst = PagedKVCache("int8", num_layers=LAYERS, num_blocks=8, block_size=8, num_kv_heads=HEADS, head_dim=DIM)
    dst_slots, _ = _slots(8, 3)
    _import(out.getvalue(), dst, dst_slots)
    _assert_holds_the_reads(src, dst, NONE, dst_slots)


@pytest.mark.parametrize("transform, drop, what", [
    ((10, None), "set_key_smoothing", "key smoothing"), ((None, 30), "set_key_center", "key centering"),
    ((10, 30), "set_key_center", "key centering"), ((10, 30), "set_key_smoothing", "key smoothing")])
def test_layers_carry_the_same_transform_or_are_refused(transform, drop, what):
    c = _empty("nvfp4", 4, transform)
    getattr(c, drop)(1, None)
    slots, _ = _slots(4, 1)
    out = io.BytesIO()
    with pytest.raises(KvxError) as e:
        export_bundle(out, [c.descriptor(i) for i in range(LAYERS)], slots, model=MODEL)
    assert e.value.status == Status.INVALID_ARGUMENT and what in str(e.value)
    assert out.getvalue() == b""


def _rewritten(src: PagedKVCache, slots: torch.Tensor, edit) -> bytes:
    """`src`'s bundle with `edit(header["cache"])` applied to its header (the tensors as they are)."""
    header = bundle_header([src.descriptor(i) for i in range(LAYERS)], slots, model=MODEL)
    edit(header["cache"])
    buf = io.BytesIO()
    w = BundleWriter(buf, header)
    for layer in range(LAYERS):
        w.add_layer(read_rows(src.descriptor(layer), slots))
    w.close()
    return buf.getvalue()


@pytest.mark.parametrize("transform", [NONE, (10, None)], ids=["plain", "smoothed"])
def test_a_bundle_without_key_centering_reads_as_uncentered(transform):
    """Bundles written before centering have no `cache.key_centering` (nor `key_smoothing` before smoothing)."""
    src, slots, blob = _source("nvfp4", transform)
    old = _rewritten(src, slots, lambda cache: [cache.pop(k) for k in ("key_centering",
                                                                         "key_smoothing")[:2 - transform.count(10)]])
    assert "key_centering" not in BundleReader(io.BytesIO(old)).header["cache"]
    for dest in (transform, (None, 30)):  # the same transform: bit for bit; a centered cache: re-encoded
        new_dst, old_dst = _empty("nvfp4", 8, dest), _empty("nvfp4", 8, dest)
        dst_slots, _ = _slots(8, 3)
        _import(blob, new_dst, dst_slots)
        _import(old, old_dst, dst_slots)
        for layer in range(LAYERS):
            a, b = read_rows(new_dst.descriptor(layer), dst_slots), read_rows(old_dst.descriptor(layer), dst_slots)
            assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("flag", ["key_centering", "key_smoothing"])
def test_a_header_that_hides_a_key_vector_is_refused(flag):
    """What a reader that predates a flag sees: a tensor its format list lacks. It refuses the bundle (tensor-list
    mismatch) before storing anything, instead of reading (K - c) / s as K."""
    src, slots, _ = _source("nvfp4", (10, 30))
    blob = _rewritten(src, slots, lambda cache: cache.pop(flag))
    dst = _empty("nvfp4", 8, NONE)
    before = [read_rows(dst.descriptor(i), _slots(8, 3)[0]) for i in range(LAYERS)]
    with pytest.raises(KvxError) as e:
        _import(blob, dst, _slots(8, 3)[0])
    assert e.value.status == Status.INVALID_ARGUMENT and "do not match" in str(e.value)
    after = [read_rows(dst.descriptor(i), _slots(8, 3)[0]) for i in range(LAYERS)]
    assert all(torch.equal(a[n], b[n]) for a, b in zip(before, after, strict=True) for n in a)


def test_shards_with_different_transforms_are_refused():
    """Tensor-parallel shards of one sequence must carry the same key transform (their vectors are cut by head)."""
    def shard(center_seed: int | None, heads: tuple[int, int]) -> bytes:
        c = PagedKVCache("nvfp4", num_layers=LAYERS, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=DIM)
        for layer in range(LAYERS):
            c.set_key_center(layer, None if center_seed is None else _center(center_seed)[:1])
        slots, _ = _slots(4, 1)
        for layer in range(LAYERS):
            c.write(layer, torch.randn(TOKENS, 1, DIM), torch.randn(TOKENS, 1, DIM), slots)
        buf = io.BytesIO()
        export_bundle(buf, [c.descriptor(i) for i in range(LAYERS)], slots, model=MODEL, kv_heads=heads)
        return buf.getvalue()

    dst = _empty("nvfp4", 8, NONE)
    shards = [io.BytesIO(shard(30, (0, 1))), io.BytesIO(shard(None, (1, 2)))]
    with pytest.raises(KvxError) as e:
        import_bundle(shards, [dst.descriptor(i) for i in range(LAYERS)], _slots(8, 3)[0], model=MODEL)
    assert e.value.status == Status.INCOMPATIBLE and "key transform" in str(e.value)
    merged = [io.BytesIO(shard(30, (0, 1))), io.BytesIO(shard(31, (1, 2)))]  # both centered: merged
    import_bundle(merged, [dst.descriptor(i) for i in range(LAYERS)], _slots(8, 3)[0], model=MODEL)
