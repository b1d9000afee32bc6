"""`KernelFormat`: the per-format facts every KVX kernel needs, in one place.

A cache tensor format (`kvx_core.formats.TensorFormat`) declares its own `KernelFormat` (`TensorFormat.kernel_facts`;
the dataclass and the code enums live in `kvx_core/formats/kernel_facts.py` so the formats need not import the
kernels): its Triton format code (`FormatCode`, the `tl.constexpr` F_* values of `ops/triton/dequant.py` are built
from it), its CUDA decode code (`CudaCode`, the `enum` of `ops/cuda/paged_decode_mma.cu`), its CUDA write encoder
(`EncoderCode`, the `enum` of `ops/cuda/paged_write.cu`), its storage, its scales, whether it packs two elements per
byte, whether an FP8 payload is E5M2, and the dtype of its tensor-core dots; `MIXED` lists the K / V pairs of
different formats the CUDA kernels are instantiated for. Every launcher (Triton write / gather / decode / prefill,
the CUDA decode and write) and `ops.dispatch` reads these facts here and nowhere else. No triton import: the
dispatch asks `kernel_format` whether a cache has a kernel before it imports a kernel module.

Adding a format whose payload the kernels already decode touches these files besides its tests (2 under an
existing `QuantFormat`; a new `QuantFormat` adds the ABI pair of item 3):
  1. `kvx_core/formats/<format>.py`: its `TensorFormat` (encode / decode) with its `kernel_facts` (none for a new
     K / V pairing of existing tensor formats);
  2. `kvx_core/formats/registry.py`: its cache format name(s), and `ENGINE_SERVED` if the engine plugins offer it
     (kvx_vllm's cache dtypes and codec's descriptor names derive from the registry);
  3. `kvx_core/enums.py` and `kvx_core/abi/kvx_abi.h` only when the descriptor records it as a new `QuantFormat` (an
     ABI value). A format the kernels do not decode yet also needs the kernel sources and a code in the enums above.
"""
from __future__ import annotations

from ..errors import KvxError, Status
from ..formats import TensorFormat
from ..formats.kernel_facts import MIXED, ROTATING_ENCODERS, CudaCode, EncoderCode, FormatCode, KernelFormat

__all__ = ["MIXED", "ROTATING_ENCODERS", "CudaCode", "EncoderCode", "FormatCode", "KernelFormat", "kernel_format"]


def kernel_format(tf: TensorFormat) -> KernelFormat:
    """The kernel facts of a TensorFormat (KvxError UNSUPPORTED for formats without a kernel)."""
    facts = tf.kernel_facts() if isinstance(tf, TensorFormat) else None
    if facts is None:
        raise KvxError(Status.UNSUPPORTED, f"no Triton kernel for cache tensor format {tf!r}")
    return facts
