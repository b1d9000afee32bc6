"""Triton fused write vs the formats' torch encode: payload AND scale bytes bit-identical on adversarial
inputs (RNE ties, saturation, NVFP4 underflow/overflow guards, MXFP4 exponents, NaN/inf, subnormals),
every format and input dtype; skipped (-1) slots and everything else in the pools untouched."""
import pytest
import torch

from kvx_core.formats import get_format, list_formats, rotate
from kvx_core.ops.triton import write_kv

from .helpers import adversarial

ALL = list_formats()
POISON = 0xA5


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


def _check(name, device, x_dtype=torch.float32, t=9, h=2, d=64, bs=4, per_head=True, seed=0, slots=None):
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
    dev = lambda g: None if g is None else g.to(device)
    write_kv(k.to(device), v.to(device), slots.to(device), kd, ks, vd, vs, fmt, dev(gk), dev(gv))
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
def test_write_bit_identical(name, x_dtype, device):
    _check(name, device, x_dtype)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "k8v4"])
def test_write_per_tensor_global_scale(name, device):
    _check(name, device, per_head=False, seed=3)


@pytest.mark.parametrize("name", ["int8", "mxfp4_32", "nvfp4", "bf16"])
@pytest.mark.parametrize("d", [32, 96])
def test_write_non_power_of_two_and_small_head_dims(name, d, device):
    _check(name, device, d=d, seed=d)


@pytest.mark.parametrize("fmt_name,mbits", [("fp8_e4m3", 3), ("fp8_e5m2", 2)])
def test_fp8_rounding_every_boundary(fmt_name, mbits, device):
    """Every FP8 value, every midpoint between neighbours and one FP32 ulp either side of it."""
    dt = torch.float8_e4m3fn if fmt_name == "fp8_e4m3" else torch.float8_e5m2
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    ulp = lambda m, s: (m.view(torch.int32) + s).view(torch.float32)
    x = torch.cat([vals, mids, ulp(mids, 1), ulp(mids, -1), -mids, vals * 1.0000001])
    x = torch.cat([x, x.new_zeros((-x.numel()) % 64)]).view(-1, 1, 64)
    fmt = get_format(fmt_name)
    kd, _ = _pools(fmt.k, x.shape[0], 1, 1, 64, device)
    vd, _ = _pools(fmt.v, x.shape[0], 1, 1, 64, device)
    slots = torch.arange(x.shape[0], device=device)
    write_kv(x.to(device), x.to(device), slots, kd, None, vd, None, fmt)
    ref, _ = fmt.k.encode(x)
    assert torch.equal(kd.cpu().view(torch.uint8)[:, 0, 0], ref.view(torch.uint8)[:, 0])
    assert torch.equal(vd.cpu().view(torch.uint8), kd.cpu().view(torch.uint8))


def test_write_empty_and_all_skipped(device):
    fmt = get_format("nvfp4")
    kd, ks = _pools(fmt.k, 2, 1, 4, 32, device)
    vd, vs = _pools(fmt.v, 2, 1, 4, 32, device)
    x = torch.randn(3, 1, 32, device=device)
    write_kv(x[:0], x[:0], torch.zeros(0, dtype=torch.int64, device=device), kd, ks, vd, vs, fmt)
    write_kv(x, x, torch.full((3,), -1, device=device), kd, ks, vd, vs, fmt)
    assert bool((kd.cpu() == POISON).all() and (vs.cpu() == POISON).all())


def test_write_rejects_bad_slots(device):
    from kvx_core.errors import KvxError
    fmt = get_format("int8")
    kd, ks = _pools(fmt.k, 2, 1, 4, 32, device)
    vd, vs = _pools(fmt.v, 2, 1, 4, 32, device)
    x = torch.randn(2, 1, 32, device=device)
    with pytest.raises(KvxError, match="out of range|slots"):
        write_kv(x, x, torch.tensor([0, 8], device=device), kd, ks, vd, vs, fmt)
    with pytest.raises(KvxError, match="twice"):
        write_kv(x, x, torch.tensor([3, 3], device=device), kd, ks, vd, vs, fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("d", [128])
def test_write_gpu_realistic(name, d):
    """Thousands of tokens, 8 KV heads, bf16 input, block size 16, a third of the slots skipped."""
    _check(name, "cuda", torch.bfloat16, t=3000, h=8, d=d, bs=16, seed=d)
