"""The CUDA 4-bit paged decode (kvx_core/ops/cuda) vs the float64 torch oracle over the same pools.

GPU tests run the kernel with `backend="cuda"` (so a silent fallback to Triton cannot pass them). The
CPU tests compile the CUDA source with nvcc for sm_90a and check the ctypes mirror against it, and run the kernels'
own source built for the host (`cuda_host`, host_decode.py) on a smaller set of the GPU tests' cases.
"""
import ctypes
import math
import os

import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format
from kvx_core.ops.cuda import build, mirror_mismatch, nvcc_path
from kvx_core.ops.cuda.decode import DecodeParams, pool_reason, supports
from kvx_core.ops.decode import decode_pools
from kvx_core.ops.graphs import capture
from kvx_core.ops.kernel_format import MIXED, CudaCode, FormatCode, kernel_format

from . import host_decode
from .oracle import make_pools, make_table, ref_decode

CUDA_FORMATS = ["nvfp4", "nvfp4_rot", "mxfp4", "mxfp4_32", "mxfp4_rot", "int4", "int4_rot", "int8", "fp8_e4m3",
                "fp8_e5m2", "k8v4", "k8v4_rot"]


def _gs(fmt, hkv, seed, k):
    uses = fmt.k.uses_global_scale if k else fmt.v.uses_global_scale
    return (torch.rand(hkv, generator=torch.Generator().manual_seed(seed + (0 if k else 7))) + 0.5) if uses else None


def _run(name, lens, hkv=2, qh=4, d=128, bs=16, q_dtype=torch.bfloat16, splits=None, softcap=None, window=None,
         seed=0, pools=None, q_scale=1.0, kv_scale=1.0, backend="cuda"):
    """The CUDA decode (`backend` "cuda": the kernel on the GPU; "cuda_host": its source built for the CPU,
    host_decode.py) and the oracle over the same pools."""
    fmt = get_format(name)
    dev = "cuda" if backend == "cuda" else "cpu"
    nb = sum(math.ceil(L / bs) for L in lens) + 3
    kg, vg = _gs(fmt, hkv, seed, True), _gs(fmt, hkv, seed, False)
    kd, ks, vd, vs = [t.to(dev) for t in pools(fmt, nb, hkv, bs, d, seed)] if pools else \
        make_pools(fmt, nb, hkv, bs, d, device=dev, seed=seed, k_gs=kg, v_gs=vg, scale=kv_scale)
    bt = make_table(lens, bs, nb, device=dev, seed=seed)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), hkv * qh, d, generator=torch.Generator().manual_seed(seed + 3))
    q = (q * q_scale).to(q_dtype).to(dev)
    kgd, vgd = (None if g is None else g.to(dev) for g in (kg, vg))
    if backend == "cuda_host":
        o, lse = host_decode.decode(q, kd, ks, vd, vs, kgd, vgd, bt, sl, fmt, num_splits=splits or 1,
                                    softcap=softcap, window=window)
    else:
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        o, lse = decode_pools(q, kd, ks, vd, vs, kgd, vgd, bt, sl, fmt, softcap=softcap, window=window,
                              num_splits=splits, out=out, backend="cuda")
    ro, rl = ref_decode(q, fmt, kd, ks, vd, vs, kg, vg, bt, sl, softcap=softcap, window=window)
    return o.cpu().double(), lse.cpu().double(), ro, rl


def _check(o, lse, ro, rl, tol=1e-2):
    assert not torch.isnan(o).any()
    assert (o - ro).norm() / ro.norm().clamp_min(1e-30) < tol
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    if fin.any():  # absolute near 0, relative for huge scores (fp32 accumulation)
        assert ((lse[fin] - rl[fin]).abs() / rl[fin].abs().clamp_min(1.0)).max() < 2e-2


# ------------------------------------------------------------------ CPU: build + ABI mirror
def test_cuda_source_compiles_and_mirror_matches():
    """nvcc compiles paged_decode_mma.cu for sm_90a; the ctypes DecodeParams has the C struct's size and field
    offsets (a reordered field would pass a size check and launch on garbage). Built into the library's own cache
    (keyed by the sources' digest, arch and nvcc): on the GPU machine `scripts/gpu_suite.sh` has built it already,
    where a private build took 8 minutes beside 15 test workers."""
    if nvcc_path() is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc is required in CI (it compiles the CUDA decode kernel)")
        pytest.skip("nvcc not installed")
    path = build("90a")
    lib = ctypes.CDLL(str(path))
    assert mirror_mismatch(lib, "kvx_decode_params_size", DecodeParams, "kvx_decode_params_layout") is None
    fields = list(DecodeParams._fields_)
    fields[0], fields[4] = fields[4], fields[0]  # kd <-> ks: same size, another layout

    class Swapped(ctypes.Structure):
        _fields_ = fields
    assert "C layout vs the mirror" in mirror_mismatch(lib, "kvx_decode_params_size", Swapped,
                                                       "kvx_decode_params_layout")
    assert build("90a") == path and path.name.startswith("kvx_paged_decode_mma-90a-")  # cached


@pytest.mark.parametrize("name", CUDA_FORMATS + ["bf16", "fp16", "fp32", "k8v4"])
def test_cuda_codes_derive_from_the_kernel_format(name):
    """Each format the CUDA kernel serves has one CUDA code, derived from its KernelFormat."""
    fmt = get_format(name)
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    want = {"nvfp4": CudaCode.NVFP4, "mxfp4": CudaCode.MXFP4, "mxfp4_32": CudaCode.MXFP4, "int4": CudaCode.INT4,
            "int8": CudaCode.INT8, "fp8_e4m3": CudaCode.E4M3, "fp8_e5m2": CudaCode.E5M2}.get(name.removesuffix("_rot"))
    if name.startswith("k8v4"):  # a mixed pair the kernel is instantiated for
        assert kk != kv and (kk.cuda_code, kv.cuda_code) == (CudaCode.E4M3, CudaCode.NVFP4)
        assert (kk.cuda_code, kv.cuda_code) in MIXED
    else:
        assert kk == kv and kk.cuda_code == want
    assert kk.e5m2 == (fmt.k.torch_data_dtype == torch.float8_e5m2)
    assert (kk.code == FormatCode.FP8) == (kk.cuda_code in (CudaCode.E4M3, CudaCode.E5M2))


def test_supports_names_the_reason():
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    kd = torch.zeros(2, 1, 16, 64, dtype=torch.uint8)
    ks = torch.zeros(2, 1, 16, 8, dtype=torch.uint8)
    assert "CUDA" in supports(q, get_format("nvfp4"), kd, ks, kd, ks)  # a CPU tensor
    assert "format bf16" in supports(q, get_format("bf16"), kd, ks, kd, ks)
    assert supports(q, get_format("k8v4"), kd, ks, kd, ks) == "not a CUDA tensor"  # k8v4 is served


@pytest.mark.parametrize("pool", ["kd", "ks", "vd", "vs"])
def test_pools_whose_page_stride_reaches_2_31_bytes_are_not_served(pool):
    """The kernel multiplies a block id by a page stride in 32 x 32 -> 64 bits: a stride of 2**31 bytes goes to
    Triton with the reason (meta tensors: only strides are read)."""
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    shapes = {"kd": (2, 1, 16, 64), "ks": (2, 1, 16, 8), "vd": (2, 1, 16, 64), "vs": (2, 1, 16, 8)}
    pools = {}
    for name, shape in shapes.items():
        stride = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
        if name == pool:
            stride = (2**31,) + stride[1:]
        pools[name] = torch.empty_strided(shape, stride, dtype=torch.uint8, device="meta")
    reason = pool_reason(q, get_format("nvfp4"), pools["kd"], pools["ks"], pools["vd"], pools["vs"])
    side, what = ("K" if pool[0] == "k" else "V"), ("payload" if pool[1] == "d" else "scale")
    assert reason == f"{side} {what} page stride {2**31} reaches 2**31 bytes"
    pools[pool] = torch.empty_strided(shapes[pool], (2**31 - 64,) + pools[pool].stride()[1:], dtype=torch.uint8,
                                      device="meta")
    assert pool_reason(q, get_format("nvfp4"), pools["kd"], pools["ks"], pools["vd"], pools["vs"]) is None


# ------------------------------------------------------------------ GPU: every served case vs the oracle
@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_FORMATS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_cuda_decode_formats_head_dims(name, d):
    """Ragged lengths incl. 0 and 1, GQA 4, multi-page tiles, several splits."""
    o, lse, ro, rl = _run(name, [37, 1, 0, 300, 1000], d=d, splits=3, seed=d)
    _check(o, lse, ro, rl)
    assert torch.all(o[2] == 0) and torch.all(torch.isneginf(lse[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4", "int4", "int4_rot", "int8", "fp8_e4m3", "fp8_e5m2", "k8v4"])
def test_cuda_decode_fp16_queries(name):
    o, lse, ro, rl = _run(name, [77, 513, 16], q_dtype=torch.float16, splits=2)
    _check(o, lse, ro, rl)


@pytest.mark.gpu
@pytest.mark.parametrize("qh,hkv", [(1, 4), (2, 2), (5, 1), (8, 2), (16, 1)])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4_32", "int4", "int8", "fp8_e4m3", "k8v4"])
def test_cuda_decode_gqa(qh, hkv, name):
    o, lse, ro, rl = _run(name, [20, 333], hkv=hkv, qh=qh, splits=2)
    _check(o, lse, ro, rl)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 32, 48, 128, 256])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4", "int8", "fp8_e5m2", "k8v4"])
def test_cuda_decode_block_sizes(bs, name):
    o, lse, ro, rl = _run(name, [bs * 3 + 5, 2 * bs - 1, 7], bs=bs, splits=2, seed=bs)
    _check(o, lse, ro, rl)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4", "int8", "fp8_e4m3", "k8v4"])
def test_cuda_decode_softcap_window(name):
    o, lse, ro, rl = _run(name, [50, 3, 400, 129], softcap=5.0, window=37, splits=2)
    _check(o, lse, ro, rl)


@pytest.mark.gpu
@pytest.mark.parametrize("name,q_scale,kv_scale", [
    ("fp8_e4m3", 1e6, 1.0),     # bf16 queries far outside the f16 range: scaled by a power of two
    ("fp8_e4m3", 1e-6, 1.0),    # tiny queries
    ("fp8_e4m3", 1.0, 1e-3),    # E4M3 subnormal payloads
    ("fp8_e5m2", 1.0, 1e-5),    # E5M2 subnormal payloads
    ("fp8_e4m3", 1.0, 300.0),   # saturated payloads
    ("int8", 1e6, 1.0),         # bf16 queries far outside the f16 range (int8 also runs f16 operands)
    ("k8v4", 1e6, 1.0),         # the same for k8v4's FP8 keys; its NVFP4 values run f16 operands too
    ("k8v4", 1.0, 1e-3),        # E4M3 subnormal keys, tiny NVFP4 values
    ("nvfp4", 1e6, 1.0),        # NVFP4 and INT4 keys run f16 operands for bf16 queries too
    ("nvfp4", 1e-6, 1.0),
    ("nvfp4", 1.0, 1e-3),       # tiny NVFP4 values: products down to 2^-24, the smallest f16 subnormal
    ("int4", 1e6, 1.0),
    ("int4", 1e-6, 1.0),
    ("int4", 1.0, 1e-3),
])
def test_cuda_decode_f16_operand_ranges(name, q_scale, kv_scale):
    o, lse, ro, rl = _run(name, [300, 17], q_scale=q_scale, kv_scale=kv_scale, splits=2)
    _check(o, lse, ro, rl)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4, 64])
def test_cuda_decode_splits_and_long_context(splits):
    o, lse, ro, rl = _run("nvfp4", [8192, 5000, 17], hkv=8, qh=4, splits=splits)
    _check(o, lse, ro, rl)


def _raw_pools(scale_lo, scale_hi):
    """Every payload bit pattern (random bytes) with scale bytes drawn from [scale_lo, scale_hi]."""
    def make(fmt, nb, hkv, bs, d, seed):
        g = torch.Generator().manual_seed(seed)
        out = []
        for tf in (fmt.k, fmt.v):
            data = torch.randint(0, 256, (nb, hkv, bs, tf.payload_dim(d)), generator=g, dtype=torch.uint8)
            sk = tf.scale_dim(d)
            if type(tf).__name__ == "IntFormat":
                sc = torch.empty(nb, hkv, bs, 2, dtype=torch.float16)
                sc[..., 0] = torch.rand(nb, hkv, bs, generator=g).half() * 0.1
                sc[..., 1] = -torch.rand(nb, hkv, bs, generator=g).half()
                scales = sc.view(torch.uint8)
            else:
                scales = torch.randint(scale_lo, scale_hi + 1, (nb, hkv, bs, sk), generator=g, dtype=torch.uint8)
            out += [data, scales]
        return out
    return make


@pytest.mark.gpu
@pytest.mark.parametrize("name,lo,hi", [
    ("nvfp4", 0x00, 0x07),   # E4M3 zero and subnormal scales (2^-9 .. 7 * 2^-9)
    ("nvfp4", 0x70, 0x7E),   # the largest finite scales (up to 448)
    ("nvfp4", 0x00, 0x7E),   # everything finite
    ("mxfp4", 0, 4),         # E8M0 2^-127 (bf16 subnormal) .. 2^-123
    ("mxfp4_32", 100, 140),
    ("int4", 0, 0),
    ("int8", 0, 0),
])
def test_cuda_decode_all_bit_patterns(name, lo, hi):
    """Random payload bytes (every e2m1 / u4 code, -0 included) with extreme scales: exact operands."""
    o, lse, ro, rl = _run(name, [200, 33], pools=_raw_pools(lo, hi), splits=2)
    if ro.abs().max() == 0:
        assert torch.all(o == 0)
    else:
        _check(o, lse, ro, rl)


# ------------------------------------------------------------------ CPU: the kernels' source built for the host
@pytest.mark.parametrize("name", CUDA_FORMATS)
def test_cuda_host_decode_formats(name):
    """Every served format: ragged lengths incl. 0 and 1, GQA 4, three splits (the merge), rotated formats through
    the library's own query rotation and output rotation."""
    o, lse, ro, rl = _run(name, [37, 1, 0, 300], splits=3, backend="cuda_host")
    _check(o, lse, ro, rl)
    assert torch.all(o[2] == 0) and torch.all(torch.isneginf(lse[2]))


@pytest.mark.parametrize("name,d,q_dtype,qh,hkv,bs", [
    ("nvfp4", 64, torch.bfloat16, 4, 2, 16), ("int8", 256, torch.bfloat16, 4, 2, 16),
    ("int4", 128, torch.float16, 4, 2, 16), ("k8v4", 128, torch.float16, 4, 2, 16),
    ("fp8_e5m2", 128, torch.float16, 4, 2, 16), ("nvfp4", 128, torch.bfloat16, 16, 1, 16),
    ("mxfp4_32", 128, torch.bfloat16, 5, 1, 16), ("int4", 128, torch.bfloat16, 1, 4, 48),
    ("fp8_e4m3", 128, torch.bfloat16, 8, 2, 32)])
def test_cuda_host_decode_geometries(name, d, q_dtype, qh, hkv, bs):
    """Head dims 64 / 256, f16 queries, 16 query heads per KV head (two mma column blocks), odd GQA, block sizes
    32 / 48."""
    o, lse, ro, rl = _run(name, [bs * 3 + 5, 2 * bs - 1, 7], d=d, q_dtype=q_dtype, qh=qh, hkv=hkv, bs=bs, splits=2,
                          seed=d + bs, backend="cuda_host")
    _check(o, lse, ro, rl)


@pytest.mark.parametrize("name", ["nvfp4", "int4", "k8v4"])
def test_cuda_host_decode_softcap_window(name):
    o, lse, ro, rl = _run(name, [50, 3, 200, 129], softcap=5.0, window=37, splits=2, backend="cuda_host")
    _check(o, lse, ro, rl)


@pytest.mark.parametrize("name,q_scale,kv_scale", [("nvfp4", 1e6, 1.0), ("nvfp4", 1.0, 1e-3), ("int4", 1e-6, 1.0),
                                                   ("fp8_e4m3", 1.0, 1e-3), ("k8v4", 1e6, 1.0)])
def test_cuda_host_decode_f16_operand_ranges(name, q_scale, kv_scale):
    o, lse, ro, rl = _run(name, [150, 17], q_scale=q_scale, kv_scale=kv_scale, splits=2, backend="cuda_host")
    _check(o, lse, ro, rl)


@pytest.mark.parametrize("name,lo,hi", [("nvfp4", 0x00, 0x7E), ("mxfp4", 0, 4), ("int4", 0, 0)])
def test_cuda_host_decode_all_bit_patterns(name, lo, hi):
    o, lse, ro, rl = _run(name, [100, 33], pools=_raw_pools(lo, hi), splits=2, backend="cuda_host")
    _check(o, lse, ro, rl)


@pytest.mark.gpu
def test_cuda_backend_refuses_what_it_cannot_serve():
    with pytest.raises(KvxError, match="4 warps"):
        decode_pools(*_tiny_nvfp4(), backend="cuda", num_warps=8)
    q = torch.zeros(1, 4, 128, dtype=torch.float16, device="cuda")
    fmt = get_format("mxfp4")
    kd = torch.zeros(2, 1, 16, 64, dtype=torch.uint8, device="cuda")
    ks = torch.zeros(2, 1, 16, 8, dtype=torch.uint8, device="cuda")
    bt = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    sl = torch.ones(1, dtype=torch.int32, device="cuda")
    with pytest.raises(KvxError) as e:
        decode_pools(q, kd, ks, kd, ks, None, None, bt, sl, fmt, backend="cuda")
    assert e.value.status == Status.UNSUPPORTED and "bf16" in str(e.value)
    o, _ = decode_pools(q, kd, ks, kd, ks, None, None, bt, sl, fmt)  # auto: Triton serves fp16 MXFP4
    assert o.shape == q.shape


def _tiny_nvfp4():
    fmt = get_format("nvfp4")
    kd, ks, vd, vs = make_pools(fmt, 4, 1, 16, 128, device="cuda")
    q = torch.randn(1, 4, 128, device="cuda", dtype=torch.bfloat16)
    bt = make_table([20], 16, 4, device="cuda")
    return q, kd, ks, vd, vs, None, None, bt, torch.tensor([20], dtype=torch.int32, device="cuda"), fmt


@pytest.mark.gpu
def test_cuda_decode_is_graph_capturable():
    fmt = get_format("nvfp4")
    kd, ks, vd, vs = make_pools(fmt, 8, 2, 16, 128, device="cuda")
    bt = make_table([100], 16, 8, device="cuda")
    sl = torch.tensor([100], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 8, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(1, 8, device="cuda")
    run = lambda: decode_pools(q, kd, ks, vd, vs, None, None, bt, sl, fmt, out=out, lse=lse, num_splits=2,  # noqa: E731
                               max_seq_len=100, backend="cuda")
    run()
    ref = out.clone()
    g, _ = capture(run)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 64, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_merge_matches_the_triton_merge_on_adversarial_partials(splits, dtype):
    """The library's merge (what the CUDA decode launches after itself) against the Triton merge: empty splits
    (-inf, zero output), whole empty rows (0, -inf), NaN partials (NaN out and LSE), huge log-sum-exps."""
    from kvx_core.ops.cuda.decode import merge
    from kvx_core.ops.triton.merge import merge_splits
    g = torch.Generator(device="cuda").manual_seed(splits)
    b, hq, d = 3, 8, 128
    mo = torch.randn(b, hq, splits, d, device="cuda", generator=g)
    ml = torch.randn(b, hq, splits, device="cuda", generator=g) * 30
    ml[0, :, ::2] = float("-inf")
    mo[0, :, ::2] = 0.0
    ml[1, 0] = float("-inf")  # a row whose every split is empty
    mo[1, 0] = 0.0
    ml[1, 1, -1] = float("nan")
    ml[2, 2] += 1e4  # far above the other rows: exp2 of the differences underflows, never overflows
    got, want = (torch.empty(b, hq, d, device="cuda", dtype=dtype) for _ in range(2))
    gl, wl = (torch.empty(b, hq, device="cuda") for _ in range(2))
    merge(mo, ml, got, gl)
    merge_splits(mo, ml, want, wl)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(gl.isnan(), wl.isnan())
    assert torch.equal(gl.isneginf(), wl.isneginf()) and gl[1, 0].isneginf() and (got[1, 0] == 0).all()
    assert gl[1, 1].isnan() and got[1, 1].isnan().all()
    fin = wl.isfinite()
    assert ((gl - wl)[fin].abs() <= 1e-5 * wl[fin].abs().clamp_min(1)).all()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    ok = ~want.isnan()
    assert ((got.float() - want.float())[ok].abs() <= tol * want.float()[ok].abs().clamp_min(1)).all()


@pytest.mark.gpu
def test_cuda_merge_with_sinks_matches_the_formula():
    """A sink joins each row's denominator with weight exp(sink) and no value: out * exp(lse - lse'), lse' =
    logaddexp(lse, sink); a row with no key gives 0 and lse' = sink."""
    from kvx_core.ops.cuda.decode import merge
    g = torch.Generator(device="cuda").manual_seed(1)
    b, hq, s, d = 2, 4, 5, 64
    mo = torch.randn(b, hq, s, d, device="cuda", generator=g)
    ml = torch.randn(b, hq, s, device="cuda", generator=g) * 4
    ml[1, 3] = float("-inf")
    mo[1, 3] = 0.0
    sinks = torch.tensor([-1e4, 0.0, 3.0, 1e4], device="cuda")
    out, lse = torch.empty(b, hq, d, device="cuda"), torch.empty(b, hq, device="cuda")
    merge(mo, ml, out, lse)
    out_s, lse_s = torch.empty_like(out), torch.empty_like(lse)
    merge(mo, ml, out_s, lse_s, sinks)
    full = torch.logaddexp(lse.double(), sinks.double())
    assert torch.allclose(lse_s.double(), full, rtol=1e-6, atol=1e-4)
    assert torch.allclose(out_s.double(), out.double() * torch.exp(lse.double() - full)[..., None].nan_to_num(0.0),
                          rtol=1e-5, atol=1e-6)
    assert (out_s[1, 3] == 0).all() and lse_s[1, 3] == sinks[3]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_merge_rotating_back_equals_merge_then_rotate_bit_for_bit(d, dtype):
    """`_rot` formats: the merge that rotates its FP32 row back gives the bits of an FP32 merge followed by
    `ops.rotation.rotate` (formats/rotation.py's butterfly and saturation), NaN rows and huge rows included."""
    from kvx_core.ops.cuda.decode import merge
    from kvx_core.ops.rotation import rotate
    g = torch.Generator(device="cuda").manual_seed(d)
    b, hq, s = 2, 6, 7
    mo = torch.randn(b, hq, s, d, device="cuda", generator=g)
    ml = torch.randn(b, hq, s, device="cuda", generator=g) * 10
    mo[0, 1] = 3e38  # saturates to FP32_MAX / D before the butterfly, to the dtype's max after it
    mo[0, 2, :, 5] = float("inf")
    ml[1, 0, 3] = float("nan")
    ml[1, 1] = float("-inf")
    mo[1, 1] = 0.0
    sinks = torch.randn(hq, device="cuda", generator=g)
    for sk in (None, sinks):
        fp32, lse32 = torch.empty(b, hq, d, device="cuda"), torch.empty(b, hq, device="cuda")
        merge(mo, ml, fp32, lse32, sk)
        got, lse = torch.empty(b, hq, d, device="cuda", dtype=dtype), torch.empty(b, hq, device="cuda")
        merge(mo, ml, got, lse, sk, rotate_out=True)
        want = rotate(fp32, out_dtype=dtype)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0), want.nan_to_num(0))
        assert torch.equal(lse.nan_to_num(0), lse32.nan_to_num(0)) and torch.equal(lse.isnan(), lse32.isnan())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4_rot", "int4_rot", "k8v4_rot"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_cuda_rot_decode_rotating_q_itself_equals_rotating_q_first(name, q_dtype):
    """`_rot` formats in one library call: the queries rotated into the step's scratch by the library give the
    bits of `ops.rotation.rotate(q)` handed to the decode (rows of huge and non-finite values included)."""
    from kvx_core.ops.cuda.decode import launch
    from kvx_core.ops.rotation import rotate
    fmt = get_format(name)
    kd, ks, vd, vs = make_pools(fmt, 12, 2, 16, 128, device="cuda", seed=2)
    kg = _gs(fmt, 2, 2, True)
    vg = _gs(fmt, 2, 2, False)
    kg, vg = (None if g is None else g.cuda() for g in (kg, vg))
    bt, sl = make_table([100, 37], 16, 12, device="cuda"), torch.tensor([100, 37], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 128, device="cuda").to(q_dtype)
    q[1, 3] = torch.finfo(q_dtype).max
    q[1, 4, 7] = float("inf")
    mid_o, mid_l = torch.empty(2, 8, 4, 128, device="cuda"), torch.empty(2, 8, 4, device="cuda")
    outs = []
    for qq, scratch in ((q, torch.empty(2, 8, 128, device="cuda", dtype=q_dtype)), (rotate(q), None)):
        o, lse = torch.empty_like(q), torch.empty(2, 8, device="cuda")
        launch(qq, kd, _scales(ks, kd), vd, _scales(vs, vd), kg, vg, bt, sl, fmt, mid_o, mid_l, 128 ** -0.5, None,
               None, out=o, lse=lse, rotate_out=True, q_rot=scratch)
        outs.append((o, lse))
    (a, la), (b, lb) = outs
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))
    assert torch.equal(la.nan_to_num(0), lb.nan_to_num(0))


def _scales(sc, data):
    """The scale-pool argument of `cuda_decode.launch` (the data pool for formats without one: never read)."""
    return data if sc is None else sc
