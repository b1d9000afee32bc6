"""Bundles on the GPU machine: export from / import into CUDA pools (the reference ops run on the device), and
handoff between a CUDA cache and a CPU cache, bit for bit where the format matches."""
from __future__ import annotations

import io

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.transfer import ModelFingerprint, export_bundle, import_bundle
from kvx_core.transfer.rows import read_rows

pytestmark = pytest.mark.gpu
LAYERS, H, D, T = 2, 8, 128, 300
MODEL = ModelFingerprint("LlamaForCausalLM", LAYERS, H, D, {}, "c" * 64, "t" * 64)


def _cache(fmt, device, fill=False, bs=16):
    c = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=512 // bs, block_size=bs, num_kv_heads=H, head_dim=D,
                     device=device)
    if fill:
        g = torch.Generator().manual_seed(0)
        for layer in range(LAYERS):
            c.write(layer, torch.randn(T, H, D, generator=g).to(device), torch.randn(T, H, D, generator=g).to(device),
                    torch.arange(T, device=device))
    return c


def _descs(c):
    return [c.descriptor(i) for i in range(LAYERS)]


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "int4_rot", "k8v4"])
@pytest.mark.parametrize("route", ["cuda->cuda", "cuda->cpu", "cpu->cuda"])
def test_round_trip_between_devices_is_bit_identical(fmt, route):
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")
    src_dev, dst_dev = route.split("->")
    src, dst = _cache(fmt, src_dev, fill=True), _cache(fmt, dst_dev, bs=8)
    slots = torch.arange(T)
    dst_slots = torch.arange(T - 1, -1, -1) + 5
    buf = io.BytesIO()
    export_bundle(buf, _descs(src), slots, model=MODEL)
    import_bundle(io.BytesIO(buf.getvalue()), _descs(dst), dst_slots, model=MODEL)
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots), read_rows(dst.descriptor(layer), dst_slots)
        assert all(torch.equal(a[n].cpu().view(torch.uint8), b[n].cpu().view(torch.uint8)) for n in a)


def test_conversion_on_the_gpu_equals_writing_the_gathered_kv():
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")
    src, dst, oracle = _cache("bf16", "cuda", fill=True), _cache("nvfp4", "cuda"), _cache("nvfp4", "cuda")
    slots = torch.arange(T)
    buf = io.BytesIO()
    export_bundle(buf, _descs(src), slots, model=MODEL)
    import_bundle(io.BytesIO(buf.getvalue()), _descs(dst), slots, model=MODEL)
    table = torch.arange((T + 15) // 16, dtype=torch.int32, device="cuda").view(1, -1)
    for layer in range(LAYERS):
        k, v = src.gather(layer, table, torch.tensor([T], dtype=torch.int32, device="cuda"))
        oracle.write(layer, k, v, slots.cuda())
        a, b = read_rows(dst.descriptor(layer), slots), read_rows(oracle.descriptor(layer), slots)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "k8v4"])
def test_host_path_is_the_stream_bundle_and_round_trips(fmt):
    """`export_to_host` from CUDA pools (64 KiB checksum segments hashed on the GPU, async copies into pinned
    memory) writes a bundle the stream reader (CPU xxhash: the oracle of the GPU hash) accepts, with the stream
    writer's header and layers; `import_bundle(pinned)` (segments verified on the GPU) stores them bit for bit; a
    flipped payload byte is refused untouched."""
    from kvx_core.errors import KvxError
    from kvx_core.transfer.host import export_to_host

    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")
    src, dst = _cache(fmt, "cuda", fill=True), _cache(fmt, "cuda", bs=8)
    slots = torch.arange(T, device="cuda")
    stream = io.BytesIO()
    export_bundle(stream, _descs(src), slots, model=MODEL, token_ids=list(range(T)))
    out = torch.empty(len(stream.getvalue()) + 64, dtype=torch.uint8, pin_memory=True)
    host = export_to_host(_descs(src), slots, model=MODEL, token_ids=list(range(T)), out=out)
    from kvx_core.transfer.bundle import BundleReader

    mine, theirs = BundleReader(io.BytesIO(bytes(host.numpy()))), BundleReader(io.BytesIO(stream.getvalue()))
    assert mine.header["checksum"]["segment_bytes"] == 1 << 16
    assert {**mine.header, "checksum": None} == {**theirs.header, "checksum": None}
    for a, b in zip(mine.read_all(), theirs.read_all(), strict=True):
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    back = torch.arange(T, 0, -1, device="cuda") + 100
    bad = host.clone().pin_memory()
    bad[host.numel() // 2] ^= 4
    before = [t.clone() for p in dst.layers for t in (p.k_data, p.v_data)]
    with pytest.raises(KvxError, match="checksum"):
        import_bundle(bad, _descs(dst), back, model=MODEL)
    after = [t for p in dst.layers for t in (p.k_data, p.v_data)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    import_bundle(host, _descs(dst), back, model=MODEL, token_ids=list(range(T)))
    for layer in range(LAYERS):
        a, b = read_rows(src.descriptor(layer), slots), read_rows(dst.descriptor(layer), back)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a if "global" not in n)
