"""LMDeploy/TurboMind adapter: `quant_policy` bitmask -> KV cache mode -> KVX cache format (docs/quantization.md §14.2).

quant_policy is a bitmask: 0x04 int4 KV, 0x08 int8 KV, 0x10 FP4 KV family; 0x01 and 0x02 are
reserved and every other bit is undefined (both -> KvxError INVALID_ARGUMENT). Priority, as in the
seed's GetKvCacheMode: FP4 > int8 > int4 > none (so 12 = int8, 20 = FP4). The FP4 bit selects
NVFP4 on Blackwell (SM >= 100) and MXFP4 on SM89/SM90 (Ada/Hopper); below SM89 FP4 KV is refused
(KvxError UNSUPPORTED), the seed's preferred hard failure rather than a silent fallback.
`sm` is the compute capability as major*10 + minor (80, 89, 90, 100, 120, ...).
"""
from __future__ import annotations

import enum

import torch

from kvx_core.errors import KvxError, Status
from kvx_core.formats.base import is_int


class QuantPolicy(enum.IntFlag):
    """TurboMind `QuantPolicy` bits."""

    NONE = 0x00
    RESERVE1 = 0x01
    RESERVE2 = 0x02
    CACHE_KV_INT4 = 0x04
    CACHE_KV_INT8 = 0x08
    CACHE_KV_FP4 = 0x10


VALID_POLICY_BITS = QuantPolicy.CACHE_KV_INT4 | QuantPolicy.CACHE_KV_INT8 | QuantPolicy.CACHE_KV_FP4
MIN_SM_MXFP4 = 89
MIN_SM_NVFP4 = 100


class KvCacheMode(enum.IntEnum):
    """TurboMind `KvCacheMode` (seed order), with the KVX cache format each one maps to."""

    NONE = 0
    INT4 = 1
    INT8 = 2
    MXFP4 = 3
    NVFP4 = 4

    @property
    def format_name(self) -> str | None:
        """KVX cache format name (None for NONE: the cache keeps the model dtype, see `kv_cache_format_name`)."""
        return {1: "int4", 2: "int8", 3: "mxfp4", 4: "nvfp4"}.get(int(self))


def select_kv_cache_mode(quant_policy: int, sm: int) -> KvCacheMode:
    """KvCacheMode of a `quant_policy` bitmask on a GPU of compute capability `sm`."""
    if not is_int(quant_policy) or quant_policy < 0:
        raise KvxError(Status.INVALID_ARGUMENT, f"quant_policy must be a non-negative int, got {quant_policy!r}")
    if not is_int(sm) or sm <= 0:
        raise KvxError(Status.INVALID_ARGUMENT, f"sm must be a positive int (major*10+minor), got {sm!r}")
    bad = quant_policy & ~int(VALID_POLICY_BITS)
    if bad:
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"quant_policy {quant_policy} has reserved/undefined bits 0x{bad:x}; "
                       "valid bits: 4 (int4 KV), 8 (int8 KV), 16 (FP4 KV)")
    if quant_policy & QuantPolicy.CACHE_KV_FP4:
        if sm >= MIN_SM_NVFP4:
            return KvCacheMode.NVFP4
        if sm >= MIN_SM_MXFP4:
            return KvCacheMode.MXFP4
        raise KvxError(Status.UNSUPPORTED,
                       f"FP4 KV cache (quant_policy bit 16) needs SM89+ (MXFP4) or SM100+ (NVFP4), got SM{sm}; "
                       "use quant_policy 0, 4 or 8")
    if quant_policy & QuantPolicy.CACHE_KV_INT8:
        return KvCacheMode.INT8
    if quant_policy & QuantPolicy.CACHE_KV_INT4:
        return KvCacheMode.INT4
    return KvCacheMode.NONE


def kv_cache_format_name(quant_policy: int, sm: int, model_dtype: torch.dtype = torch.bfloat16) -> str:
    """KVX cache format name (`get_format` key) for a quant_policy; NONE keeps the model dtype."""
    mode = select_kv_cache_mode(quant_policy, sm)
    if mode.format_name is not None:
        return mode.format_name
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    if not isinstance(model_dtype, torch.dtype) or model_dtype not in names:
        raise KvxError(Status.UNSUPPORTED, f"model dtype {model_dtype} has no unquantized KVX cache format")
    return names[model_dtype]
