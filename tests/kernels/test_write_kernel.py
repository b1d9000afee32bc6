"""Fused writes (Triton and CUDA, `ops.write`) vs the formats' torch encode: payload AND scale bytes
bit-identical on adversarial inputs (RNE ties, saturation, NVFP4 underflow/overflow guards, MXFP4 exponents,
NaN/inf, subnormals), every format and input dtype; skipped (-1) slots and everything else in the pools
untouched. Formats / shapes the CUDA write does not serve run on Triton under backend "cuda"'s fallback-free
check (`_backend_for`), so every case states which kernel it tested."""
import pytest
import torch

from kvx_core.formats import get_format, list_formats, rotate
from kvx_core.ops import write as ops_write
from kvx_core.ops.cuda import write as cuda_write

from . import host_write
from .helpers import adversarial

ALL = list_formats()
POISON = 0xA5
# "cuda_host": the CUDA write's source compiled for the CPU (host_write.py), so CI checks the kernel's logic too
BACKENDS = ["triton", "cuda_host", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def backend(request, device):
    if request.param == "cuda_host" and device != "cpu":
        pytest.skip("the host build runs on CPU tensors (on a GPU the kernel itself runs: backend cuda)")
    return request.param


def _cuda_serves(fmt, key) -> bool:
    """The CUDA write must serve this call: quantized K and V (rotated or not) of a head dim it takes."""
    return key.shape[2] in (32, 64, 128, 256) and fmt.k.quant != 0 and fmt.v.quant != 0


def _backend_for(backend, fmt, key, value, kd, vd):
    """"cuda" only where the CUDA write serves the call (asserted for the shapes it must serve), else "triton"."""
    if backend == "cuda" and cuda_write.reason(key, value, fmt, kd, vd) is not None:
        assert not _cuda_serves(fmt, key), cuda_write.reason(key, value, fmt, kd, vd)
        return "triton"
    return backend


def write_kv(k, v, slots, kd, ks, vd, vs, fmt, k_gs=None, v_gs=None, backend="triton", **kw):
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    if backend == "cuda_host":
        ran = host_write.write_pools(k, v, slots, kd, ks, vd, vs, fmt, k_gs, v_gs, **kw)
        assert ran == "cuda_host" or not _cuda_serves(fmt, k), cuda_write.layout_reason(k, v, fmt, kd, vd)
        return
    chosen = _backend_for(backend, fmt, k, v, kd, vd)
    ops_write.write_pools(k, v, slots, kd, ks, vd, vs, fmt, k_gs, v_gs, backend=chosen, **kw)


def _pools(tf, nb, h, bs, d, device):
    data = torch.full((nb, h, bs, tf.payload_dim(d) * tf.torch_data_dtype.itemsize), POISON, dtype=torch.uint8)
    data = data.view(tf.torch_data_dtype).to(device)
    sd = tf.scale_dim(d)
    scales = torch.full((nb, h, bs, sd), POISON, dtype=torch.uint8, device=device) if sd else None
    return data, scales


def _same(a: torch.Tensor, b: torch.Tensor, plain: bool) -> bool:
    """Bytes equal; for unquantized payloads NaN bit patterns are the device's own (NaN == NaN)."""
    if plain:
        fa, fb = a.float(), b.float()
        nan = torch.isnan(fa)
        return torch.equal(nan, torch.isnan(fb)) and torch.equal(fa[~nan].view(torch.int32), fb[~nan].view(torch.int32))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _check(name, device, x_dtype=torch.float32, t=9, h=2, d=64, bs=4, per_head=True, seed=0, slots=None,
           backend="triton", rows=adversarial):
    fmt = get_format(name)
    nb = (t + bs - 1) // bs + 2
    k = rows(t, h, d, seed).to(x_dtype)
    v = rows(t, h, d, seed + 1).flip(0).to(x_dtype)
    if slots is None:
        perm = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(seed))[:t]
        slots = torch.where(torch.arange(t) % 3 == 1, -1, perm)
    gk = torch.tensor([0.5, 2.0 ** -7] * (h // 2)) if per_head else torch.tensor([0.0123])
    gv = torch.tensor([3.3, 1.0] * (h // 2)) if per_head else torch.tensor([1.0])
    gk = gk if fmt.k.uses_global_scale else None
    gv = gv if fmt.v.uses_global_scale else None
    kd, ks = _pools(fmt.k, nb, h, bs, d, device)
    vd, vs = _pools(fmt.v, nb, h, bs, d, device)

    def dev(g):
        return None if g is None else g.to(device)

    write_kv(k.to(device), v.to(device), slots.to(device), kd, ks, vd, vs, fmt, dev(gk), dev(gv), backend=backend)
    keep = slots >= 0
    blk, off = slots[keep] // bs, slots[keep] % bs
    written = torch.zeros(nb, bs, dtype=torch.bool)
    written[blk, off] = True
    for tf, x, data, scales, g in ((fmt.k, k, kd, ks, gk), (fmt.v, v, vd, vs, gv)):
        xr = rotate(x) if fmt.rotate else x  # the kernel path rotates every row with the same matmul
        payload, sc = tf.encode(xr[keep], g)
        data, plain = data.cpu(), tf.quant == 0
        assert _same(data[blk, :, off], payload, plain), f"{name} payload differs"
        untouched = data.view(torch.uint8).permute(0, 2, 1, 3)[~written]
        assert bool((untouched == POISON).all()), f"{name}: a skipped slot was written"
        if scales is not None:
            scales = scales.cpu()
            assert torch.equal(scales[blk, :, off], sc), f"{name} scale bytes differ"
            assert bool((scales.permute(0, 2, 1, 3)[~written] == POISON).all())


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ALL)
def test_write_bit_identical(name, x_dtype, device, backend):
    _check(name, device, x_dtype, backend=backend)


def _rotation_rows(dtype):
    """`rows` for `_check` in `dtype` whose rotations reach every stage's corner: random rows with outliers (magnitudes
    1e-3..1e3 per row), rows of the dtype's largest value (FP32: saturated to FP32_MAX / D before the butterfly; fp16:
    the all-positive row's rotation saturates at 65504 after it), signed zeros, the dtype's subnormals, one NaN and
    one inf (each poisons its whole rotated row)."""
    big, tiny = torch.finfo(dtype).max, torch.finfo(dtype).smallest_normal * 2.0 ** -3

    def rows(t, h, d, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(t, h, d, generator=g) * 10.0 ** (torch.rand(t, h, 1, generator=g) * 6 - 3)
        x[:, :, ::7] *= 50.0
        x[0, 0] = big
        x[0, h - 1] = big * torch.randn(d, generator=g).sign()
        x[1, 0] = torch.where(torch.rand(d, generator=g) < 0.5, -0.0, 0.0)
        x[1, h - 1] = tiny * torch.randint(-7, 8, (d,), generator=g)
        x[2, 0, 5] = float("nan")
        x[2, h - 1, d - 1] = float("inf")
        return x
    return rows


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name,d", [("nvfp4_rot", 32), ("nvfp4_rot", 128), ("nvfp4_rot", 256), ("k8v4_rot", 128),
                                    ("k8v4_rot", 256), ("int4_rot", 128), ("mxfp4_32_rot", 256), ("mxfp4_rot", 64)])
def test_write_rotated_rows(name, d, x_dtype, device, backend):
    """`_rot` formats: the bytes of the encode of `formats.rotate(x)` (the torch butterfly) for every head dim the CUDA
    write serves (its rotation runs 0..3 stages between a row's lanes) and every input dtype, on rows that reach the
    rotation's saturations, zeros, subnormals and NaN / inf."""
    _check(name, device, x_dtype, t=7, d=d, seed=d, backend=backend, rows=_rotation_rows(x_dtype))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "k8v4"])
def test_write_per_tensor_global_scale(name, device, backend):
    _check(name, device, per_head=False, seed=3, backend=backend)


@pytest.mark.parametrize("name", ["int8", "mxfp4_32", "nvfp4", "bf16"])
@pytest.mark.parametrize("d", [32, 96, 256])
def test_write_non_power_of_two_and_small_and_large_head_dims(name, d, device, backend):
    _check(name, device, d=d, seed=d, backend=backend)


def _ulp(m: torch.Tensor, steps: int) -> torch.Tensor:
    """FP32 values `steps` units in the last place from `m` (same sign)."""
    return (m.view(torch.int32) + steps).view(torch.float32)


@pytest.mark.parametrize("fmt_name,mbits", [("fp8_e4m3", 3), ("fp8_e5m2", 2)])
def test_fp8_rounding_every_boundary(fmt_name, mbits, device, backend):
    """Every FP8 value, every midpoint between neighbours and one FP32 ulp either side of it."""
    dt = torch.float8_e4m3fn if fmt_name == "fp8_e4m3" else torch.float8_e5m2
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2

    x = torch.cat([vals, mids, _ulp(mids, 1), _ulp(mids, -1), -mids, vals * 1.0000001])
    x = torch.cat([x, x.new_zeros((-x.numel()) % 64)]).view(-1, 1, 64)
    fmt = get_format(fmt_name)
    kd, _ = _pools(fmt.k, x.shape[0], 1, 1, 64, device)
    vd, _ = _pools(fmt.v, x.shape[0], 1, 1, 64, device)
    slots = torch.arange(x.shape[0], device=device)
    write_kv(x.to(device), x.to(device), slots, kd, None, vd, None, fmt, backend=backend)
    ref, _ = fmt.k.encode(x)
    assert torch.equal(kd.cpu().view(torch.uint8)[:, 0, 0], ref.view(torch.uint8)[:, 0])
    assert torch.equal(vd.cpu().view(torch.uint8), kd.cpu().view(torch.uint8))


@pytest.mark.parametrize("anchor", [4.0, 6.0])
def test_e2m1_rounding_every_boundary(anchor, device, backend):
    """Every E2M1 value up to the anchor, every midpoint between neighbours (the RNE ties), one and two FP32 ulps
    either side, FP32 subnormals and 2**16 random magnitudes, both signs, as MXFP4 groups of one anchor (RCEIL scale
    2**0 for anchors 4 and 6, so each code is the E2M1 rounding of the value itself) and 15 probes."""
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = (vals[1:] + vals[:-1]) / 2

    tiny = torch.tensor([2.0 ** -149, 2.0 ** -126, 0.25 * (1 - 2.0 ** -24)])
    rand = torch.rand(1 << 16, generator=torch.Generator().manual_seed(5)) * anchor
    probes = torch.cat([vals, mids] + [_ulp(mids, s) for s in (-2, -1, 1, 2)] + [tiny, rand])
    probes = probes[probes <= anchor]
    probes = torch.cat([probes, -probes])
    probes = torch.cat([probes, probes.new_zeros((-probes.numel()) % 15)]).view(-1, 15)
    x = torch.cat([torch.full((probes.shape[0], 1), anchor), probes], 1)
    x = torch.cat([x, x.new_zeros((-x.shape[0]) % 8, 16)]).view(-1, 1, 128)
    fmt = get_format("mxfp4")
    kd, ks = _pools(fmt.k, x.shape[0], 1, 1, 128, device)
    vd, vs = _pools(fmt.v, x.shape[0], 1, 1, 128, device)
    slots = torch.arange(x.shape[0], device=device)
    write_kv(x.to(device), x.to(device), slots, kd, ks, vd, vs, fmt, backend=backend)
    ref, sc = fmt.k.encode(x)
    assert torch.equal(kd.cpu()[:, 0, 0], ref[:, 0]) and torch.equal(ks.cpu()[:, 0, 0], sc[:, 0])
    assert torch.equal(vd.cpu(), kd.cpu()) and torch.equal(vs.cpu(), ks.cpu())


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_int_rows_with_signed_zero_extremes_store_positive_zeros(name, device, backend):
    """Rows whose min or max is a zero of both signs (all zeros; zeros and positives; zeros and negatives): the
    min and scale store +0 whichever zero a reduction meets first (each kernel's lanes and torch's amin reduce in
    their own orders), so every backend stores the same bytes as the encode."""
    fmt = get_format(name)
    d = 64
    x = torch.zeros(6, 1, d)
    x[:, :, 1::2] = -0.0
    x[1, 0, 5::7], x[2, 0, 9::5] = 1.5, -2.25  # min +-0 with positives; max +-0 with negatives
    x[3, 0, ::2] = -0.0  # every zero negative
    x[4] = x[4].flip(-1)
    x[5, 0, 3] = 3.0
    kd, ks = _pools(fmt.k, 2, 1, 4, d, device)
    vd, vs = _pools(fmt.v, 2, 1, 4, d, device)
    write_kv(x.to(device), x.to(device), torch.arange(6, device=device), kd, ks, vd, vs, fmt, backend=backend)
    ref, sc = fmt.k.encode(x)
    f16 = sc.view(6, 1, 2, 2).view(torch.float16)
    assert not torch.signbit(f16[[0, 1, 3, 4, 5], 0, 1]).any() and not torch.signbit(f16[:, 0, 0]).any()
    got = ks.cpu().reshape(8, 1, -1)[:6]
    assert torch.equal(got, sc) and torch.equal(kd.cpu().reshape(8, 1, -1)[:6], ref.view(6, 1, -1))


# Divisions of the write whose operand or quotient is an FP32 subnormal (< 2**-126), with the bytes IEEE division
# stores (hand values) and, in the comments, what a flushing division stores instead: PTX div.rn.ftz.f32, which is
# what `tl.math.div_rn` compiles to under Triton <= 3.5 (libdevice with nvvm-reflect-ftz). Per format: the two heads'
# global scales, each head's leading values (the rest 0), and (head, "scale" | "payload", byte, IEEE byte).
TINY_G = 2.0 ** -120  # a normal global scale that maps FP32 subnormals x into the FP8 / FP4 range (x / g)
SUB_G = 2.0 ** -133   # a subnormal global scale (FP32 and bf16)
SUBNORMAL_DIVISIONS = {
    # s = amax / (6 g). Head 0, g = 1: amax 2**-133 (subnormal operand) and 2**-125 (s = 2**-125 / 6, a subnormal
    # quotient): s > 0 clamps to 2**-9 (byte 0x01); flushed, s = 0 takes the zero-scale rule (1.0, byte 0x38).
    # Head 1, g = 2**-120: amax 2**-127, s = 2**-7 / 6 -> byte 0x01, S = 2**-9 * g = 2**-129 (subnormal divisor):
    # x / S = 4, -2, 3 -> E2M1 codes 6, 0xC, 5 (bytes 0xC6, 0x05); flushed: byte 0x38 and codes 0.
    "nvfp4": ((1.0, TINY_G),
              {0: [2.0 ** -133] * 16 + [2.0 ** -125] * 16, 1: [2.0 ** -127, -2.0 ** -128, 3 * 2.0 ** -129]},
              [(0, "scale", 0, 0x01), (0, "scale", 1, 0x01), (1, "scale", 0, 0x01), (1, "payload", 0, 0xC6),
               (1, "payload", 1, 0x05)]),
    # RCEIL: E = ceil(log2(amax / 6)); amax = 2**-124: amax / 6 = 2**-126.58 (subnormal quotient) -> E = -126
    # (byte 1), x * 2**126: 2**-124 -> 4, 2**-126 -> 1, -2**-125 -> -2 (codes 6, 2, 0xC: bytes 0x26, 0x0C);
    # flushed: E = -127 (byte 0), x * 2**127 -> 8 (saturates to 6), 2, -4 (bytes 0x47, 0x0E).
    "mxfp4": ((1.0, 1.0), {0: [2.0 ** -124, 2.0 ** -126, -2.0 ** -125]},
              [(0, "scale", 0, 0x01), (0, "payload", 0, 0x26), (0, "payload", 1, 0x0C)]),
    "mxfp4_32": ((1.0, 1.0), {1: [2.0 ** -124, 2.0 ** -126, -2.0 ** -125]},
                 [(1, "scale", 0, 0x01), (1, "payload", 0, 0x26), (1, "payload", 1, 0x0C)]),
    # y = x / g. Head 0, g = 2**-133 (subnormal divisor): 2**-133 -> 1.0 (0x38), 2**-130 -> 8 (0x50); flushed 0 / 0
    # and x / 0 give NaN / inf, stored as -448 / 448. Head 1, g = 2**-120: 3 * 2**-131 -> 0.75 * 2**-9 (RNE to byte
    # 0x01), -5 * 2**-130 -> -2.5 * 2**-9 (tie to even: 0x82), 2**-126 -> 2**-6 (0x08); flushed: 0x00, 0x80, 0x08.
    "fp8_e4m3": ((SUB_G, TINY_G), {0: [2.0 ** -133, 2.0 ** -130], 1: [3 * 2.0 ** -131, -5 * 2.0 ** -130, 2.0 ** -126]},
                 [(0, "payload", 0, 0x38), (0, "payload", 1, 0x50), (1, "payload", 0, 0x01), (1, "payload", 1, 0x82),
                  (1, "payload", 2, 0x08)]),
    # E5M2: 2**-133 / 2**-133 = 1.0 (0x3C); 2**-127 / 2**-120 = 2**-7 (0x20), -3 * 2**-131 / 2**-120 = -1.5 * 2**-10
    # (0x96); flushed: NaN (-57344), 0x00, 0x80.
    "fp8_e5m2": ((SUB_G, TINY_G), {0: [2.0 ** -133], 1: [2.0 ** -127, -3 * 2.0 ** -131]},
                 [(0, "payload", 0, 0x3C), (1, "payload", 0, 0x20), (1, "payload", 1, 0x96)]),
    # (mx - mn) / 255 = 2**-120 / 255 is a subnormal quotient, (x - min) / scale of x = 2**-133 a subnormal operand;
    # both round to the same bytes flushed or not (the fp16 scale is 0 below 2**-25; a quotient < 2**-100 rounds to
    # code 0): INT rows are here for bit-exactness, they cannot show a flush. Head 1: scale f16(1 / 255) = 0x1C04.
    "int8": ((1.0, 1.0), {0: [2.0 ** -120], 1: [1.0, 2.0 ** -133]},
             [(0, "scale", 0, 0x00), (0, "scale", 1, 0x00), (1, "scale", 0, 0x04), (1, "scale", 1, 0x1C),
              (1, "payload", 0, 0xFF), (1, "payload", 1, 0x00)]),
    "int4": ((1.0, 1.0), {0: [2.0 ** -120], 1: [1.0, 2.0 ** -133]},
             [(0, "scale", 0, 0x00), (0, "scale", 1, 0x00), (1, "scale", 0, 0x44), (1, "scale", 1, 0x2C),
              (1, "payload", 0, 0x0F)]),
}


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(SUBNORMAL_DIVISIONS))
def test_write_keeps_subnormal_operands_and_quotients(name, x_dtype, device, backend):
    """Every division of the write (INT scale and codes, FP8 x / g, NVFP4 s and x / S, MXFP4 amax / 6) with a
    subnormal operand or quotient: the reference stores the hand-derived IEEE bytes of `SUBNORMAL_DIVISIONS` and the
    kernel stores the reference's bytes, K and V. On a GPU the FP8 / NVFP4 / MXFP4 cases fail where the division
    flushes subnormals to zero (`tl.math.div_rn` under Triton <= 3.5: PTX div.rn.ftz.f32)."""
    fmt = get_format(name)
    gs, rows, expect = SUBNORMAL_DIVISIONS[name]
    exact = torch.zeros(1, 2, 64, dtype=torch.float64)
    for h, vals in rows.items():
        exact[0, h, :len(vals)] = torch.tensor(vals, dtype=torch.float64)
    x = exact.to(x_dtype)
    assert torch.equal(x.double(), exact)  # every value exact in the input dtype
    g = torch.tensor(gs) if fmt.k.uses_global_scale else None
    kd, ks = _pools(fmt.k, 3, 2, 4, 64, device)
    vd, vs = _pools(fmt.v, 3, 2, 4, 64, device)
    gd = None if g is None else g.to(device)
    write_kv(x.to(device), x.to(device), torch.tensor([5], device=device), kd, ks, vd, vs, fmt, gd, gd,
             backend=backend)
    payload, sc = fmt.k.encode(x, g)
    ref = {"payload": payload.view(torch.uint8)[0], "scale": sc[0]}
    for h, kind, i, want in expect:
        assert int(ref[kind][h, i]) == want, (h, kind, i, hex(int(ref[kind][h, i])))
    for data, scales in ((kd, ks), (vd, vs)):  # slot 5: block 1, offset 1; nothing else written
        data = data.cpu().view(torch.uint8)
        assert torch.equal(data[1, :, 1], ref["payload"])
        data[1, :, 1] = POISON
        assert bool((data == POISON).all())
        if scales is not None:
            assert torch.equal(scales.cpu()[1, :, 1], ref["scale"])


def test_subnormal_division_vectors_are_what_they_claim():
    """The hand values of `SUBNORMAL_DIVISIONS` from independent arithmetic: numpy's IEEE FP32 division, ml_dtypes'
    FP8 / E2M1 / fp16 rounding. The operands and quotients named subnormal are."""
    import ml_dtypes
    import numpy as np

    f = np.float32

    def byte(v, dt) -> int:
        return int(np.array([v], np.float32).astype(dt).view(np.uint8)[0])

    def e2m1(v) -> int:
        return byte(v, ml_dtypes.float4_e2m1fn) & 0xF

    def f16_bits(v) -> int:
        return int(np.array([v], np.float16).view(np.uint16)[0])

    for v in (2.0 ** -133, 2.0 ** -127, -2.0 ** -128, 3 * 2.0 ** -129, 3 * 2.0 ** -131, -5 * 2.0 ** -130, SUB_G):
        assert f(v) == v and 0 < abs(f(v)) < 2.0 ** -126
    # NVFP4: s = amax / (6 g) (two subnormal quotients and one of a subnormal operand), e4m3 byte 0x01; S = 2**-129
    quotients = [f(2.0 ** -133) / f(6), f(2.0 ** -125) / f(6), f(2.0 ** -127) / (f(6) * f(TINY_G))]
    assert all(0 < q < 2.0 ** -126 for q in quotients[:2])
    assert [byte(max(q, f(2.0 ** -9)), ml_dtypes.float8_e4m3fn) for q in quotients] == [0x01] * 3
    big_s = f(2.0 ** -9) * f(TINY_G)
    assert big_s == 2.0 ** -129
    codes = [e2m1(f(v) / big_s) for v in (2.0 ** -127, -2.0 ** -128, 3 * 2.0 ** -129)]
    assert [codes[0] | codes[1] << 4, codes[2]] == [0xC6, 0x05]
    # MXFP4 RCEIL: amax / 6 subnormal, E = -126 (byte 1), codes of x * 2**126
    dd = f(2.0 ** -124) / f(6)
    assert 2.0 ** -127 < dd < 2.0 ** -126 and np.ceil(np.log2(np.float64(dd))) == -126
    codes = [e2m1(f(v) * f(2.0 ** 126)) for v in (2.0 ** -124, 2.0 ** -126, -2.0 ** -125)]
    assert [codes[0] | codes[1] << 4, codes[2]] == [0x26, 0x0C]
    # FP8: x / g
    assert [byte(f(a) / f(b), ml_dtypes.float8_e4m3fn) for a, b in
            ((2.0 ** -133, SUB_G), (2.0 ** -130, SUB_G), (3 * 2.0 ** -131, TINY_G), (-5 * 2.0 ** -130, TINY_G),
             (2.0 ** -126, TINY_G))] == [0x38, 0x50, 0x01, 0x82, 0x08]
    assert [byte(f(a) / f(b), ml_dtypes.float8_e5m2) for a, b in
            ((2.0 ** -133, SUB_G), (2.0 ** -127, TINY_G), (-3 * 2.0 ** -131, TINY_G))] == [0x3C, 0x20, 0x96]
    # INT: f16 scales of (1 - 0) / 255 and / 15; a subnormal quotient below fp16's range
    assert f16_bits(f(1) / f(255)) == 0x1C04 and f16_bits(f(1) / f(15)) == 0x2C44
    assert 0 < f(2.0 ** -120) / f(255) < 2.0 ** -126 and f16_bits(f(2.0 ** -120) / f(255)) == 0


def test_write_empty_and_all_skipped(device, backend):
    fmt = get_format("nvfp4")
    kd, ks = _pools(fmt.k, 2, 1, 4, 32, device)
    vd, vs = _pools(fmt.v, 2, 1, 4, 32, device)
    x = torch.randn(3, 1, 32, device=device)
    write_kv(x[:0], x[:0], torch.zeros(0, dtype=torch.int64, device=device), kd, ks, vd, vs, fmt, backend=backend)
    write_kv(x, x, torch.full((3,), -1, device=device), kd, ks, vd, vs, fmt, backend=backend)
    assert bool((kd.cpu() == POISON).all() and (vs.cpu() == POISON).all())


def test_write_rejects_bad_slots(device, backend):
    from kvx_core.errors import KvxError
    fmt = get_format("int8")
    kd, ks = _pools(fmt.k, 2, 1, 4, 32, device)
    vd, vs = _pools(fmt.v, 2, 1, 4, 32, device)
    x = torch.randn(2, 1, 32, device=device)
    with pytest.raises(KvxError, match="out of range|slots"):
        write_kv(x, x, torch.tensor([0, 8], device=device), kd, ks, vd, vs, fmt, backend=backend)
    with pytest.raises(KvxError, match="twice"):
        write_kv(x, x, torch.tensor([3, 3], device=device), kd, ks, vd, vs, fmt, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("d", [128])
def test_write_gpu_realistic(name, d, backend):
    """Thousands of tokens, 8 KV heads, bf16 input, block size 16, a third of the slots skipped."""
    _check(name, "cuda", torch.bfloat16, t=3000, h=8, d=d, bs=16, seed=d, backend=backend)


def test_cuda_write_refusals_change_nothing(device):
    """Backend "cuda" refuses what the CUDA write cannot serve (before any store); unknown backends are refused."""
    from kvx_core.errors import KvxError, Status
    for name, d in (("bf16", 64), ("nvfp4", 96)):
        fmt = get_format(name)
        kd, ks = _pools(fmt.k, 2, 1, 4, d, device)
        vd, vs = _pools(fmt.v, 2, 1, 4, d, device)
        x = torch.randn(2, 1, d, device=device)
        with pytest.raises(KvxError) as e:
            ops_write.write_pools(x, x, torch.tensor([0, 1], device=device), kd, ks, vd, vs, fmt, backend="cuda")
        assert e.value.status == Status.UNSUPPORTED and "CUDA write cannot serve" in str(e.value)
        assert bool((kd.view(torch.uint8) == POISON).all() and (vd.view(torch.uint8) == POISON).all())
    with pytest.raises(KvxError, match="write backend must be"):
        ops_write.write_pools(x, x, torch.tensor([0, 1], device=device), kd, ks, vd, vs, fmt, backend="cutlass")


def _chunks(top_bits: int, chunk: int):
    """int32 FP32 bit patterns 0..top_bits (inclusive) on the GPU, `chunk` at a time."""
    for start in range(0, top_bits + 1, chunk):
        yield torch.arange(start, min(start + chunk, top_bits + 1), device="cuda", dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("g", [1.0, 0.0123, 3.3])
@pytest.mark.parametrize("name,fmax", [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_cuda_fp8_convert_every_float32(name, fmax, g):
    """Every FP32 value x with |x / g| in the format's range, both signs, written by the CUDA kernel with global
    scale g equals the formats' encode: x / g by the shared-reciprocal division (exact where it must be) and the
    hardware cvt.rn.satfinite round exactly as the oracle (g = 1: every FP8 rounding case of the conversion)."""
    fmt = get_format(name)
    d, bs, chunk = 128, 16, 1 << 25
    rows = chunk // d
    kd = torch.empty(rows // bs, 1, bs, d, dtype=fmt.k.torch_data_dtype, device="cuda")
    vd = torch.empty_like(kd)
    slots = torch.arange(rows, device="cuda")
    gs = torch.tensor([g], device="cuda")
    top = int(torch.tensor(fmax * g).view(torch.int32))
    for bits in _chunks(top, chunk):
        x = torch.cat([bits, bits.new_zeros(chunk - bits.numel())]).view(torch.float32)
        for sign in (1.0, -1.0):
            xs = (x * sign).view(rows, 1, d)
            ops_write.write_pools(xs, xs, slots, kd, None, vd, None, fmt, gs, gs, check=False, backend="cuda")
            ref, _ = fmt.k.encode(xs, gs)
            assert torch.equal(kd.view(torch.uint8).reshape(rows, d), ref.view(torch.uint8).reshape(rows, d)), \
                f"{name} g={g}: first chunk bits {int(bits[0])}, sign {sign}"


@pytest.mark.gpu
@pytest.mark.parametrize("anchor", [4.0, 6.0])
def test_cuda_e2m1_code_every_float32(anchor):
    """Every FP32 value in [-anchor, anchor] as an E2M1 code: MXFP4 groups of one anchor (whose RCEIL scale is
    2^0, so y == x) and 15 probes, written by the CUDA kernel, equal the formats' encode (codes and scale bytes)."""
    fmt = get_format("mxfp4")
    d, bs, groups = 128, 16, 1 << 21
    rows = groups * 16 // d
    kd = torch.empty(rows // bs, 1, bs, d // 2, dtype=torch.uint8, device="cuda")
    ks = torch.empty(rows // bs, 1, bs, d // 16, dtype=torch.uint8, device="cuda")
    vd, vs = torch.empty_like(kd), torch.empty_like(ks)
    slots = torch.arange(rows, device="cuda")
    top = int(torch.tensor(anchor).view(torch.int32))
    for bits in _chunks(top, groups * 15):
        probes = torch.cat([bits, bits.new_zeros(groups * 15 - bits.numel())]).view(torch.float32).view(groups, 15)
        for sign in (1.0, -1.0):
            x = torch.cat([torch.full((groups, 1), anchor, device="cuda"), probes * sign], 1).view(rows, 1, d)
            ops_write.write_pools(x, x, slots, kd, ks, vd, vs, fmt, check=False, backend="cuda")
            ref, sc = fmt.k.encode(x)
            assert torch.equal(kd.reshape(rows, -1), ref.reshape(rows, -1)), f"first bits {int(bits[0])} sign {sign}"
            assert torch.equal(ks.reshape(rows, -1), sc.reshape(rows, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4", "int4", "int8", "fp8_e4m3", "mxfp4_32", "k8v4"])
def test_cuda_write_strided_input_int32_slots_odd_block_size(name):
    """K/V as views of a fused QKV projection (row stride 3 * H * D), int32 slots, block size 12 (not a power of
    two: the kernel divides), 3 heads: bytes equal the Triton write's and the encode's."""
    _strided_odd_block_case(name, "cuda", ("cuda", "triton"))


@pytest.mark.parametrize("name", ["nvfp4", "int4", "int8", "fp8_e4m3", "mxfp4_32", "k8v4"])
def test_cuda_host_write_strided_input_int32_slots_odd_block_size(name, device):
    """The same case through the CUDA write's host build (on the CPU): bytes equal the encode's."""
    if device != "cpu":  # as the `backend` fixture: on a GPU machine the kernel itself runs (the test above)
        pytest.skip("the host build runs where the suite runs on the CPU (Triton's interpreter checks its devices)")
    _strided_odd_block_case(name, "cpu", ("cuda_host",))


def _strided_odd_block_case(name, device, backends):
    fmt = get_format(name)
    t, h, d, bs = 777, 3, 128, 12
    g = torch.Generator(device=device).manual_seed(7)
    qkv = torch.randn(t, 3 * h, d, device=device, generator=g, dtype=torch.bfloat16) * 3
    k, v = qkv[:, h:2 * h], qkv[:, 2 * h:]
    nb = (t + bs - 1) // bs + 3
    slots = torch.randperm(nb * bs, device=device, generator=g)[:t].to(torch.int32)
    slots[::5] = -1
    gk = torch.tensor([0.5, 0.25, 2.0], device=device) if fmt.k.uses_global_scale else None
    gv = torch.tensor([1.5, 0.125, 1.0], device=device) if fmt.v.uses_global_scale else None
    out = {}
    for be in backends:
        kd, ks = _pools(fmt.k, nb, h, bs, d, device)
        vd, vs = _pools(fmt.v, nb, h, bs, d, device)
        if be == "cuda_host":
            assert host_write.write_pools(k, v, slots, kd, ks, vd, vs, fmt, gk, gv) == "cuda_host"
        else:
            ops_write.write_pools(k, v, slots, kd, ks, vd, vs, fmt, gk, gv, backend=be)
        out[be] = [None if x is None else x.view(torch.uint8).cpu() for x in (kd, ks, vd, vs)]
    first = out[backends[0]]
    for other in backends[1:]:
        assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(first, out[other], strict=True))
    keep = slots >= 0
    blk, off = (slots[keep] // bs).long().cpu(), (slots[keep] % bs).long().cpu()
    for tf, x, data, scales, gs in ((fmt.k, k, first[0], first[1], gk), (fmt.v, v, first[2], first[3], gv)):
        payload, sc = tf.encode(x[keep].float().cpu(), None if gs is None else gs.cpu())
        assert torch.equal(data[blk, :, off], payload.view(torch.uint8))
        assert scales is None or torch.equal(scales[blk, :, off], sc.view(torch.uint8))
