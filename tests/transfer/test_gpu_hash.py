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
    from kvx_core.transfer.gpu_hash import chunk_digests, segment_digests

    g = torch.Generator().manual_seed(0)
    for seg, n, seed in CASES:
        buf = torch.randint(0, 256, (seg * n + 24,), dtype=torch.uint8, generator=g)  # a tail the caller hashes
        got = segment_digests(buf.to(device), seg, seed).cpu().numpy().view(np.uint64).tolist()
        want = [xxhash.xxh64(bytes(buf[i * seg:(i + 1) * seg].numpy()), seed=seed).intdigest() for i in range(n)]
        assert got == want, (seg, n, seed)
    assert segment_digests(torch.zeros(16, dtype=torch.uint8, device=device), 32, 1).numel() == 0
    for seg, n, count, gap, seed in ((32, 3, 4, 8, 7), (1024, 2, 3, 40, 2**64 - 3), (64, 1, 1, 0, 5)):
        size, stride = seg * n + 24, seg * n + 24 + gap  # each chunk's tail (24 bytes) is the caller's
        buf = torch.randint(0, 256, (count * stride,), dtype=torch.uint8, generator=g)
        got = chunk_digests(buf.to(device), count, stride, size, seg, seed).cpu().numpy().view(np.uint64).tolist()
        want = [[xxhash.xxh64(bytes(buf[r * stride + i * seg:][:seg].numpy()), seed=seed).intdigest()
                 for i in range(n)] for r in range(count)]
        assert got == want, (seg, n, count, seed)


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


def test_chunks_outside_the_buffer_are_refused():
    """Chunks that reach past the buffer, overlap, or sit at offsets not a multiple of 8 are refused before a
    launch."""
    from kvx_core.errors import KvxError, Status
    from kvx_core.transfer.gpu_hash import chunk_digests

    buf = torch.zeros(256, dtype=torch.uint8)
    for count, stride, size in ((3, 96, 96), (2, 64, 96), (2, 100, 64), (1, 0, 257), (-1, 64, 64), (2, 64, 1.5)):
        with pytest.raises(KvxError) as e:
            chunk_digests(buf, count, stride, size, 32, 0)
        assert e.value.status == Status.INVALID_ARGUMENT


@pytest.mark.gpu
def test_compiled_kernel_equals_xxhash():
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")
    _check("cuda")
