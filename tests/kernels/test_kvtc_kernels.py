"""KVTC's GPU codec (`ops.triton.kvtc`) against the torch reference (`kvtc.quant.pack_range` / `unpack_range`): the
same body bytes and the same decoded projections bit for bit, on every range kind, odd component counts, dropped
ranges between kept ones, several row blocks, and adversarial columns (constant, all zero, -0.0, subnormal, at the
fp16 limit, FP8 values beyond +-448 * scale that saturate). Runs on CUDA, else in Triton's CPU interpreter; on CUDA
also the whole codec: a buffer compressed on the GPU decodes on the CPU to the GPU's values."""
from __future__ import annotations

import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.kvtc import calibrate, compress, decompress
from kvx_core.kvtc.calibration import Calibration, SideCalibration
from kvx_core.kvtc.layout import body_layout, decode_sections, encode_sections
from kvx_core.kvtc.rope import rotate

H, D, LPG = 1, 32, 1  # features per group side: 32

# kept ranges per side (gaps are dropped ranges): odd sizes, every kind, int2 / int4 rows with padding
RANGES = {"k": ((0, 5, "int2"), (5, 12, "int4"), (12, 15, "fp8"), (20, 27, "int8"), (27, 32, "int2")),
          "v": ((0, 8, "fp8"), (8, 17, "int4"), (17, 19, "int2"))}


def _calibration() -> Calibration:
    g = torch.Generator().manual_seed(5)
    f = H * D * LPG

    def side(s: str) -> SideCalibration:
        basis, _ = torch.linalg.qr(torch.randn(f, f, generator=g, dtype=torch.float64))
        return SideCalibration(torch.randn(f, generator=g), basis.float(), torch.ones(f),
                               torch.rand(f, generator=g) * 0.02 + 1e-3, RANGES[s])

    return Calibration(2, H, D, LPG, 0, 0, 4.0, 8, {}, None, tuple({s: side(s) for s in "kv"} for _ in range(2)))


def _projections(rows: int, columns: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    y = torch.randn(rows, columns, generator=g) * torch.logspace(-3, 2, columns)
    y[:, 1] = 0.75  # constant: step 0, codes 0
    y[:, 2] = 0.0
    y[::2, 3] = -0.0
    y[:, 4] = torch.randn(rows, generator=g) * 1e-40  # subnormal
    y[0, 6], y[-1, 6] = 65504.0, -65504.0  # int4 column at the fp16 limit
    y[:, 13] *= 1e4  # fp8 column far beyond 448 * scale: saturates
    return y.contiguous().to(device)


@pytest.mark.parametrize("rows", [1, 2, 67, 130])
def test_triton_sections_equal_the_reference_bytes_and_values(device, rows):
    cal = _calibration()
    layout = body_layout(cal, rows, start=7)  # an odd start: meta and data at odd offsets
    y = _projections(rows, layout.columns, device)
    bodies = {}
    for backend in ("torch", "triton"):
        body = torch.full((layout.end,), 0xA5, dtype=torch.uint8, device=device)
        encode_sections(y, cal, layout, body, backend=backend)
        bodies[backend] = body
        assert bool((body[:7] == 0xA5).all())  # nothing before the sections written
    assert torch.equal(bodies["torch"].cpu(), bodies["triton"].cpu())
    decoded = {b: decode_sections(bodies["torch"], cal, layout, backend=b) for b in ("torch", "triton")}
    assert torch.equal(decoded["torch"].view(torch.int32).cpu(), decoded["triton"].view(torch.int32).cpu())
    # an independent bound: IntX values within half a step plus the fp16 rounding of min and step
    dec = decoded["triton"].cpu()
    ref = y.cpu()
    for s in layout.sections:
        cols = slice(s.column, s.column + s.n)
        if s.kind.is_int:
            span = ref[:, cols].amax(0) - ref[:, cols].amin(0)
            bound = span / ((1 << s.kind.bits) - 1) * 0.5 + (span + ref[:, cols].abs().amax(0)) * 2 ** -10 + 1e-30
            assert bool(((dec[:, cols] - ref[:, cols]).abs() <= bound).all()), s
    dropped = torch.ones(layout.columns, dtype=torch.bool)
    for s in layout.sections:
        dropped[s.column:s.column + s.n] = False
    assert bool((dec[:, dropped] == 0).all())


def test_fp8_sections_saturate_and_int_sections_refuse_beyond_fp16(device):
    cal = _calibration()
    layout = body_layout(cal, 3, start=0)
    y = _projections(3, layout.columns, device)
    body = torch.zeros(layout.end, dtype=torch.uint8, device=device)
    encode_sections(y, cal, layout, body, backend="triton")
    fp8 = next(s for s in layout.sections if not s.kind.is_int)  # columns 12..14 of K, 13 saturates
    codes = body[fp8.data_at:fp8.data_at + 3 * fp8.row_bytes].view(3, fp8.row_bytes).cpu()
    assert bool(((codes[:, 1] & 0x7F) == 0x7E).all())  # +-448
    y[0, 8] = 70000.0  # an int4 column beyond fp16
    before = body.clone()
    with pytest.raises(KvxError) as e:
        encode_sections(y, cal, layout, body, backend="triton")
    assert e.value.status == Status.OUT_OF_RANGE and torch.equal(body, before)


TINY, SUB = 2.0 ** -120, 2.0 ** -133  # a normal and a subnormal FP8 scale


def test_fp8_sections_keep_subnormal_operands_and_quotients(device):
    """FP8 codes `y / scale` with subnormal operands, hand values (numpy FP32 division and ml_dtypes' E4M3 agree):
    scale 2**-120, y = 3 * 2**-131, -5 * 2**-130, 2**-126 -> 0.75, -2.5 (a tie: to even) and 8 times 2**-9, bytes
    0x01, 0x82, 0x08; scale 2**-133 (subnormal), y = 2**-133, 2**-130, 0 -> 1, 8, 0: bytes 0x38, 0x50, 0x00. A division
    that flushes subnormals (Triton <= 3.5's `div_rn`: div.rn.ftz.f32) stores 0x00, 0x80, 0x08 and, dividing by 0,
    +-448 / NaN. (IntX codes divide by an fp16 step >= 2**-24: a subnormal `y - min` codes 0 flushed or not; the
    subnormal column of `_projections` covers them.)"""
    import dataclasses

    import ml_dtypes
    import numpy as np

    base = _calibration()
    groups = []
    for g in base.groups:
        sides = {}
        for name, c in g.items():
            scale = c.fp8_scale.clone()
            for lo, _, kind in c.ranges:
                if kind == "fp8":
                    scale[lo:lo + 2] = torch.tensor([TINY, SUB])
            sides[name] = dataclasses.replace(c, fp8_scale=scale)
        groups.append(sides)
    cal = dataclasses.replace(base, groups=tuple(groups))
    layout = body_layout(cal, 3, start=0)
    y = _projections(3, layout.columns, "cpu")
    cols = [(s.column, s.data_at, s.row_bytes) for s in layout.sections if not s.kind.is_int]
    assert cols
    for c, _, _ in cols:
        y[:, c] = torch.tensor([3 * 2.0 ** -131, -5 * 2.0 ** -130, 2.0 ** -126])
        y[:, c + 1] = torch.tensor([2.0 ** -133, 2.0 ** -130, 0.0])
    want = [[0x01, 0x38], [0x82, 0x50], [0x08, 0x00]]
    f = np.float32
    for j, sc in enumerate((TINY, SUB)):
        q = y[:, cols[0][0] + j].numpy() / f(sc)
        assert np.array(q, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).tolist() == [r[j] for r in want]
    bodies = {}
    for backend in ("torch", "triton"):
        body = torch.zeros(layout.end, dtype=torch.uint8, device=device)
        encode_sections(y.to(device), cal, layout, body, backend=backend)
        bodies[backend] = body.cpu()
        for _, at, rb in cols:
            assert bodies[backend][at:at + 3 * rb].view(3, rb)[:, :2].tolist() == want, backend
    assert torch.equal(bodies["torch"], bodies["triton"])


@pytest.mark.gpu
def test_gpu_codec_round_trip_decodes_the_same_on_the_cpu():
    """Keys with RoPE applied (removed and put back by the codec), low-rank K/V plus 5% noise: the GPU's buffer
    decodes on the GPU and on the CPU to the same values up to the two devices' matmul rounding, raw tokens exact,
    coded tokens within 1% (squared) of the input."""
    g = torch.Generator().manual_seed(3)
    basis = [torch.randn(6, 2 * 64, generator=g) for _ in range(4)]

    def kv(n, start=0, device="cpu"):
        pos = torch.arange(start, start + n)
        out = []
        for b in basis:
            k, v = ((torch.randn(n, 6, generator=g) @ b + 0.05 * torch.randn(n, 128, generator=g)).view(n, 2, 64)
                    for _ in range(2))
            out.append((rotate(k, pos, 10000.0).bfloat16().to(device), v.bfloat16().to(device)))
        return out

    cal = calibrate([kv(400), kv(400)], layers_per_group=2, ratio=8, range_size=16, sink_tokens=4,
                    recent_tokens=32, rope_theta=10000.0)
    x = kv(1000, 3, "cuda")
    buf = compress(x, cal, token_start=3, token_ids=list(range(1000)))
    on_gpu = decompress(buf, cal, device="cuda")
    on_cpu = decompress(buf, cal, device="cpu")
    assert on_gpu.token_ids == list(range(1000))
    for (kg, vg), (kc, vc), (k, v) in zip(on_gpu.kv, on_cpu.kv, x, strict=True):
        for a, b, ref in ((kg, kc, k), (vg, vc, v)):
            assert torch.equal(a[:1].cpu(), ref[:1].cpu()) and torch.equal(a[-32:].cpu(), ref[-32:].cpu())  # raw
            assert float((a.cpu().float() - b.float()).abs().max()) <= 0.02  # matmul rounding of two devices
            rel = float(((a.float() - ref.float()) ** 2).sum() / (ref.float() ** 2).sum())
            assert rel < 0.01
