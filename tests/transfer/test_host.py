"""Bundles in host memory (`kvx_core.transfer.host`): the same bytes as the stream writer, round trips through
`import_bundle(host_tensor)`, and every corruption refused with the destination untouched."""
from __future__ import annotations

import io

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
