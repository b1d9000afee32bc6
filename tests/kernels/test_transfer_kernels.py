"""The transfer kernels (`kvx_core.transfer.kernels`, `ops.triton.rows`, `ops.triton.convert`), run under the Triton
interpreter off CUDA: an export through the kernels is the torch export byte for byte (every format, ragged slots,
block sizes, page-buffer pools, interleaved V scales, key vectors), an import through them stores what the torch
import stores, and a refused export or import changes nothing on either path. The oracle of each comparison is the
torch path (itself tested against the formats' definitions in tests/transfer)."""
from __future__ import annotations

import io

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.formats import list_formats
from kvx_core.transfer import export_bundle, import_bundle
from kvx_core.transfer.host import export_to_host
from kvx_core.transfer.kernels import kernel_path, use_kernels
from kvx_core.transfer.rows import read_rows

from ..transfer import test_bundle as tb
from ..transfer.test_bundle import LAYERS, MODEL, _cache, _descs, _snapshot, _unchanged, small  # noqa: F401

PATHS = ("torch", "triton")


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """The row kernels launched ("gather" / "scatter"), in order."""
    from kvx_core.ops.triton import rows

    seen, move = [], rows.move_rows

    def spy(*a, scatter: bool, **kw):
        seen.append("scatter" if scatter else "gather")
        return move(*a, scatter=scatter, **kw)

    monkeypatch.setattr(rows, "move_rows", spy)
    return seen


def _exports(caches, slots, **kw) -> dict[str, tuple[bytes, bytes]]:
    """{path: (stream bundle, host bundle)} of both paths."""
    out = {}
    for path in PATHS:
        with kernel_path(path):
            stream = io.BytesIO()
            export_bundle(stream, caches, slots, model=MODEL, **kw)
            out[path] = (stream.getvalue(), bytes(export_to_host(caches, slots, model=MODEL, **kw).numpy()))
    return out


def _same_bytes(exports: dict[str, tuple[bytes, bytes]]) -> bool:
    return len({b for pair in exports.values() for b in pair}) == 1


def test_the_kernels_serve_cuda_and_the_override():
    assert not use_kernels("cpu") and use_kernels("cuda")
    with kernel_path("triton"):
        assert use_kernels("cpu")
        with kernel_path("torch"):
            assert not use_kernels("cpu")
        assert use_kernels("cpu")
    with pytest.raises(KvxError) as e, kernel_path("cuda"):
        pass
    assert e.value.status == Status.INVALID_ARGUMENT


@pytest.mark.parametrize("fmt", list_formats())
@pytest.mark.parametrize("page_buffer", [False, True])
def test_kernel_export_is_the_torch_export_byte_for_byte(fmt, page_buffer, launches):
    """Ragged slots over random blocks of 4 tokens, from separate pools and from regions of one page buffer; one
    gather launch per layer."""
    src, slots = _cache(fmt, 4, 12, page_buffer=page_buffer, tokens=13)
    assert _same_bytes(_exports(_descs(src), slots, token_ids=list(range(13))))
    assert launches == ["gather"] * 2 * LAYERS


def test_kernel_export_of_interleaved_v_scales_and_hnd_pools():
    """TRT-LLM's NVFP4 pools: HND, V scales interleaved by 4 tokens (`scale_layout`)."""
    from ..cache.test_scale_layout import _cache as interleaved

    caches = [interleaved(3, 8)[0] for _ in range(LAYERS)]
    slots = torch.tensor([17, 3, 8, 9, 10, 23, 0])
    g = torch.Generator().manual_seed(1)
    for c in caches:
        for t in (c.k.tensor, c.v.tensor, c.quant.k_scales.tensor, c.quant.v_scales.tensor):
            t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    assert _same_bytes(_exports(caches, slots))


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_rot"])
def test_kernel_export_carries_the_key_vectors(fmt):
    from ..transfer.test_bundle_smoothing import _source

    src, slots, _ = _source(fmt, (10, 30))
    assert _same_bytes(_exports(_descs(src), slots))


@pytest.mark.parametrize("slots", [torch.tensor([0, -1, 2]), torch.tensor([0, 64]), torch.tensor([3, 3]),
                                   torch.tensor([0.0, 1.0])])
def test_kernel_export_refuses_what_the_torch_export_refuses_writing_nothing(slots):
    """A negative, out-of-range, repeated or non-integer slot: the same KvxError on both paths, nothing written
    (the stream stays empty, the caller's buffer keeps its bytes)."""
    src, _ = _cache("nvfp4", 16, 4, tokens=9)
    errors = []
    for path in PATHS:
        with kernel_path(path):
            out, buf = io.BytesIO(), torch.full((1 << 16,), 7, dtype=torch.uint8)
            with pytest.raises(KvxError) as e:
                export_bundle(out, _descs(src), slots, model=MODEL)
            with pytest.raises(KvxError):
                export_to_host(_descs(src), slots, model=MODEL, out=buf)
            assert out.getvalue() == b"" and (buf == 7).all()
            errors.append((e.value.status, e.value.message))
    assert errors[0] == errors[1] and errors[0][0] in (Status.OUT_OF_RANGE, Status.INVALID_ARGUMENT)


def test_kernel_export_of_an_empty_sequence():
    src, _ = _cache("int8", 16, 4, tokens=5)
    assert _same_bytes(_exports(_descs(src), torch.empty(0, dtype=torch.int64)))


def _import_both(blob, make_dst, dst_slots, **kw) -> list[PagedKVCache]:
    """The destination caches `make_dst()` after importing `blob` on each path."""
    out = []
    for path in PATHS:
        dst = make_dst()
        with kernel_path(path):
            import_bundle(io.BytesIO(blob), _descs(dst), dst_slots, model=MODEL, **kw)
        out.append(dst)
    return out


def _assert_same_pools(a: PagedKVCache, b: PagedKVCache) -> None:
    assert _unchanged(a, _snapshot(b))


@pytest.mark.parametrize("fmt", list_formats())
def test_kernel_import_of_the_same_format_stores_the_rows(fmt, launches):
    """Same format and global scales: the scatter kernel (one launch per layer) stores the bundle's rows into a
    page-buffer cache of another block size, exactly where the torch import stores them (and nowhere else)."""
    blob, src, slots = tb._bundle(fmt, tokens=19)

    def dst():
        c = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=12, block_size=4, num_kv_heads=tb.HEADS,
                         head_dim=tb.DIM, per_head_global_scale=True, page_buffer=True)
        for layer in range(LAYERS):
            if src.layers[layer].k_global is not None:
                c.set_global_scales(layer, src.layers[layer].k_global, src.layers[layer].v_global)
        return c

    dst_slots = torch.randperm(48, generator=torch.Generator().manual_seed(5))[:19]
    torch_dst, kernel_dst = _import_both(blob, dst, dst_slots)
    assert launches == ["scatter"] * LAYERS
    _assert_same_pools(kernel_dst, torch_dst)
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots), read_rows(kernel_dst.descriptor(layer), dst_slots)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_kernel_import_of_a_token_range_and_interleaved_v_scales():
    from ..cache.test_scale_layout import _cache as interleaved

    blob, src, slots = tb._bundle("nvfp4", tokens=12)
    dsts = []
    for path in PATHS:
        caches = [interleaved(3, 8)[0] for _ in range(LAYERS)]
        for c, pools in zip(caches, src.layers):
            c.quant.k_global_scale.copy_(pools.k_global.expand(tb.HEADS))
            c.quant.v_global_scale.copy_(pools.v_global.expand(tb.HEADS))
        with kernel_path(path):
            import_bundle(io.BytesIO(blob), caches, torch.tensor([17, 3, 8, 9, 10, 23, 0]), model=MODEL,
                          token_range=(5, 12))
        dsts.append(caches)
    for a, b in zip(*dsts):
        for x, y in ((a.k.tensor, b.k.tensor), (a.v.tensor, b.v.tensor), (a.quant.k_scales.tensor,
                     b.quant.k_scales.tensor), (a.quant.v_scales.tensor, b.quant.v_scales.tensor)):
            assert torch.equal(x, y)
    assert any(bool(c.quant.v_scales.tensor.any()) for c in dsts[1])


@pytest.fixture(autouse=True)
def _triton_for_the_imported_tests(request):
    """The imported torch-path tests below run on the kernel path."""
    if request.function.__module__ == tb.__name__:
        with kernel_path("triton"):
            yield
    else:
        yield


# The import's all-or-nothing guarantees, on the kernel path (tests/transfer/test_bundle.py's own tests):
test_a_destination_failing_in_its_last_layer_changes_no_layer = tb.test_a_destination_failing_in_its_last_layer_changes_no_layer
test_token_range_stores_only_those_tokens_bit_identically = tb.test_token_range_stores_only_those_tokens_bit_identically
test_an_empty_sequence_round_trips = tb.test_an_empty_sequence_round_trips
test_conversion_equals_writing_the_dequantized_kv = tb.test_conversion_equals_writing_the_dequantized_kv
