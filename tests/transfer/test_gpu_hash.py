"""The GPU segment hash (`kvx_core.transfer.gpu_hash`) against the `xxhash` package: under Triton's interpreter on
CPU (a subprocess, TRITON_INTERPRET=1 must be set before Triton loads) and compiled on the GPU machine."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import xxhash

from ..procs import run

CASES = [(32, 3, 0), (64, 5, 12345), (1024, 4, 2**64 - 7), (128, 2, 2**63 + 5), (65536, 3, 99)]


def _check(device: str) -> None:
    from kvx_core.transfer.gpu_hash import segment_digests

    g = torch.Generator().manual_seed(0)
    for seg, n, seed in CASES:
        buf = torch.randint(0, 256, (seg * n + 24,), dtype=torch.uint8, generator=g)  # a tail the caller hashes
        got = segment_digests(buf.to(device), seg, seed).cpu().numpy().view(np.uint64).tolist()
        want = [xxhash.xxh64(bytes(buf[i * seg:(i + 1) * seg].numpy()), seed=seed).intdigest() for i in range(n)]
        assert got == want, (seg, n, seed)
    assert segment_digests(torch.zeros(16, dtype=torch.uint8, device=device), 32, 1).numel() == 0


def test_interpreted_kernel_equals_xxhash():
    code = "import sys; sys.path.insert(0, sys.argv[1]); from tests.transfer.test_gpu_hash import _check; _check('cpu')"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = run([sys.executable, "-c", code, root], env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr[-3000:]


def test_bad_buffers_are_refused():
    from kvx_core.errors import KvxError
    from kvx_core.transfer.gpu_hash import segment_digests

    for buf, seg in ((torch.zeros(64, dtype=torch.int8), 32), (torch.zeros(2, 64, dtype=torch.uint8), 32),
                     (torch.zeros(65, dtype=torch.uint8)[1:], 32), (torch.zeros(64, dtype=torch.uint8), 48)):
        with pytest.raises(KvxError):
            segment_digests(buf, seg, 0)


@pytest.mark.gpu
def test_compiled_kernel_equals_xxhash():
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")
    _check("cuda")
