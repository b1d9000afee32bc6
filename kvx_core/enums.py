"""KVX enums (spec §4-§6, v1.1 extension). Values are ABI: they match kvx_abi.h exactly."""
from __future__ import annotations

import enum
from typing import TypeVar

import torch

from .errors import KvxError, Status, int_value


class DType(enum.IntEnum):
    """`kvx_dtype_t`. 0 is reserved so a zero-initialised descriptor is rejected."""

    UNSPECIFIED = 0
    F16 = 1
    BF16 = 2
    F32 = 3
    F8_E4M3 = 4
    F8_E5M2 = 5
    S32 = 6
    S64 = 7
    # v1.1: packed / quantized storage types
    U8 = 8
    FP4_E2M1X2 = 9  # two E2M1 codes per byte, element 2i in bits 3..0
    UE8M0 = 10  # MX scale byte, exponent bias 127
    INT4X2 = 11  # two unsigned 4-bit codes per byte, element 2i in bits 3..0


class Layout(enum.IntEnum):
    """`kvx_layout_t` (spec §4.2)."""

    UNSPECIFIED = 0
    NHD = 1  # [num_blocks, block_size, num_kv_heads, head_dim]
    HND = 2  # [num_blocks, num_kv_heads, block_size, head_dim]
    HND_PACKED = 3  # [num_blocks, num_kv_heads, head_dim / pack, block_size, pack]
    CUSTOM = 4  # explicit shape/stride, logical order [blocks, block_size, heads, head_dim]


class Memory(enum.IntEnum):
    """`kvx_memory_type_t`."""

    HOST = 0
    DEVICE = 1
    UNIFIED = 2
    HOST_PINNED = 3


class BlockTableFormat(enum.IntEnum):
    """`kvx_block_table_format_t` (spec §5.1)."""

    PACKED = 0
    RAGGED = 1
    KV_OFFSETS = 2


class ScaleGranularity(enum.IntEnum):
    """`kvx_scale_granularity_t`."""

    NONE = 0
    PER_TENSOR = 1
    PER_HEAD = 2
    PER_BLOCK = 3
    PER_TOKEN_HEAD = 4
    PER_GROUP = 5  # v1.1: one scale per `group_size` elements along head_dim


class QuantFormat(enum.IntEnum):
    """`kvx_quant_format_t` (v1.1): the cache format recorded in the quantization descriptor."""

    NONE = 0
    FP8_E4M3 = 1
    FP8_E5M2 = 2
    INT8 = 3
    INT4 = 4
    MXFP4 = 5
    NVFP4 = 6
    K8V4 = 7  # keys FP8 E4M3, values NVFP4


BLOCK_TABLE_FLAG_KVCACHEINDEX = 1 << 0
"""`KVX_BLOCK_TABLE_FLAG_KVCACHEINDEX`: KV_OFFSETS indices are TRT-LLM KVCacheIndex values."""

QUANT_FLAG_HADAMARD = 1 << 0
"""`KVX_QUANT_FLAG_HADAMARD`: K, Q and V are rotated by an orthonormal Hadamard matrix along head_dim."""
QUANT_FLAG_MX_SCALE_FLOOR = 1 << 1
"""`KVX_QUANT_FLAG_MX_SCALE_FLOOR`: MXFP4 scales use the OCP FLOOR rule instead of RCEIL."""
QUANT_FLAG_V_SCALE_INTERLEAVE4 = 1 << 2
"""`KVX_QUANT_FLAG_V_SCALE_INTERLEAVE4`: V scale bytes are interleaved by 4 tokens (TRT-LLM's NVFP4 KV for its
trtllm-gen kernels): in each (block, head) plane, the byte of (token t, group j) is at `(t // 4) * 4 * S + j * 4 +
t % 4` instead of `t * S + j` (`kvx_core/scale_layout.py`)."""
QUANT_FLAG_KEY_SMOOTHING = 1 << 3
"""`KVX_QUANT_FLAG_KEY_SMOOTHING` (v1.2): keys are stored divided by `kvx_quant_desc_t.k_smoothing`."""
QUANT_FLAG_KEY_CENTERING = 1 << 4
"""`KVX_QUANT_FLAG_KEY_CENTERING` (v1.3): keys are stored as `(K - c) / s`, c = `kvx_quant_desc_t.k_center`."""

KVCACHEINDEX_SECONDARY_BIT = 1 << 31
KVCACHEINDEX_NULL = -1  # all bits set in int32

_TORCH_OF: dict[DType, torch.dtype] = {
    DType.F16: torch.float16,
    DType.BF16: torch.bfloat16,
    DType.F32: torch.float32,
    DType.F8_E4M3: torch.float8_e4m3fn,
    DType.F8_E5M2: torch.float8_e5m2,
    DType.S32: torch.int32,
    DType.S64: torch.int64,
    DType.U8: torch.uint8,
    DType.FP4_E2M1X2: torch.uint8,
    DType.UE8M0: torch.uint8,
    DType.INT4X2: torch.uint8,
}
_KVX_OF: dict[torch.dtype, DType] = {
    torch.float16: DType.F16,
    torch.bfloat16: DType.BF16,
    torch.float32: DType.F32,
    torch.float8_e4m3fn: DType.F8_E4M3,
    torch.float8_e5m2: DType.F8_E5M2,
    torch.int32: DType.S32,
    torch.int64: DType.S64,
    torch.uint8: DType.U8,
}

#: Bits per stored element of each dtype.
DTYPE_BITS: dict[DType, int] = {
    DType.F16: 16, DType.BF16: 16, DType.F32: 32, DType.F8_E4M3: 8, DType.F8_E5M2: 8,
    DType.S32: 32, DType.S64: 64, DType.U8: 8, DType.FP4_E2M1X2: 8, DType.UE8M0: 8,
    DType.INT4X2: 8,
}


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch storage dtype of a KVX dtype (or of the int naming one, as the C ABI passes it)."""
    member = as_enum(DType, dtype)
    if not isinstance(member, DType) or member not in _TORCH_OF:
        raise KvxError(Status.INVALID_ARGUMENT, f"dtype {dtype!r} has no torch storage type")
    return _TORCH_OF[member]


def kvx_dtype(dtype: torch.dtype) -> DType:
    """The KVX dtype of a torch dtype (uint8 maps to U8; packed types are declared explicitly)."""
    if not isinstance(dtype, torch.dtype):
        raise KvxError(Status.INVALID_ARGUMENT, f"expected a torch.dtype, got {dtype!r}")
    if dtype not in _KVX_OF:
        raise KvxError(Status.UNSUPPORTED, f"torch dtype {dtype} has no KVX v1 dtype")
    return _KVX_OF[dtype]


E = TypeVar("E", bound=enum.IntEnum)


def as_enum(cls: type[E], value: object) -> E | object:
    """`value` as a member of `cls` when it is one or a plain int naming one (a C caller passes enums
    as ints); anything else unchanged, for validation to refuse with a message."""
    if isinstance(value, cls):
        return value
    n = int_value(value)
    return cls(n) if n is not None and n in cls._value2member_map_ else value


def require_enum(cls: type[E], value: object, what: str) -> E:
    """`value` as a member of `cls`, or KvxError(INVALID_ARGUMENT) naming the valid values."""
    member = value if isinstance(value, cls) else as_enum(cls, value)
    if not isinstance(member, cls):
        valid = ", ".join(f"{m.name}={m.value}" for m in cls)
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} = {value!r} is not a {cls.__name__} ({valid})")
    return member
