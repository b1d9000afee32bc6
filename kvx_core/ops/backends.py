"""Which kernel serves decode, prefill and write for each format on a device, and why not the fastest one.

Asked by `kvx doctor` and logged once at startup by the engine plugins, so that the kernel a user gets is never
silent: the CUDA kernels are the fastest (decode, write), Triton serves what they do not (prefill, formats or
geometries outside the CUDA kernels, a machine where no CUDA library can be had), and the torch reference serves
everything off CUDA. The answers come from the same choice functions the ops call (`decode.choose_backend`,
`write.choose_backend`), for one representative geometry.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvxError
from ..formats import CacheFormat, get_format
from .kernel_format import kernel_format


@dataclass(frozen=True)
class Serving:
    """The kernel of one op (`cuda`, `triton` or `torch` for the reference) and why not a faster one (None: the
    fastest KVX has for it)."""

    op: str
    kernel: str
    reason: str | None = None

    def __str__(self) -> str:
        return f"{self.op} {self.kernel}" + (f" ({self.reason})" if self.reason else "")


@dataclass(frozen=True)
class Geometry:
    """The geometry the choice is asked for (the plugins pass their model's; `kvx doctor` a Llama-like default)."""

    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    q_dtype: torch.dtype = torch.bfloat16
    batch: int = 64


def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'kvx[gpu]')"
    return None


def serving(fmt: CacheFormat | str, device: torch.device | str, geometry: Geometry = Geometry()) -> list[Serving]:
    """Decode, prefill and write: the kernel that serves each for caches of `fmt` on `device`."""
    from . import decode as decode_ops, write as write_ops

    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    device = torch.device(device)
    g = geometry
    why = "no CUDA device" if device.type != "cuda" else _triton_missing()
    if why is None:
        try:
            kernel_format(fmt.k), kernel_format(fmt.v)
        except KvxError as e:
            why = f"no kernel for {fmt.name}: {e.message}"
    if why is not None:
        return [Serving(op, "torch", why) for op in ("decode", "prefill", "write")]
    d = decode_ops.choose_backend(None, fmt, g.q_dtype, device, g.batch, g.num_qo_heads, g.num_kv_heads, g.head_dim,
                                  g.block_size, None)
    from ..cache import PagedKVCache

    pools = PagedKVCache(fmt, num_layers=1, num_blocks=1, block_size=g.block_size, num_kv_heads=g.num_kv_heads,
                         head_dim=g.head_dim, device=device).layers[0]
    x = torch.zeros(1, g.num_kv_heads, g.head_dim, dtype=g.q_dtype, device=device)
    w = write_ops.choose_backend(None, x, x, fmt, pools.k_data, pools.v_data)
    prefill_why = None if g.q_dtype in (torch.bfloat16, torch.float16) else f"{g.q_dtype} queries"
    return [Serving("decode", d.backend, d.reason),
            Serving("prefill", "triton" if prefill_why is None else "torch", prefill_why),
            Serving("write", w.backend, w.reason)]


def summary(fmt: CacheFormat | str, device: torch.device | str, geometry: Geometry = Geometry()) -> str:
    """One line for a log: `decode cuda, prefill triton, write cuda (reason)` plus where the CUDA library came
    from when a CUDA kernel serves."""
    rows = serving(fmt, device, geometry)
    line = ", ".join(map(str, rows))
    if any(r.kernel == "cuda" for r in rows):
        from .cuda import library_source

        line += f"; CUDA kernels {library_source(torch.device(device)).detail}"
    return line
