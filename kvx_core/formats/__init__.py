"""KVX cache formats: exact torch encode/decode references, one module per format.

`get_format(name)` returns a `CacheFormat` (K and V `TensorFormat`s + rotation); `list_formats()`
lists the names. Each module's docstring pins its numerics (rounding, guards, NaN/inf behaviour).
"""
from .base import GROUP_HEAD_DIM, TensorFormat
from .fp8 import FP8Format
from .identity import IdentityFormat
from .integer import IntFormat
from .mxfp4 import MXFP4Format
from .nvfp4 import NVFP4Format, global_scale_from_amax
from .registry import CacheFormat, get_format, list_formats
from .rotation import hadamard, rotate, unrotate

__all__ = [
    "GROUP_HEAD_DIM", "TensorFormat", "IdentityFormat", "FP8Format", "IntFormat", "MXFP4Format",
    "NVFP4Format", "global_scale_from_amax", "CacheFormat", "get_format", "list_formats",
    "hadamard", "rotate", "unrotate",
]
