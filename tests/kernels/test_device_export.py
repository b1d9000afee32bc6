"""`host.export_to_device`: a bundle written into a buffer on the caches' own device (a NIXL VRAM slot) without a
round trip through host memory. Its oracle is the stream writer (`export_bundle`, torch path) declaring the same
64 KiB checksum segments: byte for byte, for payloads below one segment, of whole segments only and with a tail;
every refusal leaves the buffer untouched. On CUDA caches on a CUDA machine, under the Triton interpreter elsewhere
(the gather and the segment hash are the kernels on both)."""
from __future__ import annotations

import io

import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.transfer import export_bundle, host, import_bundle
from kvx_core.transfer.host import GPU_SEGMENT_BYTES, HostBundle, export_to_device
from kvx_core.transfer.rows import read_rows

from ..transfer.test_bundle import LAYERS, MODEL, _cache, _descs
from .test_transfer_kernels import DEVICE, _kernel_device, _path  # noqa: F401  (the fixture: pools on DEVICE)

# payload bytes per layer at 2 KV heads x 32: bf16 256 per token -> 13 tokens: a tail only; 256: exactly one
# segment; 300: one segment and a tail. nvfp4 72 per token: 1000 tokens one segment and a tail.
CASES = [("bf16", 13), ("bf16", 256), ("bf16", 300), ("nvfp4", 1000), ("int4_rot", 300), ("k8v4", 700),
         ("fp8_e5m2", 300), ("mxfp4", 900)]


def _stream(caches, slots, ids) -> bytes:
    with _path("torch"):
        out = io.BytesIO()
        export_bundle(out, caches, slots, model=MODEL, token_ids=ids, segment_bytes=GPU_SEGMENT_BYTES)
        return out.getvalue()


@pytest.mark.parametrize("fmt,tokens,staged", [(*c, True) for c in CASES] + [("bf16", 300, False),
                                                                              ("nvfp4", 1000, False)])
def test_device_export_is_the_stream_bundle_byte_for_byte(fmt, tokens, staged, monkeypatch):
    """Both gathers: every layer into one staging buffer, and (a bundle above EXPORT_STAGE_BYTES) each layer into a
    chunk of its own, freed after its layer."""
    if not staged:
        monkeypatch.setattr(host, "EXPORT_STAGE_BYTES", 0)
    src, slots = _cache(fmt, 16, 80, tokens=tokens)
    ids = list(range(tokens))
    want = _stream(_descs(src), slots, ids)
    out = torch.full((len(want) + 64,), 7, dtype=torch.uint8, device=DEVICE)
    with _path("triton"):
        got = export_to_device(_descs(src), slots, model=MODEL, token_ids=ids, out=out)
    assert got.data_ptr() == out.data_ptr() and got.numel() == len(want)
    assert bytes(got.cpu().numpy()) == want and (out[len(want):] == 7).all()


def test_a_device_bundle_imports_with_every_check():
    """What a NIXL READ of the slot lands: imported (same format, bit for bit) and, flipped anywhere, refused."""
    src, slots = _cache("nvfp4", 16, 80, tokens=1000)
    out = torch.zeros(200_000, dtype=torch.uint8, device=DEVICE)
    with _path("triton"):
        bundle = export_to_device(_descs(src), slots, model=MODEL, out=out).clone()
        dst, _ = _cache("nvfp4", 16, 80, seed=3)
        for layer in range(LAYERS):
            dst.set_global_scales(layer, src.layers[layer].k_global, src.layers[layer].v_global)
        import_bundle(bundle, _descs(dst), torch.arange(1000), model=MODEL)
        for layer in range(LAYERS):
            a, b = read_rows(src.descriptor(layer), slots), read_rows(dst.descriptor(layer), torch.arange(1000))
            assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
        assert HostBundle(bundle).header["checksum"]["segment_bytes"] == GPU_SEGMENT_BYTES
        for at in (5, bundle.numel() // 2, bundle.numel() - 3):  # header, a payload, the trailer
            bad = bundle.clone()
            bad[at] ^= 1
            with pytest.raises(KvxError):
                import_bundle(bad, _descs(dst), torch.arange(1000), model=MODEL)


def test_refused_device_exports_leave_the_buffer_untouched():
    src, slots = _cache("int8", 16, 4, tokens=9)
    small = torch.full((100,), 7, dtype=torch.uint8, device=DEVICE)
    with _path("triton"):
        with pytest.raises(KvxError) as e:
            export_to_device(_descs(src), slots, model=MODEL, out=small)
        assert e.value.status == Status.OUT_OF_RANGE and (small == 7).all()
        big = torch.full((100_000,), 7, dtype=torch.uint8, device=DEVICE)
        with pytest.raises(KvxError) as e:
            export_to_device(_descs(src), torch.tensor([0, 1, 10_000]), model=MODEL, out=big)  # a slot off the pool
        assert (big == 7).all()
        for bad in (torch.zeros(10_000, dtype=torch.int8, device=DEVICE),
                    torch.zeros(2, 10_000, dtype=torch.uint8, device=DEVICE),
                    torch.zeros(20_000, dtype=torch.uint8, device=DEVICE)[::2]):
            with pytest.raises(KvxError, match="contiguous 1-D uint8"):
                export_to_device(_descs(src), slots, model=MODEL, out=bad)
    with _path("torch"), pytest.raises(KvxError) as e:  # caches the transfer kernels do not serve
        export_to_device(_descs(src), slots, model=MODEL, out=big)
    assert e.value.status == Status.UNSUPPORTED and (big == 7).all()


def _compiled_variants() -> int:
    """Compiled variants of every KVX Triton kernel on this process's CUDA device (Triton's per-device cache)."""
    import sys

    import triton

    fns = {id(f): f for name, m in list(sys.modules.items()) if name.startswith("kvx_core") and m is not None
           for f in vars(m).values() if isinstance(f, triton.runtime.JITFunction)}
    return sum(len(f.device_caches[torch.cuda.current_device()][0]) for f in fns.values())


@pytest.mark.gpu
def test_bundles_of_new_lengths_and_seeds_compile_nothing():
    """After one handoff of each route (same format, converted), bundles of lengths never met (1 token, multiples of
    16 and not: Triton specializes integers == 1 and % 16 == 0) and so of other checksum seeds run the kernels
    already compiled: a compile takes ~280 ms, and inside a P/D handoff it was one (bench_pd --profile-phases)."""
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")
    lengths = (1000, 1, 16, 17, 64, 333, 2048)  # the first: payloads of whole 64 KiB segments (the hash kernel runs)
    with _path("triton"):  # every cache filled first: their writes compile what they compile before the count
        runs = [(n, _cache("bf16", 16, 160, tokens=n), _cache(fmt, 16, 160, seed=3)[0])
                for fmt in ("bf16", "nvfp4") for n in lengths]
        out = torch.zeros(1 << 23, dtype=torch.uint8, device=DEVICE)
        variants = None
        for i, (n, (src, slots), dst) in enumerate(runs):
            bundle = export_to_device(_descs(src), slots, model=MODEL, token_ids=list(range(n)), out=out)
            import_bundle(bundle, _descs(dst), torch.arange(n), model=MODEL)
            torch.cuda.synchronize()
            if i % len(lengths) == 0:  # the first handoff of a route: what its kernels compile
                variants = _compiled_variants()
            assert _compiled_variants() == variants, (i, n)
