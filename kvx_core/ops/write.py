"""Fused quantize-and-write on the GPU kernels: the one place that chooses the backend, the CUDA write
(`ops/cuda/write.py`) or the Triton write (`ops/triton/write.py`). Both store the bytes of the formats' encode;
the CUDA kernel runs at 2-3x the Triton kernel's bandwidth (benchmarks/results/write_bandwidth_h100.jsonl).

`ops.dispatch.write_kv` calls `launch_write` for kernel-addressable caches; `write_pools` here takes raw pools
(the storage contract of `ops/triton`). `backend`: "auto" (CUDA where it serves the call, else Triton),
"cuda" (refuses what it cannot serve) or "triton"; unset, `$KVX_WRITE_BACKEND` (read once) decides, else "auto".
"""
from __future__ import annotations

import torch

from .. import config
from ..errors import KvxError, Status
from ..formats import CacheFormat
from .checks import WriteArgs, check_write_args
from .cuda import Choice, choose, write as cuda_write
from .kernel_format import kernel_format
from .triton import write as triton_write
from .triton.launch import (
    as_format,
    check_device,
    check_pool,
    interpreting,
    pool_geometry,
    scale_args,
)

BACKENDS = ("auto", "cuda", "triton")


def choose_backend(backend: str | None, key: torch.Tensor, value: torch.Tensor, fmt: CacheFormat,
                   k_data: torch.Tensor, v_data: torch.Tensor) -> Choice:
    """The kernel for this write ("cuda" or "triton") and why not CUDA (KvxError UNSUPPORTED when "cuda" is asked
    for and cannot serve it)."""
    backend = backend or config.once("write_backend")
    if backend not in BACKENDS:
        raise KvxError(Status.INVALID_ARGUMENT, f"write backend must be auto, cuda or triton, got {backend!r}")
    if backend == "triton":
        return Choice("triton", None)
    if backend == "auto" and (interpreting() or key.device.type != "cuda"):
        return Choice("triton", "interpreting (TRITON_INTERPRET=1)" if interpreting() else "not a CUDA device")
    why = cuda_write.reason(key, value, fmt, k_data, v_data)
    return choose(why, backend, lambda: cuda_write.kernel_library(key.device), "write")


def launch_write(key: torch.Tensor, value: torch.Tensor, args: WriteArgs, k_data: torch.Tensor,
                 k_scales: torch.Tensor | None, v_data: torch.Tensor, v_scales: torch.Tensor | None,
                 fmt: CacheFormat, *, backend: str | None = None) -> None:
    """The fused write of arguments `check_write_args` accepted, on the chosen backend; the pools are checked
    before either kernel launches, so a rejected call stores nothing."""
    launch_chosen(choose_backend(backend, key, value, fmt, k_data, v_data).backend, key, value, args, k_data,
                  k_scales, v_data, v_scales, fmt)


def launch_chosen(backend: str, key: torch.Tensor, value: torch.Tensor, args: WriteArgs, k_data: torch.Tensor,
                  k_scales: torch.Tensor | None, v_data: torch.Tensor, v_scales: torch.Tensor | None,
                  fmt: CacheFormat) -> None:
    """The fused write on `backend` ("cuda" or "triton", as `choose_backend` chose it for these tensors)."""
    if backend == "triton":
        triton_write.launch_write(key, value, args, k_data, k_scales, v_data, v_scales, fmt)
        return
    check_device(key, value, args.slots, k_data, v_data)
    d = int(key.shape[2])
    for name, tf, data, scales in (("K", fmt.k, k_data, k_scales), ("V", fmt.v, v_data, v_scales)):
        kf = kernel_format(tf)
        check_pool(name, data, kf, d)
        scale_args(name, scales, data, kf, tf, d)
    if key.shape[0] == 0:
        return
    cuda_write.launch(key, value, args, k_data, k_scales, v_data, v_scales, fmt)


def bind_write(key: torch.Tensor, value: torch.Tensor, fmt: CacheFormat, k_data, k_scales, v_data, v_scales, k_gs,
               v_gs) -> tuple[Choice, object]:
    """The kernel for writes of `key` / `value`'s dtypes into a bound layer's checked pools, chosen once: (Choice, the
    CUDA write's `LayerWrite` when CUDA serves them, else None)."""
    choice = choose_backend(None, key, value, fmt, k_data, v_data)
    if choice.backend != "cuda":
        return choice, None
    return choice, cuda_write.layer_write(fmt, k_data, k_scales, v_data, v_scales, k_gs, v_gs)


def launch_bound(launch: tuple[Choice, object], key: torch.Tensor, value: torch.Tensor, args: WriteArgs, k_data,
                 k_scales, v_data, v_scales, fmt: CacheFormat) -> None:
    """The write into a bound layer as `bind_write` chose it: the CUDA write kernel alone at `args.slots` (it rotates
    the `_rot` formats' rows itself), or the Triton launcher (`args`, the pools)."""
    choice, layer = launch
    if layer is None:
        launch_chosen(choice.backend, key, value, args, k_data, k_scales, v_data, v_scales, fmt)
    elif key.shape[0]:
        cuda_write.launch_layer(layer, key, value, args.slots)


@torch.no_grad()
def write_pools(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             k_data: torch.Tensor, k_scales: torch.Tensor | None, v_data: torch.Tensor, v_scales: torch.Tensor | None,
             fmt: CacheFormat | str, k_gs=None, v_gs=None, *, check: bool = True, backend: str | None = None) -> None:
    """`ops.triton.write_pools` on the chosen backend: quantize `key`/`value [T, H_kv, D]` in `fmt` and scatter
    them into the HND pools at `slot_mapping [T]` (negative = skip), K and V in one launch."""
    fmt = as_format(fmt)
    nb, hkv, bs = pool_geometry(k_data, v_data)
    args = check_write_args(fmt, key, value, slot_mapping, num_slots=nb * bs, num_kv_heads=hkv, k_gs=k_gs, v_gs=v_gs,
                            check=check)
    launch_write(key, value, args, k_data, k_scales, v_data, v_scales, fmt, backend=backend)
