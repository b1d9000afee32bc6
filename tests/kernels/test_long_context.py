"""Long-context decode numerics: at 128k and 512k tokens the KVX decode (splits over the context, FP32 partial
sums merged by their LSEs) stays as close to the FP64 oracle over the same pages as at 4k tokens: the accumulation
must not degrade with length (FA3-FP8's lesson: a one-level FP8 accumulation lost vLLM's 128k needle).

Two query kinds per length: a flat softmax (small q: every key carries weight ~1/n, the hardest case for the sums)
and a needle (q aligned with one key a third of the way in: the answer is that key's value). On CPU the Triton
interpreter runs the same test at short lengths (it checks the test itself); the long lengths are `gpu`-marked.
"""
from __future__ import annotations

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import BlockTable, SeqLens
from kvx_core.ops import attention, dispatch

OUT_TOL = 1e-2
"""max |out - oracle| / max |oracle| per sequence: the BF16 output's rounding (2^-9 of a value) with margin; the
same bound as the short-context tests, at every length."""
LSE_TOL = 1e-5
"""|lse - oracle| / max(1, |oracle|): FP32 sums of up to 512k exponentials merged over splits (a one-level FP16 /
FP8 accumulation would be off by orders more)."""
H, HQ, D, BS = 2, 8, 128, 16


def _run(name: str, device: str, lengths: list[int], needle: bool) -> None:
    n = max(lengths)
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(n, H, D, generator=g, device=device)
    v = torch.randn(n, H, D, generator=g, device=device)
    c = PagedKVCache(name, num_layers=1, num_blocks=n // BS, block_size=BS, num_kv_heads=H, head_dim=D, device=device)
    c.write(0, k.bfloat16(), v.bfloat16(), torch.arange(n, device=device))
    desc = c.descriptor(0)
    rows = torch.arange(n // BS, dtype=torch.int32, device=device).repeat(len(lengths), 1)  # shared prefix
    table, lens = BlockTable.packed(rows), SeqLens(torch.tensor(lengths, dtype=torch.int32, device=device))
    if needle:  # each sequence's queries point at its key at a third of its length (score ~ 2 |k|^2 / sqrt(D))
        pos = torch.tensor([m // 3 for m in lengths], device=device)
        q = 2.0 * k[pos].repeat_interleave(HQ // H, dim=1)
    else:
        q = 0.05 * torch.randn(len(lengths), HQ, D, generator=g, device=device)
    q = q.bfloat16()
    out, lse = dispatch.paged_decode(q, desc, table, lens)
    ref, ref_lse = attention.paged_decode(q.float(), desc, table, lens)
    for b, m in enumerate(lengths):
        err = float((out[b].float() - ref[b]).abs().max() / ref[b].abs().max())
        lse_err = float(((lse[b] - ref_lse[b]).abs() / ref_lse[b].abs().clamp_min(1.0)).max())
        assert err <= OUT_TOL and lse_err <= LSE_TOL, (name, m, needle, err, lse_err)


@pytest.mark.parametrize("needle", [False, True])
@pytest.mark.parametrize("name", ["bf16", "int8", "nvfp4"])
def test_decode_at_lengths_against_fp64_oracle(name, needle, device, monkeypatch):
    """Short lengths on whatever device the kernel tests run on (the Triton kernels under the interpreter on CPU)."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    _run(name, device, [256, 1024] if device == "cpu" else [4096, 16384], needle)


@pytest.mark.gpu
@pytest.mark.parametrize("needle", [False, True])
@pytest.mark.parametrize("name", ["bf16", "int8", "fp8_e4m3", "nvfp4", "int4", "mxfp4"])
def test_decode_at_128k_and_512k_against_fp64_oracle(name, needle):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _run(name, "cuda", [4096, 131072, 524288], needle)
