"""Packed PTX decoders of dequant.py (used by paged_decode) vs their portable forms, bit for bit, on every byte."""
import pytest
import torch
import triton
import triton.language as tl

from kvx_core.ops.triton.dequant import e2m1_hi_f16_x4, e2m1_lo_f16_x4, u4_hi_f16_sub, u4_lo_f16_sub, u8_f16_sub

HELPERS = {0: e2m1_lo_f16_x4, 1: e2m1_hi_f16_x4, 2: u4_lo_f16_sub, 3: u4_hi_f16_sub, 4: u8_f16_sub}


@triton.jit
def _probe(X, OUT, WHICH: tl.constexpr, ASM: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    b = tl.load(X + offs)
    if WHICH == 0:
        y = e2m1_lo_f16_x4(b, ASM)
    elif WHICH == 1:
        y = e2m1_hi_f16_x4(b, ASM)
    elif WHICH == 2:
        y = u4_lo_f16_sub(b, ASM)
    elif WHICH == 3:
        y = u4_hi_f16_sub(b, ASM)
    else:
        y = u8_f16_sub(b, ASM)
    tl.store(OUT + offs, y.to(tl.int16, bitcast=True))


@pytest.mark.gpu
@pytest.mark.parametrize("which", sorted(HELPERS))
def test_decode_packed_decoders_match_portable(which):
    g = torch.Generator().manual_seed(which)
    x = torch.cat([torch.arange(256, dtype=torch.uint8).repeat(4),
                   torch.randint(0, 256, (3072,), generator=g, dtype=torch.uint8)]).cuda()
    outs = []
    for asm in (True, False):
        out = torch.empty(x.numel(), dtype=torch.int16, device="cuda")
        _probe[(1,)](x, out, WHICH=which, ASM=asm, N=x.numel(), num_warps=4)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])


def test_decode_portable_decoders_values():
    """The portable forms' values (the oracle for the PTX ones): e2m1 * 2**-14 and codes * 2**-24, exactly."""
    from kvx_core.ops.triton import interpreting
    if torch.cuda.is_available() or not interpreting():
        pytest.skip("portable forms are checked on the GPU by the bit-exact test above")
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    x = torch.arange(256, dtype=torch.uint8)
    want = {0: e2m1[x.long() & 15] * 2.0 ** -14, 1: e2m1[x.long() >> 4] * 2.0 ** -14,
            2: (x.long() & 15).double() * 2.0 ** -24, 3: (x.long() >> 4).double() * 2.0 ** -24,
            4: x.double() * 2.0 ** -24}
    for which, ref in want.items():
        out = torch.empty(256, dtype=torch.int16)
        _probe[(1,)](x, out, WHICH=which, ASM=False, N=256)
        assert torch.equal(out.view(torch.float16).double(), ref), which


def test_triton_format_codes_come_from_the_kernel_format():
    """The F_* constexprs the Triton kernels compare against are `FormatCode`'s values."""
    from kvx_core.ops.kernel_format import FormatCode
    from kvx_core.ops.triton import dequant
    for code in FormatCode:
        assert getattr(dequant, f"F_{code.name}").value == code.value
