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

from .helpers import adversarial

ALL = list_formats()
POISON = 0xA5
BACKENDS = ["triton", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _backend_for(backend, fmt, key, value, kd, vd):
    """"cuda" only where the CUDA write serves the call (asserted for the shapes it must serve), else "triton"."""
    if backend == "cuda" and cuda_write.reason(key, value, fmt, kd, vd) is not None:
        assert key.shape[2] not in (32, 64, 128, 256) or fmt.k.quant == 0 or fmt.v.quant == 0, \
            cuda_write.reason(key, value, fmt, kd, vd)
        return "triton"
    return backend


def write_kv(k, v, slots, kd, ks, vd, vs, fmt, k_gs=None, v_gs=None, backend="triton", **kw):
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
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
           backend="triton"):
    fmt = get_format(name)
    nb = (t + bs - 1) // bs + 2
    k = adversarial(t, h, d, seed).to(x_dtype)
    v = adversarial(t, h, d, seed + 1).flip(0).to(x_dtype)
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


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "k8v4"])
def test_write_per_tensor_global_scale(name, device, backend):
    _check(name, device, per_head=False, seed=3, backend=backend)


@pytest.mark.parametrize("name", ["int8", "mxfp4_32", "nvfp4", "bf16"])
@pytest.mark.parametrize("d", [32, 96, 256])
def test_write_non_power_of_two_and_small_and_large_head_dims(name, d, device, backend):
    _check(name, device, d=d, seed=d, backend=backend)


@pytest.mark.parametrize("fmt_name,mbits", [("fp8_e4m3", 3), ("fp8_e5m2", 2)])
def test_fp8_rounding_every_boundary(fmt_name, mbits, device, backend):
    """Every FP8 value, every midpoint between neighbours and one FP32 ulp either side of it."""
    dt = torch.float8_e4m3fn if fmt_name == "fp8_e4m3" else torch.float8_e5m2
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2

    def ulp(m, s):
        return (m.view(torch.int32) + s).view(torch.float32)

    x = torch.cat([vals, mids, ulp(mids, 1), ulp(mids, -1), -mids, vals * 1.0000001])
    x = torch.cat([x, x.new_zeros((-x.numel()) % 64)]).view(-1, 1, 64)
    fmt = get_format(fmt_name)
    kd, _ = _pools(fmt.k, x.shape[0], 1, 1, 64, device)
    vd, _ = _pools(fmt.v, x.shape[0], 1, 1, 64, device)
    slots = torch.arange(x.shape[0], device=device)
    write_kv(x.to(device), x.to(device), slots, kd, None, vd, None, fmt, backend=backend)
    ref, _ = fmt.k.encode(x)
    assert torch.equal(kd.cpu().view(torch.uint8)[:, 0, 0], ref.view(torch.uint8)[:, 0])
    assert torch.equal(vd.cpu().view(torch.uint8), kd.cpu().view(torch.uint8))


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
    fmt = get_format(name)
    t, h, d, bs = 777, 3, 128, 12
    g = torch.Generator(device="cuda").manual_seed(7)
    qkv = torch.randn(t, 3 * h, d, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    k, v = qkv[:, h:2 * h], qkv[:, 2 * h:]
    nb = (t + bs - 1) // bs + 3
    slots = torch.randperm(nb * bs, device="cuda", generator=g)[:t].to(torch.int32)
    slots[::5] = -1
    gk = torch.tensor([0.5, 0.25, 2.0], device="cuda") if fmt.k.uses_global_scale else None
    gv = torch.tensor([1.5, 0.125, 1.0], device="cuda") if fmt.v.uses_global_scale else None
    out = {}
    for be in ("cuda", "triton"):
        kd, ks = _pools(fmt.k, nb, h, bs, d, "cuda")
        vd, vs = _pools(fmt.v, nb, h, bs, d, "cuda")
        ops_write.write_pools(k, v, slots, kd, ks, vd, vs, fmt, gk, gv, backend=be)
        out[be] = [x.view(torch.uint8).cpu() for x in (kd, ks, vd, vs) if x is not None]
    assert all(torch.equal(a, b) for a, b in zip(out["cuda"], out["triton"], strict=True))
    keep = slots >= 0
    blk, off = (slots[keep] // bs).long().cpu(), (slots[keep] % bs).long().cpu()
    v_data = out["cuda"][-2 if fmt.v.scale_dim(d) else -1]
    for tf, x, data, gs in ((fmt.k, k, out["cuda"][0], gk), (fmt.v, v, v_data, gv)):
        payload, _ = tf.encode(x[keep].float().cpu(), None if gs is None else gs.cpu())
        assert torch.equal(data[blk, :, off], payload.view(torch.uint8))
