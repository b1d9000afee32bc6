"""The CUDA decode's own source run on the CPU (backend "cuda_host" of tests/kernels/test_cuda_decode.py).

`host_decode.cpp` compiles `kvx_core/ops/cuda/paged_decode_mma.cu` (the installed copy) for the host; the call goes
through the CUDA launcher's own parameter code (`ops.cuda.decode.launch`: `layer_args`, `step_params`,
`launch_args` and the ctypes mirror, checked by name and offset), with only the library and its stream swapped for
the host build, and with the split count, workspace and scratch a plan would give. So CI checks the decode, split
merge and rotation kernels' logic against the float64 oracle; the GPU tests run them on the hardware.
"""
from __future__ import annotations

import math
from unittest import mock

import torch

import kvx_core.ops.cuda as kvx_cuda
from kvx_core.formats import get_format
from kvx_core.ops.cuda import decode as cuda_decode

from .host_build import host_library


def decode(q, kd, ks, vd, vs, kg, vg, block_table, seq_lens, fmt, num_splits: int = 1, softcap=None, window=None,
           sinks=None, rows_per_seq: int = 1):
    """(out [B, Hq, D] q.dtype, lse [B, Hq] fp32) of the CUDA decode's host build over CPU pools the CUDA decode
    serves (asserted: `geometry_reason` / `pool_reason`); rotated formats take unrotated q and return unrotated out."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    bsz, hq, d = q.shape
    _, hkv, bs, _ = kd.shape
    why = cuda_decode.geometry_reason(fmt, q.dtype, bsz, hq, hkv, d, bs) or \
        cuda_decode.pool_reason(q, fmt, kd, ks, vd, vs)
    assert why is None, why
    mid_o = torch.full((bsz, hq, num_splits, d), float("nan"))
    mid_l = torch.full((bsz, hq, num_splits), float("nan"))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((bsz, hq), float("nan"))
    q_rot = torch.empty_like(q) if fmt.rotate else None
    lib = host_library("host_decode.cpp", "paged_decode_mma.cu")
    # the library and the stream swapped (`kernel_library` still sets the entry's signature and checks the ctypes
    # mirror by name and offset against the host build's struct)
    with mock.patch.object(kvx_cuda, "library", lambda device: lib), \
            mock.patch.object(cuda_decode, "launch_on_stream", lambda entry, index, *a: entry(*a, None)):
        cuda_decode.launch(q, kd, ks, vd, vs, kg, vg, block_table, seq_lens, fmt, mid_o, mid_l, 1 / math.sqrt(d),
                           softcap, window, out=out, lse=lse, sinks=sinks, rotate_out=fmt.rotate,
                           rows_per_seq=rows_per_seq, q_rot=q_rot)
    return out, lse
