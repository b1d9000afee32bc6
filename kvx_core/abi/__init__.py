"""The KVX C ABI: kvx_abi.h (shipped beside this file), its ctypes mirror and version negotiation."""
from __future__ import annotations

from pathlib import Path

from .structs import (
    C_NAMES,
    CACHE_DESC_V1_0_SIZE,
    MAX_DIMS,
    QUANT_DESC_V1_1_SIZE,
    QUANT_DESC_V1_2_SIZE,
    V1_0_SIZES,
    BlockTableC,
    CacheDescC,
    GatherDescC,
    KvIoDescC,
    PoolDescC,
    QuantDescC,
    ScaleDescC,
    SeqLensC,
    SlotMappingC,
    TensorDescC,
    VersionC,
    WriteDescC,
    new,
)
from .version import ABI_VERSION, center_of, check_struct_size, get_version, negotiate, quant_of, smoothing_of

HEADER_PATH: Path = Path(__file__).with_name("kvx_abi.h")
"""Path of the installed kvx_abi.h (add its folder to a C compiler's include path)."""

__all__ = [
    "ABI_VERSION",
    "C_NAMES",
    "CACHE_DESC_V1_0_SIZE",
    "HEADER_PATH",
    "MAX_DIMS",
    "QUANT_DESC_V1_1_SIZE",
    "QUANT_DESC_V1_2_SIZE",
    "V1_0_SIZES",
    "BlockTableC",
    "CacheDescC",
    "GatherDescC",
    "KvIoDescC",
    "PoolDescC",
    "QuantDescC",
    "ScaleDescC",
    "SeqLensC",
    "SlotMappingC",
    "TensorDescC",
    "VersionC",
    "WriteDescC",
    "center_of",
    "check_struct_size",
    "get_version",
    "negotiate",
    "new",
    "quant_of",
    "smoothing_of",
]
