"""Launch helpers shared by the Triton launchers (write, gather, decode, prefill): argument checks that run
before any launch, and the kernel arguments built from pools and formats.

On CPU the kernels run under `TRITON_INTERPRET=1` (set before triton is imported); importing this module then
installs the interpreter shim (`_interp.py`).
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton.language as tl

from ...errors import KvxError, Status
from ...formats import CacheFormat, get_format
from ..kernel_format import KernelFormat, kernel_format


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if interpreting():
    from ._interp import install as _install_interp_shim
    _install_interp_shim()


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The launch context of a kernel over tensors on `device`: that CUDA device made current (Triton launches on the
    current device's current stream, and refuses or, with peer access, reads across devices out of stream order
    for tensors of another); nothing on the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def as_format(fmt: CacheFormat | str) -> CacheFormat:
    """A cache format or its registry name -> the CacheFormat (KvxError otherwise)."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    if not isinstance(fmt, CacheFormat):
        raise KvxError(Status.INVALID_ARGUMENT, f"fmt must be a cache format or its name, got {type(fmt).__name__}")
    return fmt


def pool_geometry(k_data, v_data) -> tuple[int, int, int]:
    """(num_blocks, H_kv, block_size) shared by the K and V pools (4-D tensors)."""
    for name, t in (("K", k_data), ("V", v_data)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise KvxError(Status.INVALID_ARGUMENT, f"{name} pool must be a [num_blocks, H_kv, block_size, Dk] tensor, "
                           f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if tuple(v_data.shape[:3]) != tuple(k_data.shape[:3]):
        raise KvxError(Status.INVALID_ARGUMENT, "K and V pools must share [num_blocks, H_kv, block_size]")
    return tuple(int(n) for n in k_data.shape[:3])


def check_device(*tensors: torch.Tensor) -> None:
    """Arguments are torch tensors (None for absent ones) on one device the kernels can run on."""
    for t in tensors:
        if t is not None and not isinstance(t, torch.Tensor):
            raise KvxError(Status.INVALID_ARGUMENT, f"the kernels take torch tensors, got a {type(t).__name__}")
    dev = tensors[0].device
    if dev.type != "cuda" and not interpreting():
        raise KvxError(Status.UNSUPPORTED, "Triton KVX kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    for t in tensors:
        if t is not None and t.device != dev:
            raise KvxError(Status.INVALID_ARGUMENT, f"all tensors must be on {dev}, got one on {t.device}")


def check_out_tensor(name: str, t, shape, dtype, device) -> torch.Tensor:
    """A caller-provided output: a float tensor of `shape` (and `dtype` when given) on `device`, last dim contiguous."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.device != device \
            or (dtype is not None and t.dtype != dtype) or not t.is_floating_point() or t.stride(-1) != 1:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"{name} must be a {dtype or 'float'} {tuple(shape)} tensor on {device} with a contiguous "
                       f"last dim, got {got}")
    return t


def check_plan(what: str, fmt: CacheFormat | str, q_dtype: torch.dtype, q_dtypes: tuple, num_qo_heads: int,
               num_kv_heads: int, head_dim: int):
    """The geometry a decode / prefill plan is made for -> (format, K kernel format, V kernel format)."""
    fmt = as_format(fmt)
    if q_dtype not in q_dtypes:
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} queries must be one of {[str(t) for t in q_dtypes]}, "
                       f"got {q_dtype}")
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    fmt.check_head_dim(head_dim)
    if head_dim & (head_dim - 1) or head_dim < 32:
        raise KvxError(Status.UNSUPPORTED, f"{what} supports power-of-two head_dim >= 32, got {head_dim}")
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise KvxError(Status.INVALID_ARGUMENT, f"Hq={num_qo_heads} must be a multiple of H_kv={num_kv_heads}")
    return fmt, kk, kv


def check_layer(plan, q, rows: int, batch: int, k_data, k_scales, v_data, v_scales, block_table, seq_lens, out,
                lse, num_lens: int | None = None):
    """One layer's tensors against its step's plan (a decode or prefill plan: `fmt`, `num_qo_heads`,
    `num_kv_heads`, `head_dim`, `block_size`, `q_dtype`), host only -> (K scale args, V scale args, out, lse),
    allocating `out` / `lse` when not given. `rows`: query rows, `batch`: block-table rows, `num_lens`: entries of
    `seq_lens` (default `batch`; a multi-row decode has one per query row)."""
    num_lens = batch if num_lens is None else num_lens
    fmt, hq, hkv, d, bs = plan.fmt, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.block_size
    check_device(q, k_data, v_data, block_table, seq_lens)
    if tuple(q.shape) != (rows, hq, d) or q.dtype != plan.q_dtype or q.stride(2) != 1:
        raise KvxError(Status.INVALID_ARGUMENT, f"q must be {plan.q_dtype} {(rows, hq, d)} with a contiguous last dim "
                       f"as planned, got {q.dtype} {tuple(q.shape)}")
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    check_pool("K", k_data, kk, d)
    check_pool("V", v_data, kv, d)
    if tuple(k_data.shape[1:3]) != (hkv, bs) or tuple(v_data.shape[:3]) != tuple(k_data.shape[:3]):
        raise KvxError(Status.INVALID_ARGUMENT, f"K and V pools must be [num_blocks, {hkv}, {bs}, *] as planned, got "
                       f"{tuple(k_data.shape)} / {tuple(v_data.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch \
            or block_table.stride(1) != 1 or seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_lens,):
        raise KvxError(Status.INVALID_ARGUMENT, f"need an int32 block_table [{batch}, max_blocks] with a contiguous "
                       f"last dim and int32 seq_lens [{num_lens}]")
    ks = scale_args("K", k_scales, k_data, kk, fmt.k, d)
    vs = scale_args("V", v_scales, v_data, kv, fmt.v, d)
    out = torch.empty_like(q) if out is None else check_out_tensor("out", out, q.shape, None, q.device)
    lse = torch.empty(rows, hq, dtype=torch.float32, device=q.device) if lse is None \
        else check_out_tensor("lse", lse, (rows, hq), torch.float32, q.device)
    return ks, vs, out, lse


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: the interpreter's stand-in)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def check_pool(name: str, data: torch.Tensor, kf: KernelFormat, head_dim: int) -> None:
    """`data` is a `[num_blocks, H_kv, block_size, Dk]` pool of `kf`'s storage dtype with a contiguous last dim."""
    if data.dim() != 4:
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"{name} pool must be [num_blocks, H_kv, block_size, Dk], got {tuple(data.shape)}")
    if data.dtype != kf.storage:
        raise KvxError(Status.INVALID_ARGUMENT, f"{name} pool dtype must be {kf.storage}, got {data.dtype}")
    dk = head_dim // 2 if kf.packed else head_dim
    if data.shape[3] != dk or data.stride(3) != 1:
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"{name} pool last dim must be {dk} and contiguous, got {data.shape[3]} "
                       f"(stride {data.stride(3)})")


def scale_args(name, scales, data, kf: KernelFormat, tf, head_dim):
    """(scale pool, its block / head / token strides) as the kernels take them; the data pool and zeros for a
    format without a scale pool (the kernel never reads it)."""
    if not kf.has_scales:
        return (data, 0, 0, 0)
    want = tf.scale_dim(head_dim)
    if scales is None or scales.dim() != 4 or scales.dtype != torch.uint8 or scales.shape[3] != want \
            or tuple(scales.shape[:3]) != tuple(data.shape[:3]) or scales.stride(3) != 1:
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"{name} scale pool must be uint8 {tuple(data.shape[:3]) + (want,)} with a contiguous last dim, "
                       f"got {None if scales is None else (scales.dtype, tuple(scales.shape))}")
    return (scales, scales.stride(0), scales.stride(1), scales.stride(2))


_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}


def _placeholder(device) -> torch.Tensor:
    """One FP32 element per device, made once: the global-scale argument of formats without one (the kernels never
    read it), so no step allocates or fills it."""
    device = torch.device(device)
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.ones(1, dtype=torch.float32, device=device)
    return _PLACEHOLDERS[device]


def global_scale_arg(gs, kf: KernelFormat, hkv: int, device) -> torch.Tensor:
    """The FP32 `[H_kv]` global-scale argument (ones when absent; one placeholder element for a format
    without a global scale). A contiguous FP32 `[H_kv]` on the device (what a bound layer holds) is taken as is."""
    if not kf.global_scale:
        return _placeholder(device)
    if gs is None:
        return torch.ones(hkv, dtype=torch.float32, device=device)
    if not isinstance(gs, torch.Tensor):
        return torch.full((hkv,), float(gs), dtype=torch.float32, device=device)
    g = gs.to(device=device, dtype=torch.float32).reshape(-1)
    if g.numel() == 1:
        g = g.expand(hkv)
    if g.numel() != hkv:
        raise KvxError(Status.INVALID_ARGUMENT, f"global scale must be [] or [H_kv={hkv}], got {tuple(gs.shape)}")
    return g.contiguous()


def fp8_type(kf: KernelFormat):
    """Bitcast target of an FP8 payload (the kernels load FP8 pools as bytes; unused for other formats)."""
    return tl.float8e5 if kf.e5m2 else tl.float8e4nv


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dot_type(kf: KernelFormat, q_dtype: torch.dtype):
    """The triton dtype of `kf`'s tensor-core dot operands (`KernelFormat.dot_dtype`)."""
    return _TL[kf.dot_dtype(q_dtype)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 pools are passed as uint8 views (same strides)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())
