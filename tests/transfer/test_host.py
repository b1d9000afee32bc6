"""Bundles in host memory (`kvx_core.transfer.host`): the same bytes as the stream writer, round trips through
`import_bundle(host_tensor)`, and every corruption refused with the destination untouched."""
from __future__ import annotations

import io
import os
import sys

import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.transfer import export_bundle, import_bundle
from kvx_core.transfer.host import HostBundle, bundle_size, export_to_host
from kvx_core.transfer.rows import read_rows

from .test_bundle import LAYERS, MODEL, _cache, _descs, _snapshot, _unchanged


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "int4_rot", "k8v4", "fp8_e5m2"])
def test_host_bundle_is_the_stream_bundle_byte_for_byte(fmt):
    src, slots = _cache(fmt, 16, 4, tokens=37)
    ids = list(range(37))
    stream = io.BytesIO()
    header = export_bundle(stream, _descs(src), slots, model=MODEL, token_ids=ids)
    host = export_to_host(_descs(src), slots, model=MODEL, token_ids=ids)
    assert bytes(host.numpy()) == stream.getvalue() and bundle_size(header)[2] == host.numel()
    out = torch.full((host.numel() + 100,), 7, dtype=torch.uint8)
    view = export_to_host(_descs(src), slots, model=MODEL, token_ids=ids, out=out)
    assert view.data_ptr() == out.data_ptr() and torch.equal(view, host) and (out[host.numel():] == 7).all()


def test_too_small_an_output_buffer_is_refused_untouched():
    src, slots = _cache("int8", 16, 4, tokens=9)
    out = torch.full((100,), 7, dtype=torch.uint8)
    with pytest.raises(KvxError) as e:
        export_to_host(_descs(src), slots, model=MODEL, out=out)
    assert e.value.status == Status.OUT_OF_RANGE and (out == 7).all()
    for bad in (torch.zeros(10_000, dtype=torch.int8), torch.zeros(2, 10_000, dtype=torch.uint8)):
        with pytest.raises(KvxError, match="uint8 CPU tensor"):
            export_to_host(_descs(src), slots, model=MODEL, out=bad)


def test_import_from_host_memory_round_trips_and_converts():
    src, slots = _cache("nvfp4", 16, 4, tokens=30)
    host = export_to_host(_descs(src), slots, model=MODEL)
    same, _ = _cache("nvfp4", 8, 8)
    for layer in range(LAYERS):
        same.set_global_scales(layer, src.layers[layer].k_global, src.layers[layer].v_global)
    dst_slots = torch.arange(63, 33, -1)
    import_bundle(host, _descs(same), dst_slots, model=MODEL)
    into_bf16, _ = _cache("bf16", 8, 8)
    import_bundle(host, _descs(into_bf16), dst_slots, model=MODEL)
    oracle, _ = _cache("bf16", 8, 8)
    import_bundle(io.BytesIO(bytes(host.numpy())), _descs(oracle), dst_slots, model=MODEL)
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots), read_rows(same.descriptor(layer), dst_slots)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
        c, d = read_rows(into_bf16.descriptor(layer), dst_slots), read_rows(oracle.descriptor(layer), dst_slots)
        assert all(torch.equal(c[n], d[n]) for n in c)
    assert HostBundle(host).header["cache"]["format"] == "nvfp4"


def test_every_flipped_byte_truncation_and_extension_is_refused_untouched():
    src, slots = _cache("nvfp4", 16, 4, tokens=3)
    host = export_to_host(_descs(src), slots, model=MODEL)
    dst, _ = _cache("nvfp4", 16, 4, seed=9, tokens=10)
    before = _snapshot(dst)
    bads = []
    for i in range(host.numel()):
        bad = host.clone()
        bad[i] ^= 1
        bads.append(bad)
    bads += [host[:n].clone() for n in (0, 15, 16, host.numel() // 2, host.numel() - 1)]
    bads.append(torch.cat([host, torch.zeros(1, dtype=torch.uint8)]))
    for bad in bads:
        with pytest.raises(KvxError) as e:
            import_bundle(bad, _descs(dst), torch.arange(3), model=MODEL)
        assert e.value.status in (Status.INVALID_ARGUMENT, Status.UNSUPPORTED, Status.INCOMPATIBLE)
    assert _unchanged(dst, before)


def cuda_path_checks() -> None:
    """`HostBundle`'s CUDA-memory reader run on a CPU buffer (TRITON_INTERPRET=1: the GPU hash interpreted): the
    header through the copying view, the layers equal the host reader's, and a flipped byte in a GPU-hashed segment,
    a host-hashed tail, a chunk head, a checksum or the trailer is refused."""
    import kvx_core.transfer.host as host
    from kvx_core.transfer.bundle import BundleReader, chunk_at

    host.SEGMENT_BYTES = host.GPU_SEGMENT_BYTES  # 64 KiB segments, as bundles exported from CUDA caches have
    src, slots = _cache("bf16", 16, 32, tokens=300)  # 76800 payload bytes a layer: one whole segment and a tail
    buf = export_to_host(_descs(src), slots, model=MODEL)
    view = host._View(buf)
    view.mem = None  # copies what is read, as from a CUDA tensor
    assert BundleReader(view, size=buf.numel()).header == HostBundle(buf).header

    def as_cuda(b: torch.Tensor) -> HostBundle:
        bundle = HostBundle(b)
        bundle.mem = None  # read as a bundle in CUDA memory
        return bundle

    want, got = HostBundle(buf).read_all(), as_cuda(buf)._read_all_cuda(torch.device("cpu"))
    assert all(torch.equal(w[n].view(torch.uint8), g[n].view(torch.uint8)) for w, g in zip(want, got, strict=True)
               for n in w)
    with pytest.raises(KvxError, match="CUDA caches") as e:
        as_cuda(buf).read_all("cpu")
    assert e.value.status == Status.INVALID_ARGUMENT
    b = HostBundle(buf)
    at = chunk_at(b.first, b.size, 1)
    for i in (at + 16 + 100, at + 16 + 70000, at + 3, at + 16 + b.size + 2, b.total - 3):
        bad = buf.clone()
        bad[i] ^= 1
        with pytest.raises(KvxError) as e:
            as_cuda(bad)._read_all_cuda(torch.device("cpu"))
        assert e.value.status == Status.INVALID_ARGUMENT, i


def test_a_bundle_in_cuda_memory_is_read_with_every_check():
    from ..procs import run

    code = "import sys; sys.path.insert(0, sys.argv[1]); from tests.transfer.test_host import cuda_path_checks; " \
           "cuda_path_checks()"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = run([sys.executable, "-c", code, root], env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
