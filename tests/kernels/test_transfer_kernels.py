"""The transfer kernels (`kvx_core.transfer.kernels`, `ops.triton.rows`, `ops.triton.convert`), on CUDA caches on a
CUDA machine and under the Triton interpreter elsewhere: an export through the kernels is the torch export byte for
byte (every format, ragged slots,
block sizes, page-buffer pools, interleaved V scales, key vectors), an import through them stores what the torch
import stores, and a refused export or import changes nothing on either path. The oracle of each comparison is the
torch path (itself tested against the formats' definitions in tests/transfer)."""
from __future__ import annotations

import functools
import io
import random
from contextlib import contextmanager

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.formats import list_formats
from kvx_core.transfer import export_bundle, import_bundle
from kvx_core.transfer.host import export_to_host
from kvx_core.transfer.kernels import kernel_path, use_kernels
from kvx_core.transfer.rows import read_rows

from .. import interpret  # noqa: F401  (the fuzz subprocess imports this module, not the conftest)
from ..fuzz import mutate_bytes, mutate_json, run_capped
from ..transfer import test_bundle as tb, test_engines as engines
from ..transfer.test_bundle import LAYERS, MODEL, _cache, _descs, _snapshot, _unchanged, small  # noqa: F401

PATHS = ("torch", "triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cpu_only = pytest.mark.skipif(DEVICE == "cuda", reason="builds its caches on the CPU (TRT-LLM's interleaved scales, "
                              "key vectors, engine layouts, the fuzz child): the Triton interpreter's case; on CUDA "
                              "the tests above cover the same kernels")


@pytest.fixture(autouse=True)
def _kernel_device(monkeypatch):
    """`_cache`'s pools on DEVICE: the kernels run on CUDA pools on a CUDA machine (a CUDA host does not interpret)."""
    from ..transfer import caches

    monkeypatch.setattr(caches, "DEVICE", DEVICE)


@contextmanager
def _path(path: str):
    """Export / import on `path`; "triton" also lets `ops.dispatch` run its kernels on the CPU (the fused write and
    the kernel pools a conversion needs), as on CUDA."""
    from kvx_core.ops import dispatch

    before = dispatch._kernel_device
    if path == "triton":
        dispatch._kernel_device = lambda device: True
    try:
        with kernel_path(path):
            yield
    finally:
        dispatch._kernel_device = before


@pytest.fixture
def launches(monkeypatch) -> list[tuple[str, int]]:
    """The row kernel's launches in order: ("gather" / "scatter", the layers it moved)."""
    from kvx_core.ops.triton import rows

    seen, kernel = [], rows._rows_kernel

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, SCATTER: bool, **kw):
                seen.append(("scatter" if SCATTER else "gather", grid[1] // rows.MOVES.value))
                kernel[grid](*args, SCATTER=SCATTER, **kw)
            return launch

    monkeypatch.setattr(rows, "_rows_kernel", Counted())
    return seen


@pytest.mark.parametrize("fmt", list_formats())
@pytest.mark.parametrize("page_buffer", [False, True])
def test_bound_layers_move_the_rows_read_rows_gives(fmt, page_buffer):
    """`LayerSet.plan_rows`, the bound path of a staged export and of an import from its staging buffer: the gather
    packs every layer's rows of ragged slots (global scales included) at `i * stride` exactly as `read_rows` gives
    them, and the scatter of tokens [3, 11) of those chunks into another cache (other block size and block order)
    stores exactly those rows at its slots and leaves every other slot as it was."""
    from kvx_core.transfer.bundle import parse_specs, split_chunks
    from kvx_core.transfer.header import bundle_header
    from kvx_core.transfer.host import staged_stride
    from kvx_core.transfer.layer_set import layer_set
    from kvx_core.transfer.views import StorageViews

    src, slots = _cache(fmt, 4, 12, page_buffer=page_buffer, tokens=13)
    dst, others = _cache(fmt, 8, 6, page_buffer=not page_buffer, seed=1, tokens=48)
    descs, targets = _descs(src), _descs(dst)
    _, tokens, specs, _ = parse_specs(bundle_header(descs, slots, model=MODEL))
    stride = staged_stride(sum(s.nbytes(tokens) for s in specs))
    buf = StorageViews(torch.zeros(LAYERS * stride, dtype=torch.uint8, device=DEVICE))
    into = others[torch.randperm(48, generator=torch.Generator().manual_seed(2))[:8]]
    before = [read_rows(d, others) for d in targets]
    with _path("triton"):
        layer_set(descs).plan_rows(layer_set(descs).check_slots(slots).slots, specs, buf, stride, scatter=False)()
        layer_set(targets).plan_rows(layer_set(targets).check_slots(into).slots, specs, buf, stride, scatter=True,
                                     tokens=(3, 11, tokens))()
    bits = functools.partial(torch.Tensor.view, dtype=torch.uint8)
    for i, chunk in enumerate(split_chunks(buf.buf, 0, stride, LAYERS, specs, tokens)):
        want = read_rows(descs[i], slots)
        assert chunk.keys() == want.keys()
        assert all(torch.equal(bits(chunk[n]), bits(want[n])) for n in want)
        after = read_rows(targets[i], others)
        moved = torch.isin(others, into)
        for n, t in after.items():
            if t.dim() == 3:  # per-token rows: the imported tokens at their slots, the rest untouched
                assert torch.equal(bits(t[~moved]), bits(before[i][n][~moved]))
                order = [int((others == s).nonzero()) for s in into]
                assert torch.equal(bits(t[order]), bits(want[n][3:11]))


def _exports(caches, slots, model=MODEL, **kw) -> dict[str, tuple[bytes, bytes]]:
    """{path: (stream bundle, host bundle)} of both paths."""
    out = {}
    for path in PATHS:
        with _path(path):
            stream = io.BytesIO()
            export_bundle(stream, caches, slots, model=model, **kw)
            out[path] = (stream.getvalue(), bytes(export_to_host(caches, slots, model=model, **kw).numpy()))
    return out


def _same_bytes(exports: dict[str, tuple[bytes, bytes]]) -> bool:
    """Both paths write the same stream bundle and the same host bundle. Off CUDA those two are one; from CUDA caches
    the host export declares 64 KiB checksum segments (hashed on the GPU) where the stream declares 8 MiB."""
    pairs = set(exports.values())
    if len(pairs) != 1:
        return False
    ((stream, host),) = pairs
    return DEVICE == "cuda" or stream == host


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
    """Ragged slots over random blocks of 4 tokens, from separate pools and from regions of one page buffer; the
    stream export gathers each layer in a launch of its own, the host export every layer in one launch."""
    src, slots = _cache(fmt, 4, 12, page_buffer=page_buffer, tokens=13)
    assert _same_bytes(_exports(_descs(src), slots, token_ids=list(range(13))))
    assert launches == [("gather", 1)] * LAYERS + [("gather", LAYERS)]


@cpu_only
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


@cpu_only
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
        with _path(path):
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
        with _path(path):
            import_bundle(io.BytesIO(blob), _descs(dst), dst_slots, model=MODEL, **kw)
        out.append(dst)
    return out


def _first_difference(x: torch.Tensor, y: torch.Tensor) -> str:
    """Where two byte views first differ, their counts and the bytes there (a GPU failure says what broke)."""
    xb, yb = x.reshape(-1).view(torch.uint8).cpu(), y.reshape(-1).view(torch.uint8).cpu()
    diff = (xb != yb).nonzero().flatten()
    i = int(diff[0]) if diff.numel() else -1
    return f"{diff.numel()} of {xb.numel()} bytes differ, first at {i}: {int(xb[i]):#04x} vs {int(yb[i]):#04x}"


def _assert_same_pools(a: PagedKVCache, b: PagedKVCache) -> None:
    """Every pool byte equal, except the bits of a NaN in an unquantized payload: those are the device's own (torch
    on the CPU stores 0xFFFF for a BF16 NaN, a GPU 0x7FC0: tests/kernels/test_write_kernel.py's rule)."""
    for n, (x, y) in enumerate(zip(_snapshot(a), _snapshot(b), strict=True)):
        if x.dtype in (torch.bfloat16, torch.float16, torch.float32):
            nan = torch.isnan(x)
            assert torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan].float().view(torch.int32),
                                                                    y[~nan].float().view(torch.int32)), \
                (n, x.dtype, _first_difference(x.nan_to_num(), y.nan_to_num()))
        else:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (n, x.dtype, _first_difference(x, y))


@pytest.mark.parametrize("fmt", list_formats())
def test_kernel_import_of_the_same_format_stores_the_rows(fmt, launches):
    """Same format and global scales: the scatter kernel (one launch for every layer) stores the bundle's rows into
    a page-buffer cache of another block size, exactly where the torch import stores them (and nowhere else)."""
    blob, src, slots = tb._bundle(fmt, tokens=19)

    def dst():
        c = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=12, block_size=4, num_kv_heads=tb.HEADS,
                         head_dim=tb.DIM, per_head_global_scale=True, page_buffer=True, device=DEVICE)
        for layer in range(LAYERS):
            if src.layers[layer].k_global is not None:
                c.set_global_scales(layer, src.layers[layer].k_global, src.layers[layer].v_global)
        return c

    dst_slots = torch.randperm(48, generator=torch.Generator().manual_seed(5))[:19]
    launches.clear()  # on CUDA the bundle's export above ran the gather kernel
    torch_dst, kernel_dst = _import_both(blob, dst, dst_slots)
    assert launches == [("scatter", LAYERS)]
    _assert_same_pools(kernel_dst, torch_dst)
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots), read_rows(kernel_dst.descriptor(layer), dst_slots)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


@cpu_only
def test_kernel_import_of_a_token_range_and_interleaved_v_scales():
    from ..cache.test_scale_layout import _cache as interleaved

    blob, src, slots = tb._bundle("nvfp4", tokens=12)
    dsts = []
    for path in PATHS:
        caches = [interleaved(3, 8)[0] for _ in range(LAYERS)]
        for c, pools in zip(caches, src.layers, strict=True):
            c.quant.k_global_scale.copy_(pools.k_global.expand(tb.HEADS))
            c.quant.v_global_scale.copy_(pools.v_global.expand(tb.HEADS))
        with _path(path):
            import_bundle(io.BytesIO(blob), caches, torch.tensor([17, 3, 8, 9, 10, 23, 0]), model=MODEL,
                          token_range=(5, 12))
        dsts.append(caches)
    for a, b in zip(*dsts, strict=True):
        for x, y in ((a.k.tensor, b.k.tensor), (a.v.tensor, b.v.tensor), (a.quant.k_scales.tensor,
                     b.quant.k_scales.tensor), (a.quant.v_scales.tensor, b.quant.v_scales.tensor)):
            assert torch.equal(x, y)
    assert any(bool(c.quant.v_scales.tensor.any()) for c in dsts[1])


@pytest.fixture(autouse=True)
def _triton_for_the_imported_tests(request):
    """The imported torch-path tests below run on the kernel path."""
    if request.function.__module__ == tb.__name__:
        with _path("triton"):
            yield
    else:
        yield


# The import's all-or-nothing guarantees and conversions, on the kernel path (tests/transfer/test_bundle.py's own):
test_a_destination_failing_in_its_last_layer_changes_no_layer = (
    tb.test_a_destination_failing_in_its_last_layer_changes_no_layer)
test_token_range_stores_only_those_tokens_bit_identically = tb.test_token_range_stores_only_those_tokens_bit_identically
test_an_empty_sequence_round_trips = tb.test_an_empty_sequence_round_trips
test_conversion_equals_writing_the_dequantized_kv = tb.test_conversion_equals_writing_the_dequantized_kv


ENGINES = sorted(engines.ENGINES)


@cpu_only
@pytest.mark.parametrize("src_name", ENGINES)
def test_kernel_export_from_engine_layouts_is_the_torch_export(src_name):
    """vLLM NHD / HND / x-packed (HND_PACKED) / FP8 / plugin pages, TGI, TensorRT-LLM's primary pool, FlashInfer,
    KVX pages: the kernel gather reads each layout's strides as torch does."""
    bs, caches = engines._make(src_name)
    _, slots = engines._table(bs, 1)
    engines._fill(caches, slots, 2)
    assert _same_bytes(_exports(caches, slots, model=engines.MODEL))


@cpu_only
@pytest.mark.parametrize("src_name", ENGINES)
def test_kernel_handoff_between_engine_layouts(src_name):
    """tests/transfer/test_engines.py's handoff on the kernel path, each layout into itself and the next one (the
    whole matrix: the slow test below)."""
    i = ENGINES.index(src_name)
    for dst_name in (src_name, ENGINES[(i + 1) % len(ENGINES)]):
        with _path("triton"):
            engines.test_handoff_between_engine_layouts(src_name, dst_name)


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("src_name", ENGINES)
def test_kernel_handoff_between_every_pair_of_engine_layouts(src_name):
    for dst_name in ENGINES:
        with _path("triton"):
            engines.test_handoff_between_engine_layouts(src_name, dst_name)


SPECIALS = torch.tensor([0.0, -0.0, 1e-40, -1e-41, 6e-8, 1.0, -2.5, 3e38, -3e38, 65504.0, 1e5, 448.0, 500.0,
                         float("inf"), float("-inf"), float("nan")])
"""Plain-format source values: zeros, FP32 / FP16 subnormals, huge, the FP16 / E4M3 maxima and beyond, inf, NaN."""


def _adversarial(fmt: str, seed: int) -> tuple[bytes, PagedKVCache, torch.Tensor]:
    """A bundle of 16 tokens whose stored rows are adversarial: plain formats hold `SPECIALS` (every value in every
    head, rolled per token), quantized ones random bytes in payload and scale pools (every code and scale byte,
    E4M3 / FP16 NaN and inf scales included); global scales valid (a bundle's are checked)."""
    src, slots = _cache(fmt, 4, 6, seed=seed)
    slots = torch.randperm(24, generator=torch.Generator().manual_seed(seed))[:16]
    g = torch.Generator().manual_seed(seed)
    for pools in src.layers:
        for t in (pools.k_data, pools.v_data, pools.k_scales, pools.v_scales):
            if t is None:
                continue
            if t.dtype in (torch.bfloat16, torch.float16, torch.float32):
                n = t.numel()
                vals = SPECIALS[torch.randint(0, SPECIALS.numel(), (n,), generator=g)]
                t.copy_(vals.to(t.dtype).reshape(t.shape))
            else:
                t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8).view(
                    t.view(torch.uint8).shape))
    buf = io.BytesIO()
    export_bundle(buf, _descs(src), slots, model=MODEL)
    return buf.getvalue(), src, slots


@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    """The conversion kernels launched ("fused": decode + encode in one, "decode": decode only)."""
    from kvx_core.ops.triton import convert

    seen, launch = [], convert._launch

    def spy(src, rows, d, hkv, out, encode, block_t):
        seen.append("decode" if encode is None else "fused")
        return launch(src, rows, d, hkv, out, encode, block_t)

    monkeypatch.setattr(convert, "_launch", spy)
    return seen


FORMATS = list_formats()


def _check_conversions(src_fmt: str, dst_fmts: list[str], seen: list[str]) -> None:
    """Import an adversarial bundle of `src_fmt` into a cache of each of `dst_fmts` (another format, or its own under
    other global scales) on both paths: the same pools (`_assert_same_pools`). Without rotation or key transform
    the fused kernel serves (one launch per layer), else the decode kernel and the fused write."""
    blob, _, _ = _adversarial(src_fmt, seed=len(src_fmt))
    dst_slots = torch.randperm(24, generator=torch.Generator().manual_seed(3))[:16]
    for dst_fmt in dst_fmts:
        seen.clear()
        torch_dst, kernel_dst = _import_both(blob, lambda: _cache(dst_fmt, 8, 3, seed=7)[0], dst_slots)
        try:
            _assert_same_pools(kernel_dst, torch_dst)
        except AssertionError as e:
            raise AssertionError(f"{src_fmt} -> {dst_fmt}: {e}") from None
        fused = not (src_fmt.endswith("_rot") or dst_fmt.endswith("_rot"))
        if dst_fmt != src_fmt or kernel_dst.layers[0].k_global is not None:
            assert seen == ["fused" if fused else "decode"] * LAYERS, (src_fmt, dst_fmt, seen)


@pytest.mark.parametrize("src_fmt", FORMATS)
def test_kernel_conversion_is_the_torch_conversion_bit_for_bit(src_fmt, conversions):
    """Each source format into its own (other global scales) and the next two formats of the registry: every
    format is a source and a destination three times (the whole matrix: the slow test below)."""
    i = FORMATS.index(src_fmt)
    _check_conversions(src_fmt, [FORMATS[(i + k) % len(FORMATS)] for k in range(3)], conversions)


@pytest.mark.slow
@pytest.mark.parametrize("src_fmt", FORMATS)
def test_every_conversion_pair_is_the_torch_conversion(src_fmt, conversions):
    _check_conversions(src_fmt, FORMATS, conversions)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "k8v4", "nvfp4"])
def test_the_e4m3_decoder_keeps_the_sign_of_zero(fmt):
    """Byte 0x80 (E4M3 -0, as a payload or an NVFP4 scale) decodes to -0.0 as torch does: the kernels' decoder set
    the sign by unary minus (`0 - x` in Triton), giving +0.0, so a -0 row re-encoded as BF16 lost its sign bit."""
    from kvx_core.formats import get_format
    from kvx_core.ops.triton.convert import decode_rows

    f = get_format(fmt)
    every = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    rows = {}
    for w, tf in (("k", f.k), ("v", f.v)):
        rows[f"{w}_data"] = every.reshape(16, 1, 16).repeat(1, 1, 2 if tf.payload_dim(32) == 32 else 1)
        rows[f"{w}_data"] = rows[f"{w}_data"].view(tf.torch_data_dtype)
        if tf.scale_dim(32):
            rows[f"{w}_scales"] = every.reshape(128, 1, 2)[:16]
        if tf.uses_global_scale:
            rows[f"{w}_global"] = torch.tensor([0.5], device=DEVICE)
    got = decode_rows(f, rows, 32)
    for x, (w, tf) in zip(got, (("k", f.k), ("v", f.v)), strict=True):
        scales = rows.get(f"{w}_scales", torch.empty(16, 1, 0, dtype=torch.uint8, device=DEVICE))
        want = tf.decode(rows[f"{w}_data"], scales, rows.get(f"{w}_global"))
        nan = torch.isnan(want)
        assert torch.equal(nan, torch.isnan(x)) and torch.equal(x[~nan].view(torch.int32), want[~nan].view(torch.int32))
        assert bool((torch.signbit(x) & (x == 0)).any())


@pytest.fixture
def flag_reads(monkeypatch) -> list[int]:
    """The batched host syncs of an import (`schema.read_flags`): how many device flags each read."""
    from kvx_core.transfer import handoff, host, schema

    seen, read = [], schema.read_flags

    def spy(flags):
        seen.append(len(flags))
        return read(flags)

    for m in (handoff, host, schema):
        monkeypatch.setattr(m, "read_flags", spy, raising=False)
    return seen


@pytest.mark.parametrize("path", PATHS)
def test_an_import_checks_its_layers_with_one_host_sync_each_kind(path, flag_reads, monkeypatch):
    """A host bundle's layer checks (global scales, key vectors) and the destination's scale checks and row
    comparisons each read every layer's flags at once, never a check per layer: two host syncs per bundle, each
    reading flags of tensors stacked over the layers (as many whatever the layer count)."""
    from kvx_core.transfer import schema

    src, slots = _cache("nvfp4", 16, 4, tokens=9)
    host = export_to_host(_descs(src), slots, model=MODEL)
    dst, _ = _cache("nvfp4", 16, 4, seed=4)
    for layer in range(LAYERS):
        dst.set_global_scales(layer, src.layers[layer].k_global, src.layers[layer].v_global)
    monkeypatch.setattr(schema, "check_layer", lambda *a: pytest.fail("a layer checked alone"))
    with _path(path):
        import_bundle(host, _descs(dst), torch.arange(9), model=MODEL)
    # the bundle's k_global and v_global; the destination's scales, then its k_global and v_global against them
    assert flag_reads == [2, 3]


@pytest.mark.parametrize("path", PATHS)
def test_an_import_into_layers_of_mixed_scales_copies_the_matching_layers_and_converts_the_others(path):
    """The sameness of every layer is compared at once (tensors stacked over the layers), yet decided per layer: a
    layer whose destination has the bundle's scales stores the rows as bundled; one whose V scales differ stores
    what writing the bundle's decoded K/V into it stores (the reference write: the oracle)."""
    from kvx_core.descriptors import KvIoDesc, SlotMapping, WriteDesc
    from kvx_core.formats import get_format
    from kvx_core.ops.reference import write_kv
    from kvx_core.transfer.handoff import decode_rows

    src, slots = _cache("nvfp4", 16, 4, tokens=9)
    host = export_to_host(_descs(src), slots, model=MODEL)
    dst, _ = _cache("nvfp4", 16, 4, seed=4)
    oracle, _ = _cache("nvfp4", 16, 4, seed=4)
    for layer in range(LAYERS):
        s = src.layers[layer]
        for c in (dst, oracle):
            c.set_global_scales(layer, s.k_global, s.v_global if layer % 2 == 0 else s.v_global * 2)
    at = torch.arange(9)
    with _path(path):
        import_bundle(host, _descs(dst), at, model=MODEL)
    for layer in range(LAYERS):
        got = read_rows(dst.descriptor(layer), at)
        if layer % 2 == 0:
            want = read_rows(src.descriptor(layer), slots)
        else:
            k, v = decode_rows(read_rows(src.descriptor(layer), slots), get_format("nvfp4"))
            write_kv(oracle.descriptor(layer), WriteDesc(KvIoDesc(k, v), SlotMapping(at)))
            want = read_rows(oracle.descriptor(layer), at)
            assert not torch.equal(got["v_scales"], read_rows(src.descriptor(layer), slots)["v_scales"])
        assert all(torch.equal(got[n], want[n]) for n in ("k_data", "v_data", "k_scales", "v_scales"))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name, value", [("k_global", 0.0), ("v_global", float("nan")), ("k_global", -1.0)])
def test_a_forged_scale_in_the_last_layer_of_a_host_bundle_is_refused_by_name(path, name, value):
    """Checksums recomputed (a forger's bundle): the batched check finds the layer and reports it as the per-layer
    check does; the destination is untouched."""
    from ..transfer.forge import build, split, tensor_at

    blob, _, _ = tb._bundle("nvfp4", tokens=5)
    header, payloads = split(blob)
    a, b = tensor_at(header, name)
    last = bytearray(payloads[-1])
    last[a:b] = torch.full(((b - a) // 4,), value).numpy().tobytes()
    payloads[-1] = bytes(last)
    forged = torch.frombuffer(bytearray(build(header, payloads)), dtype=torch.uint8)
    dst, _ = _cache("nvfp4", 16, 4, seed=9, tokens=10)
    before = _snapshot(dst)
    with _path(path), pytest.raises(KvxError) as e:
        import_bundle(forged, _descs(dst), torch.arange(5), model=MODEL)
    assert e.value.status == Status.INVALID_ARGUMENT and f"layer {LAYERS - 1}'s {name}" in e.value.message
    assert _unchanged(dst, before)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("src_fmt", ["nvfp4", "bf16"])
def test_a_destination_with_a_bad_global_scale_in_its_last_layer_changes_nothing(path, src_fmt):
    """The destination's own scales are checked for every layer (batched) before any layer stores: same format or
    a conversion, the import is refused naming the scale, and no pool changes."""
    blob, _, _ = tb._bundle(src_fmt, tokens=5)
    dst, _ = _cache("nvfp4", 16, 4, seed=9, tokens=10)
    dst.layers[-1].v_global.fill_(float("inf"))
    before = _snapshot(dst)
    with _path(path), pytest.raises(KvxError) as e:
        import_bundle(io.BytesIO(blob), _descs(dst), torch.arange(5), model=MODEL)
    assert e.value.status == Status.INVALID_ARGUMENT and "v_global_scale" in e.value.message
    assert _unchanged(dst, before)


@functools.cache
def _plain_bf16() -> bytes:
    return tb._bundle("bf16", tokens=3)[0]


def kernel_imports(rng: random.Random) -> None:
    """A forged bundle (raw damage with stale checksums, or header / payload edits with checksums recomputed) imported
    on the kernel path, from a stream or a host tensor, into an NVFP4 destination: the key-transformed NVFP4 bundle
    of tests/transfer/test_fuzz_transfer.py (decode kernel + fused write) or a plain BF16 one (fused conversion
    kernel). KvxError or success; a refused import changes nothing."""
    from ..transfer.forge import build, split
    from ..transfer.test_fuzz_transfer import _forged, _import_or_unchanged

    if rng.random() < 0.5:
        data = _forged(rng)
    else:
        header, payloads = split(_plain_bf16())
        data = mutate_bytes(build(header, payloads), rng) if rng.random() < 0.5 else build(
            mutate_json(header, rng), [mutate_bytes(p, rng) if rng.random() < 0.3 else p for p in payloads])
    with _path("triton"):
        _import_or_unchanged(io.BytesIO(data) if rng.random() < 0.5 or not data
                             else torch.frombuffer(bytearray(data), dtype=torch.uint8))


@cpu_only
def test_fuzz_kernel_imports():
    run_capped("tests.kernels.test_transfer_kernels:kernel_imports", cases=100)


def test_layers_of_other_geometries_or_shared_pools_scatter_in_launches_of_their_own(launches):
    """An import's same-format layers scatter in one launch per geometry (block size, strides); a layer whose pools
    share a storage with a layer of that launch (here: the same cache given twice) goes in a later launch, so the
    later layer's rows land last, as the torch path stores them (the oracle: every pool equal)."""
    from kvx_core.transfer import ModelFingerprint

    model = ModelFingerprint("LlamaForCausalLM", 4, tb.HEADS, tb.DIM, {}, "c" * 64, "t" * 64)

    def caches(seed: int) -> tuple[PagedKVCache, PagedKVCache]:
        a = PagedKVCache("bf16", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=tb.HEADS, head_dim=tb.DIM,
                         device=DEVICE)
        b = PagedKVCache("bf16", num_layers=1, num_blocks=32, block_size=4, num_kv_heads=tb.HEADS, head_dim=tb.DIM,
                         device=DEVICE)
        g = torch.Generator().manual_seed(seed)
        for c, layers in ((a, 2), (b, 1)):
            for layer in range(layers):
                kv = torch.randn(2, 120, tb.HEADS, tb.DIM, generator=g)
                c.write(layer, kv[0].to(DEVICE), kv[1].to(DEVICE), torch.arange(120, device=DEVICE))
        return a, b

    src = PagedKVCache("bf16", num_layers=4, num_blocks=8, block_size=16, num_kv_heads=tb.HEADS, head_dim=tb.DIM,
                       device=DEVICE)
    g = torch.Generator().manual_seed(1)
    for layer in range(4):
        kv = torch.randn(2, 21, tb.HEADS, tb.DIM, generator=g)
        src.write(layer, kv[0].to(DEVICE), kv[1].to(DEVICE), torch.arange(21, device=DEVICE))
    with _path("torch"):
        bundle = export_to_host([src.descriptor(i) for i in range(4)], torch.arange(21), model=model)
    at = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:21]
    got = {}
    for path in PATHS:
        a, b = caches(3)
        launches.clear()
        with _path(path):
            import_bundle(bundle, [a.descriptor(0), a.descriptor(1), b.descriptor(0), a.descriptor(0)], at,
                          model=model)
            last = read_rows(a.descriptor(0), at)
        with _path("torch"):  # the cache given twice holds the rows of the later layer, bundled layer 3
            want = read_rows(src.descriptor(3), torch.arange(21))
        assert all(torch.equal(last[n], want[n]) for n in ("k_data", "v_data")), path
        got[path] = [t.clone() for c in (a, b) for p in c.layers for t in (p.k_data, p.v_data)]
        if path == "triton":
            assert launches == [("scatter", 2), ("scatter", 1), ("scatter", 1)]
    assert all(torch.equal(x, y) for x, y in zip(*got.values(), strict=True))
