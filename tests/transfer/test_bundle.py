"""KVX bundles (`kvx_core.transfer`): exact round trips across block sizes and layouts for every format,
conversions equal to writing the source's dequantized K/V, and refusal of every corruption with the destination
left untouched."""
from __future__ import annotations

import io
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.formats import list_formats
from kvx_core.transfer import export_bundle, import_bundle
from kvx_core.transfer.bundle import BundleReader
from kvx_core.transfer.rows import read_rows

from .caches import DIM, HEADS, LAYERS, MODEL, _cache, _descs, _snapshot, _unchanged  # noqa: F401


def _bundle(fmt: str = "int8", tokens: int = 5, **kw) -> tuple[bytes, PagedKVCache, torch.Tensor]:
    src, slots = _cache(fmt, 16, 4, tokens=tokens, **kw)
    buf = io.BytesIO()
    export_bundle(buf, _descs(src), slots, model=MODEL, token_ids=list(range(100, 100 + tokens)))
    return buf.getvalue(), src, slots




@pytest.mark.parametrize("fmt", list_formats())
def test_round_trip_is_bit_identical_across_block_sizes_and_layouts(fmt):
    """Same format and global scales: the destination stores the source's bytes, whatever its block size
    (16 -> 4) and pool layout (separate pools -> one page buffer)."""
    blob, src, slots = _bundle(fmt, tokens=37)
    dst = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=20, block_size=4, num_kv_heads=HEADS, head_dim=DIM,
                       per_head_global_scale=True, page_buffer=True)
    for layer in range(LAYERS):
        if src.layers[layer].k_global is not None:
            dst.set_global_scales(layer, src.layers[layer].k_global, src.layers[layer].v_global)
    dst_slots = torch.randperm(80, generator=torch.Generator().manual_seed(5))[:37]
    (header,) = import_bundle(io.BytesIO(blob), _descs(dst), dst_slots, model=MODEL, token_ids=list(range(100, 137)))
    assert header["cache"]["format"] == fmt
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots), read_rows(dst.descriptor(layer), dst_slots)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), (fmt, layer, name)


@pytest.mark.parametrize("src_fmt, dst_fmt", [("bf16", "nvfp4"), ("nvfp4", "bf16"), ("int8", "int4_rot"),
                                              ("nvfp4_rot", "fp8_e4m3"), ("mxfp4", "k8v4"), ("nvfp4", "nvfp4")])
def test_conversion_equals_writing_the_dequantized_kv(src_fmt, dst_fmt):
    """Another format, or the same one under other global scales (nvfp4 -> nvfp4 here: the destination keeps its
    own): the destination holds exactly what writing the source's gathered (dequantized) K/V gives."""
    blob, src, slots = _bundle(src_fmt, tokens=21)
    dst, _ = _cache(dst_fmt, 8, 6, seed=3)
    oracle, _ = _cache(dst_fmt, 8, 6, seed=3)
    dst_slots = torch.arange(40, 19, -1)
    import_bundle(io.BytesIO(blob), _descs(dst), dst_slots, model=MODEL)
    dev = src.layers[0].k_data.device  # the kernel tests run these caches on CUDA
    table = (slots[::16] // 16).to(torch.int32).view(1, -1).to(dev)
    for layer in range(LAYERS):
        k, v = src.gather(layer, table, torch.tensor([21], dtype=torch.int32, device=dev))
        oracle.write(layer, k, v, dst_slots.to(dev))
        a, b = read_rows(dst.descriptor(layer), dst_slots), read_rows(oracle.descriptor(layer), dst_slots)
        for name in a:
            assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), (src_fmt, dst_fmt, name)


REFUSED = (Status.INVALID_ARGUMENT, Status.UNSUPPORTED, Status.INCOMPATIBLE)


def _refused(blob: bytes, dst: PagedKVCache, slots: torch.Tensor, match: str | None = None, **kw) -> KvxError:
    with pytest.raises(KvxError, match=match) as e:
        import_bundle(io.BytesIO(blob), _descs(dst), slots, model=kw.pop("model", MODEL), **kw)
    assert e.value.status in REFUSED
    return e.value


@pytest.fixture(scope="module")
def small():
    """A 2-layer, 3-token NVFP4 bundle (every section present: payloads, scales, global scales) and a destination
    holding other data."""
    blob, _, _ = _bundle("nvfp4", tokens=3)
    dst, _ = _cache("nvfp4", 16, 4, seed=9, tokens=10)
    return blob, dst


def test_every_flipped_byte_is_refused_and_nothing_is_written(small):
    blob, dst = small
    before = _snapshot(dst)
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        _refused(bytes(bad), dst, torch.arange(3))
    assert _unchanged(dst, before)


def test_every_truncation_and_any_extra_byte_is_refused(small):
    blob, dst = small
    before = _snapshot(dst)
    for n in range(len(blob)):
        _refused(blob[:n], dst, torch.arange(3), match="truncated|not a KVX bundle")
    _refused(blob + b"\0", dst, torch.arange(3), match="larger than declared")
    assert _unchanged(dst, before)


def _chunks(blob: bytes) -> tuple[bytes, list[bytes], bytes]:
    (n,) = struct.unpack("<I", blob[12:16])
    start = 16 + n + 8
    (size,) = struct.unpack("<Q", blob[start + 8:start + 16])
    step = 16 + size + 8
    chunks = [blob[start + i * step:start + (i + 1) * step] for i in range(LAYERS)]
    return blob[:start], chunks, blob[start + LAYERS * step:]


def test_reordered_duplicated_or_missing_chunks_are_refused(small):
    blob, dst = small
    head, (c0, c1), tail = _chunks(blob)
    assert head + c0 + c1 + tail == blob
    _refused(head + c1 + c0 + tail, dst, torch.arange(3), match="chunk 0: holds layer 1")
    _refused(head + c0 + c0 + tail, dst, torch.arange(3), match="chunk 1: holds layer 0")
    _refused(head + c0 + tail, dst, torch.arange(3), match="truncated")  # a file: its size differs from the header's
    _refused(head + c0 + c1 + c1 + tail, dst, torch.arange(3), match="larger than declared")
    with pytest.raises(KvxError, match="chunk 1: bad tag"):  # a pipe (size unknown): found where the chunk should be
        BundleReader(_Trickle(head + c0 + tail)).read_all()
    with pytest.raises(KvxError, match="expected the trailer"):
        BundleReader(_Trickle(head + c0 + c1 + c1 + tail)).read_all()


@pytest.mark.parametrize("major", [1, 3])
def test_unknown_version_is_unsupported(small, major):
    """Another major version is refused as such (1.x: the pre-release format whose chunk checksums were not
    segmented), never read as a corrupted 2.x bundle."""
    blob, dst = small
    e = _refused(blob[:8] + struct.pack("<H", major) + blob[10:], dst, torch.arange(3), match=f"version {major}.0")
    assert e.status == Status.UNSUPPORTED


def test_checksum_segments_are_declared_and_checked(small):
    """The chunk checksum covers the payload in `checksum.segment_bytes` segments; a header declaring another
    algorithm or segment size is refused, and a multi-segment payload's checksum equals the streamed one."""
    from kvx_core.transfer.bundle import ChunkHasher, chunk_checksum, parse_specs

    blob, _ = small
    header = BundleReader(io.BytesIO(blob)).header
    assert header["checksum"] == {"algorithm": "xxh64", "segment_bytes": 1 << 23}
    for bad in ({"algorithm": "xxh3", "segment_bytes": 1 << 20}, {"algorithm": "xxh64", "segment_bytes": 1000},
                {"algorithm": "xxh64", "segment_bytes": 1 << 15}, {"algorithm": "xxh64", "segment_bytes": 1 << 27}, {}):
        with pytest.raises(KvxError, match="checksum"):
            parse_specs({**header, "checksum": bad})
    data = bytes(range(256)) * 1000  # 256000 bytes: 4 segments of 64 KiB (the last partial)
    h = ChunkHasher(3, 99, 1 << 16)
    for a in range(0, len(data), 7777):
        h.update(data[a:a + 7777])
    assert h.intdigest() == chunk_checksum(3, data, 99, 1 << 16) != chunk_checksum(3, data, 99, 1 << 17)


def test_bundle_of_another_model_tokens_or_geometry_is_incompatible(small):
    blob, dst = small
    from dataclasses import replace  # noqa: PLC0415

    e = _refused(blob, dst, torch.arange(3), match="tokenizer_sha256", model=replace(MODEL, tokenizer_sha256="x"))
    assert e.status == Status.INCOMPATIBLE
    _refused(blob, dst, torch.arange(3), match="rope", model=replace(MODEL, rope={"rope_theta": 5e5}))
    _refused(blob, dst, torch.arange(3), match="other tokens", token_ids=[100, 101, 7])
    other = PagedKVCache("nvfp4", num_layers=LAYERS, num_blocks=4, block_size=16, num_kv_heads=HEADS,
                         head_dim=2 * DIM)
    with pytest.raises(KvxError, match="KV heads x 64") as e:
        import_bundle(io.BytesIO(blob), _descs(other), torch.arange(3), model=MODEL)
    assert e.value.status == Status.INCOMPATIBLE


def test_a_destination_failing_in_its_last_layer_changes_no_layer(small):
    """Layer 1's cache is too small for the slots: refused before layer 0 is stored."""
    blob, dst = small
    tiny = PagedKVCache("nvfp4", num_layers=LAYERS, num_blocks=1, block_size=16, num_kv_heads=HEADS, head_dim=DIM)
    before = _snapshot(dst)
    slots = torch.tensor([60, 61, 62])
    with pytest.raises(KvxError, match="slots must lie in") as e:
        import_bundle(io.BytesIO(blob), [dst.descriptor(0), tiny.descriptor(1)], slots, model=MODEL)
    assert e.value.status == Status.OUT_OF_RANGE
    assert _unchanged(dst, before)
    _refused(blob, dst, torch.tensor([1, 1, 2]), match="must not repeat")
    _refused(blob, dst, torch.arange(4), match="slots must be a tensor of 3")
    assert _unchanged(dst, before)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_random_bytes_are_refused(data):
    with pytest.raises(KvxError):
        BundleReader(io.BytesIO(data)).read_all()


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_fuzz_mutated_bundles_are_refused_or_unchanged(small, data):
    """Any overwrite, insertion or deletion of up to 8 bytes anywhere: the parser raises KvxError (never another
    exception) unless the bytes are the original ones."""
    blob, _ = small
    i = data.draw(st.integers(0, len(blob)))
    cut = data.draw(st.integers(0, 8))
    new = data.draw(st.binary(max_size=8))
    mutated = blob[:i] + new + blob[i + cut:]
    try:
        BundleReader(io.BytesIO(mutated)).read_all()
    except KvxError:
        return
    assert mutated == blob


def test_export_streams_to_a_file_and_imports_from_it(tmp_path):
    src, slots = _cache("k8v4", 16, 4, tokens=50)
    path = tmp_path / "seq.kvx"
    with path.open("wb") as f:
        header = export_bundle(f, _descs(src), slots, model=MODEL)
    assert header["tokens"] == {"count": 50, "ids": None, "ids_sha256": None}
    dst, _ = _cache("k8v4", 16, 4)
    for layer in range(LAYERS):
        dst.set_global_scales(layer, src.layers[layer].k_global, src.layers[layer].v_global)
    with path.open("rb") as f:
        import_bundle(f, _descs(dst), slots, model=MODEL)
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots), read_rows(dst.descriptor(layer), slots)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_cli_bundle_inspect_and_verify(tmp_path, capsys):
    from kvx_cli.main import main  # noqa: PLC0415

    blob, _, _ = _bundle("mxfp4", tokens=4)
    path = tmp_path / "b.kvx"
    path.write_bytes(blob)
    assert main(["bundle", "verify", str(path)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["bundle", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "mxfp4" in out and "LlamaForCausalLM" in out and "tensor k_scales" in out
    assert main(["bundle", "inspect", "--json", str(path)]) == 0
    assert '"format": "mxfp4"' in capsys.readouterr().out
    bad = tmp_path / "bad.kvx"
    bad.write_bytes(blob[:-30] + bytes([blob[-30] ^ 0xFF]) + blob[-29:])
    assert main(["bundle", "verify", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "KVX bundle rejected" in err
    assert main(["bundle", "verify", str(tmp_path / "missing.kvx")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert bad.read_bytes() != blob and path.read_bytes() == blob  # read only


def test_checksummed_bundle_whose_tensors_do_not_fit_its_format_is_refused(small):
    """A bundle written by another tool with valid checksums but tensors that are not what its format stores (or
    an unknown format): refused before anything is read into the cache."""
    from kvx_core.transfer.bundle import BundleWriter  # noqa: PLC0415

    blob, dst = small
    header = BundleReader(io.BytesIO(blob)).header
    before = _snapshot(dst)
    for change in ({"format": "int8"}, {"format": "nvfp5"}):
        h = {**header, "cache": {**header["cache"], **change}}
        buf = io.BytesIO()
        w = BundleWriter(buf, h)
        for rows in BundleReader(io.BytesIO(blob)).read_all():
            w.add_layer(rows)
        w.close()
        with pytest.raises(KvxError) as e:
            import_bundle(io.BytesIO(buf.getvalue()), _descs(dst), torch.arange(3), model=MODEL)
        assert e.value.status in REFUSED
    assert _unchanged(dst, before)


@pytest.mark.parametrize("src_fmt, dst_fmt", [("bf16", "nvfp4"), ("nvfp4_rot", "int8"), ("int4", "k8v4")])
def test_convert_equals_importing_into_the_target_format(src_fmt, dst_fmt, tmp_path, capsys):
    """`kvx bundle convert` then a same-format import stores what importing the original into a cache of the target
    format (default global scales 1.0) stores; OUT must be new, and a refused conversion leaves no file."""
    from kvx_cli.main import main  # noqa: PLC0415

    blob, _, _ = _bundle(src_fmt, tokens=9)
    src, out = tmp_path / "a.kvx", tmp_path / "b.kvx"
    src.write_bytes(blob)
    assert main(["bundle", "convert", str(src), str(out), "--format", dst_fmt]) == 0
    slots = torch.arange(9)
    via, direct = (PagedKVCache(dst_fmt, num_layers=LAYERS, num_blocks=2, block_size=16, num_kv_heads=HEADS,
                                head_dim=DIM) for _ in range(2))
    import_bundle(io.BytesIO(out.read_bytes()), _descs(via), slots, model=MODEL)
    import_bundle(io.BytesIO(blob), _descs(direct), slots, model=MODEL)
    for layer in range(LAYERS):
        a, b = read_rows(via.descriptor(layer), slots), read_rows(direct.descriptor(layer), slots)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    capsys.readouterr()
    assert main(["bundle", "convert", str(src), str(out), "--format", dst_fmt]) == 2  # exists: untouched
    assert "exists" in capsys.readouterr().err
    bad = tmp_path / "bad.kvx"
    bad.write_bytes(blob[:-1])
    assert main(["bundle", "convert", str(bad), str(tmp_path / "c.kvx"), "--format", dst_fmt]) == 2
    assert not (tmp_path / "c.kvx").exists()


class _Trickle(io.RawIOBase):
    """A pipe-like stream: every read returns at most 7 bytes."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(7, len(b), len(self.data) - self.pos)
        b[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def test_short_reads_of_a_stream_are_not_truncation(small):
    """Pipes and sockets return short reads: the reader keeps reading until a part is complete or the stream ends."""
    blob, _ = small
    layers = BundleReader(_Trickle(blob)).read_all()
    assert [sorted(x) for x in layers] == [sorted(x) for x in BundleReader(io.BytesIO(blob)).read_all()]
    with pytest.raises(KvxError, match="truncated"):
        BundleReader(_Trickle(blob[:-5])).read_all()


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_ids_outside_u32_are_refused_before_writing(bad):
    src, slots = _cache("int8", 16, 4, tokens=3)
    out = io.BytesIO()
    with pytest.raises(KvxError, match=r"token ids must lie in \[0, 2\*\*32\)") as e:
        export_bundle(out, _descs(src), slots, model=MODEL, token_ids=[1, bad, 2])
    assert e.value.status == Status.INVALID_ARGUMENT and out.getvalue() == b""


def test_token_range_stores_only_those_tokens_bit_identically(small):
    """`token_range` imports a slice of the bundled tokens (an engine loading beside a prefix it holds): exactly the
    rows of those tokens land at the given slots, no other slot changes; bad ranges are refused, nothing written."""
    blob, src, slots = _bundle("nvfp4", tokens=37)
    dst, _ = _cache("nvfp4", 16, 4)
    for layer in range(LAYERS):
        dst.set_global_scales(layer, src.layers[layer].k_global, src.layers[layer].v_global)
    before = _snapshot(dst)
    for bad in [(0, 38), (5, 5), (-1, 3), (3, 2), (0.0, 3), (1, 2, 3), "0:3"]:
        _refused(blob, dst, torch.arange(3), token_range=bad)
    _refused(blob, dst, torch.arange(4), token_range=(10, 13))  # slots of another length than the range
    assert _unchanged(dst, before)
    import_bundle(io.BytesIO(blob), _descs(dst), torch.arange(40, 59), model=MODEL, token_range=(18, 37))
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots[18:37]), read_rows(dst.descriptor(layer), torch.arange(40, 59))
        assert all(torch.equal(a[n].view(torch.uint8).cpu(), b[n].view(torch.uint8).cpu()) for n in a)
        rest = read_rows(dst.descriptor(layer), torch.arange(40))
        empty = read_rows(PagedKVCache("nvfp4", num_layers=1, num_blocks=4, block_size=16, num_kv_heads=HEADS,
                                       head_dim=DIM).descriptor(0), torch.arange(40))
        assert all(torch.equal(rest[n].cpu(), empty[n]) for n in rest if n not in ("k_global", "v_global"))


def test_an_empty_sequence_round_trips():
    """A bundle of zero tokens imports with zero slots (the default token range is the whole, empty, bundle)."""
    blob, _, _ = _bundle("int8", tokens=0)
    dst, _ = _cache("int8", 16, 4, seed=2, tokens=5)
    before = _snapshot(dst)
    (header,) = import_bundle(io.BytesIO(blob), _descs(dst), torch.empty(0, dtype=torch.int64), model=MODEL)
    assert header["tokens"]["count"] == 0 and _unchanged(dst, before)
