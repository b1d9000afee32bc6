"""Bridge between cache descriptors and cache formats: which format a `CacheDesc` holds, and the
v1.1 quantization descriptor that records a format (plus its scale pools and global scales)."""
from __future__ import annotations

import torch

from .descriptors import CacheDesc, QuantDesc, TensorDesc
from .enums import (
    QUANT_FLAG_HADAMARD,
    QUANT_FLAG_MX_SCALE_FLOOR,
    QUANT_FLAG_V_SCALE_INTERLEAVE4,
    DType,
    Layout,
    QuantFormat,
    torch_dtype,
)
from .errors import KvxError, Status, require
from .formats import CacheFormat, get_format, list_formats
from .layouts import Geometry, check_shape
from .scale_layout import check_interleave4

_PLAIN_NAME = {DType.F16: "fp16", DType.BF16: "bf16", DType.F32: "fp32", DType.F8_E4M3: "fp8_e4m3",
               DType.F8_E5M2: "fp8_e5m2"}


def _quant_names() -> dict[QuantFormat, str]:
    """Registry name of each recorded `QuantFormat` but MXFP4 (named by group size and scale rule in
    `format_name`): the first unrotated registry format recording it, so a new format needs no entry here."""
    names: dict[QuantFormat, str] = {}
    for name in list_formats():
        fmt = get_format(name)
        if not fmt.rotate and fmt.quant not in (QuantFormat.NONE, QuantFormat.MXFP4):
            names.setdefault(fmt.quant, name)
    return names


_QUANT_NAME = _quant_names()

_KNOWN_FLAGS = QUANT_FLAG_HADAMARD | QUANT_FLAG_MX_SCALE_FLOOR | QUANT_FLAG_V_SCALE_INTERLEAVE4


def format_name(quant: QuantDesc) -> str:
    """Registry name of the format a quantization descriptor records."""
    require(not quant.flags & ~_KNOWN_FLAGS, Status.UNSUPPORTED,
            f"quantization flags {quant.flags:#x} carry bits this KVX version does not know")
    require(quant.format == QuantFormat.MXFP4 or not quant.flags & QUANT_FLAG_MX_SCALE_FLOOR, Status.INVALID_ARGUMENT,
            "KVX_QUANT_FLAG_MX_SCALE_FLOOR is defined for MXFP4 only")
    require(quant.format == QuantFormat.NVFP4 or not quant.flags & QUANT_FLAG_V_SCALE_INTERLEAVE4,
            Status.INVALID_ARGUMENT, "KVX_QUANT_FLAG_V_SCALE_INTERLEAVE4 is defined for NVFP4 only")
    if quant.format == QuantFormat.MXFP4:
        require(quant.group_size in (16, 32), Status.UNSUPPORTED,
                f"MXFP4 group size {quant.group_size} (KVX defines 16 and 32)")
        name = "mxfp4" if quant.group_size == 16 else "mxfp4_32"
        name += "_floor" if quant.flags & QUANT_FLAG_MX_SCALE_FLOOR else ""
    elif quant.format in _QUANT_NAME:
        name = _QUANT_NAME[quant.format]
    else:
        raise KvxError(Status.UNSUPPORTED, f"quantization format {quant.format!r} is not supported")
    return name + ("_rot" if quant.flags & QUANT_FLAG_HADAMARD else "")


def format_of(cache: CacheDesc) -> CacheFormat:
    """The cache format of `cache`: from its quantization descriptor, else from its element dtype."""
    if cache.quant is None:
        require(cache.k.dtype in _PLAIN_NAME, Status.UNSUPPORTED,
                f"cache dtype {cache.k.dtype.name} needs a quantization descriptor")
        return get_format(_PLAIN_NAME[cache.k.dtype])
    fmt = get_format(format_name(cache.quant))
    fmt.check_head_dim(cache.head_dim)
    q = cache.quant
    require((q.k_data_dtype, q.v_data_dtype) == (fmt.k.data_dtype, fmt.v.data_dtype), Status.INVALID_ARGUMENT,
            f"{fmt.name} stores ({fmt.k.data_dtype.name}, {fmt.v.data_dtype.name}) payloads, the descriptor says "
            f"({q.k_data_dtype.name}, {q.v_data_dtype.name})")
    require(q.group_size == group_size_of(fmt, cache.head_dim), Status.INVALID_ARGUMENT,
            f"{fmt.name} has group size {group_size_of(fmt, cache.head_dim)}, the descriptor says {q.group_size}")
    geom = cache.geometry
    for which, tf, scales in (("k", fmt.k, cache.quant.k_scales), ("v", fmt.v, cache.quant.v_scales)):
        dim = tf.scale_dim(cache.head_dim)
        require((scales is None) == (dim == 0), Status.INVALID_ARGUMENT,
                f"{fmt.name}: {which} scale pool must be {'absent' if dim == 0 else 'present'}")
        if scales is not None:
            check_shape(scales.layout, scales.shape,
                        Geometry(geom.num_blocks, geom.block_size, geom.num_kv_heads, dim), f"quant.{which}_scales")
    if q.flags & QUANT_FLAG_V_SCALE_INTERLEAVE4:
        check_interleave4(q.v_scales, geom.block_size)
    return fmt


def group_size_of(fmt: CacheFormat, head_dim: int) -> int:
    """The descriptor's group size: the FP4 group, else one scale per token-head row (head_dim)."""
    sizes = [t.group_size for t in (fmt.k, fmt.v) if t.group_size > 0]
    return min(sizes) if sizes else head_dim


def quant_desc(fmt: CacheFormat, head_dim: int, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None,
               k_global: torch.Tensor | None, v_global: torch.Tensor | None,
               scale_layout: Layout = Layout.HND, flags: int = 0) -> QuantDesc | None:
    """The v1.1 quantization descriptor of `fmt` (None for the plain BF16/FP16/FP32 formats). `flags`: scale-layout
    flags to add to the format's own (`QUANT_FLAG_V_SCALE_INTERLEAVE4` for TRT-LLM's NVFP4 V scales)."""
    if fmt.quant == QuantFormat.NONE:
        return None
    def desc(t: torch.Tensor | None, dtype: DType | None) -> TensorDesc | None:
        # scale pools are bytes; the descriptor names what the bytes are (E4M3, UE8M0, or raw U8)
        return None if t is None else TensorDesc.from_torch(t.view(torch_dtype(dtype)), scale_layout, dtype)

    return QuantDesc(fmt.quant, group_size_of(fmt, head_dim), fmt.k.data_dtype, fmt.v.data_dtype,
                     desc(k_scales, fmt.k.scale_dtype), desc(v_scales, fmt.v.scale_dtype), k_global, v_global,
                     fmt.flags | flags)
