"""ctypes mirror of every struct in kvx_abi.h, field for field (tests/test_abi.py checks each
offset and size against the compiled header). Enum-typed fields are `c_int32`: values from
`kvx_core.enums` / `kvx_core.errors` can be assigned directly."""
from __future__ import annotations

import ctypes
import functools
from typing import Any, TypeVar

from ..errors import KvxError, Status, int_value

MAX_DIMS = 5
"""`KVX_MAX_DIMS`: rank bound of `shape` / `stride`."""

_u32 = ctypes.c_uint32
_i64 = ctypes.c_int64
_enum = ctypes.c_int32  # C enums are int-sized (kvx_abi.h asserts sizeof == 4)
_ptr = ctypes.c_void_p
_dims = _i64 * MAX_DIMS


class VersionC(ctypes.Structure):
    """`kvx_version_t`."""

    _fields_ = [("size", _u32), ("major", _u32), ("minor", _u32), ("patch", _u32)]


class TensorDescC(ctypes.Structure):
    """`kvx_tensor_desc_t` (spec §6.2)."""

    _fields_ = [
        ("size", _u32),
        ("dtype", _enum),
        ("layout", _enum),
        ("memory", _enum),
        ("ndim", _u32),
        ("shape", _dims),
        ("stride", _dims),
        ("data", _ptr),
    ]


class BlockTableC(ctypes.Structure):
    """`kvx_block_table_t` (spec §6.3)."""

    _fields_ = [
        ("size", _u32),
        ("format", _enum),
        ("index_dtype", _enum),
        ("indptr_dtype", _enum),
        ("seq_count", _u32),
        ("beam_width", _u32),
        ("max_blocks_per_seq", _u32),
        ("indices", _ptr),
        ("indptr", _ptr),
        ("indices_count", _u32),
        ("indptr_count", _u32),
        ("flags", _u32),
    ]


class SlotMappingC(ctypes.Structure):
    """`kvx_slot_mapping_t` (spec §6.4)."""

    _fields_ = [
        ("size", _u32),
        ("dtype", _enum),
        ("token_count", _u32),
        ("invalid_slot", _i64),
        ("slots", _ptr),
    ]


class SeqLensC(ctypes.Structure):
    """`kvx_seq_lens_t` (spec §6.5)."""

    _fields_ = [("size", _u32), ("dtype", _enum), ("seq_count", _u32), ("lengths", _ptr)]


class ScaleDescC(ctypes.Structure):
    """`kvx_scale_desc_t` (spec §6.6)."""

    _fields_ = [
        ("size", _u32),
        ("dtype", _enum),
        ("granularity", _enum),
        ("ndim", _u32),
        ("shape", _dims),
        ("stride", _dims),
        ("data", _ptr),
    ]


class PoolDescC(ctypes.Structure):
    """`kvx_pool_desc_t` (spec §6.7)."""

    _fields_ = [
        ("size", _u32),
        ("memory", _enum),
        ("bytes_per_block", _u32),
        ("primary", _ptr),
        ("secondary", _ptr),
    ]


class QuantDescC(ctypes.Structure):
    """`kvx_quant_desc_t` (v1.1, `k_smoothing` appended in v1.2, `k_center` in v1.3): quantized cache format, scale
    pools, global scales and the key transform (smoothing, centering)."""

    _fields_ = [
        ("size", _u32),
        ("format", _enum),
        ("flags", _u32),
        ("group_size", _u32),
        ("k_data_dtype", _enum),
        ("v_data_dtype", _enum),
        ("k_scales", TensorDescC),
        ("v_scales", TensorDescC),
        ("k_global_scale", ctypes.POINTER(ctypes.c_float)),
        ("v_global_scale", ctypes.POINTER(ctypes.c_float)),
        ("global_scale_count", _u32),
        ("k_smoothing", ctypes.POINTER(ctypes.c_float)),  # v1.2
        ("k_center", ctypes.POINTER(ctypes.c_float)),  # v1.3
    ]


class CacheDescC(ctypes.Structure):
    """`kvx_cache_desc_t` (spec §6.1); `quant` is the size-guarded v1.1 tail."""

    _fields_ = [
        ("size", _u32),
        ("num_blocks", _u32),
        ("block_size", _u32),
        ("num_kv_heads", _u32),
        ("head_dim", _u32),
        ("k", TensorDescC),
        ("v", TensorDescC),
        ("pool", PoolDescC),
        ("quant", ctypes.POINTER(QuantDescC)),
    ]


class KvIoDescC(ctypes.Structure):
    """`kvx_kv_io_desc_t` (spec §6.8)."""

    _fields_ = [
        ("size", _u32),
        ("key", TensorDescC),
        ("value", TensorDescC),
        ("num_tokens", _u32),
        ("num_kv_heads", _u32),
        ("head_dim", _u32),
    ]


class WriteDescC(ctypes.Structure):
    """`kvx_write_desc_t` (spec §6.9)."""

    _fields_ = [
        ("size", _u32),
        ("io", KvIoDescC),
        ("slots", SlotMappingC),
        ("k_scale", _ptr),
        ("v_scale", _ptr),
        ("k_scale_desc", ScaleDescC),
        ("v_scale_desc", ScaleDescC),
    ]


class GatherDescC(ctypes.Structure):
    """`kvx_gather_desc_t` (spec §6.10)."""

    _fields_ = [
        ("size", _u32),
        ("io", KvIoDescC),
        ("block_table", BlockTableC),
        ("seq_lens", SeqLensC),
        ("max_seq_len", _u32),
    ]


#: C typedef name of every mirrored struct, in header order.
C_NAMES: dict[type[ctypes.Structure], str] = {
    VersionC: "kvx_version_t",
    TensorDescC: "kvx_tensor_desc_t",
    BlockTableC: "kvx_block_table_t",
    SlotMappingC: "kvx_slot_mapping_t",
    SeqLensC: "kvx_seq_lens_t",
    ScaleDescC: "kvx_scale_desc_t",
    PoolDescC: "kvx_pool_desc_t",
    QuantDescC: "kvx_quant_desc_t",
    CacheDescC: "kvx_cache_desc_t",
    KvIoDescC: "kvx_kv_io_desc_t",
    WriteDescC: "kvx_write_desc_t",
    GatherDescC: "kvx_gather_desc_t",
}

CACHE_DESC_V1_0_SIZE: int = CacheDescC.quant.offset
"""`KVX_CACHE_DESC_V1_0_SIZE`: a v1.0 `kvx_cache_desc_t` ends where `quant` begins."""

QUANT_DESC_V1_1_SIZE: int = QuantDescC.k_smoothing.offset
"""`KVX_QUANT_DESC_V1_1_SIZE`: a v1.1 `kvx_quant_desc_t` ends where `k_smoothing` begins."""

QUANT_DESC_V1_2_SIZE: int = QuantDescC.k_center.offset
"""`KVX_QUANT_DESC_V1_2_SIZE`: a v1.2 `kvx_quant_desc_t` ends where `k_center` begins."""

#: Smallest `size` a consumer accepts per struct: the size of its first version (v1.0, or v1.1 for
#: `kvx_quant_desc_t`), or its full size when the struct has not grown since.
V1_0_SIZES: dict[type[ctypes.Structure], int] = {
    cls: {CacheDescC: CACHE_DESC_V1_0_SIZE, QuantDescC: QUANT_DESC_V1_1_SIZE}.get(cls, ctypes.sizeof(cls))
    for cls in C_NAMES
}

S = TypeVar("S", bound=ctypes.Structure)

#: Inclusive value range of every scalar C type a field uses (enums are int32: kvx_abi.h asserts 4 bytes).
_INT_RANGES: dict[type, tuple[int, int]] = {
    _u32: (0, 2**32 - 1),
    _enum: (-(2**31), 2**31 - 1),
    _i64: (-(2**63), 2**63 - 1),
    _ptr: (0, 2**64 - 1),
}
_C_NAMES_OF_SCALARS = {_u32: "uint32_t", _enum: "a 4-byte enum", _i64: "int64_t", _ptr: "a pointer"}


def fits(value: Any, ctype: type) -> bool:
    """Whether `value` is an int (not a bool) that `ctype` stores unchanged (ctypes would wrap it)."""
    lo, hi = _INT_RANGES[ctype]
    n = int_value(value)
    return n is not None and lo <= n <= hi


def check_value(value: Any, ctype: type, what: str) -> int | None:
    """`value` as the int a C field of type `ctype` stores (None: a NULL pointer); refused when the field
    would silently truncate, wrap or convert it."""
    if ctype is _ptr and value is None:
        return None
    if not fits(value, ctype):
        lo, hi = _INT_RANGES[ctype]
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"{what} = {value!r} does not fit its C field ({_C_NAMES_OF_SCALARS[ctype]}, an int in "
                       f"[{lo}, {hi}])")
    return int_value(value)


@functools.cache
def _field_types(struct_cls: type[ctypes.Structure]) -> dict[str, type]:
    return dict(struct_cls._fields_)


def field_type(struct_cls: type[ctypes.Structure], name: str) -> type:
    """The ctypes type of field `name` of `struct_cls`."""
    ctypes_of = _field_types(struct_cls)
    if name not in ctypes_of:
        raise KvxError(Status.INVALID_ARGUMENT, f"{struct_cls.__name__} has no field {name!r}")
    return ctypes_of[name]


def check_field(struct_cls: type[ctypes.Structure], name: str, value: Any, what: str) -> Any:
    """`value` as field `name` of `struct_cls` stores it (ints normalised, arrays as ctypes arrays); refused
    unless stored unchanged. Fields of other types (structs, pointers) are returned as given."""
    ctype = field_type(struct_cls, name)
    if issubclass(ctype, ctypes.Array):
        if isinstance(value, ctypes.Array):
            return value
        if not isinstance(value, (list, tuple)) or len(value) > ctype._length_:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{what} must be a sequence of at most {ctype._length_} ints, got {value!r}")
        return ctype(*(check_value(x, ctype._type_, f"{what}[{i}]") for i, x in enumerate(value)))
    if ctype in _INT_RANGES:
        return check_value(value, ctype, what)
    return value


def _init_sizes(obj: ctypes.Structure) -> None:
    """Set `size` of `obj` and of every struct nested in it (by value) to its sizeof."""
    obj.size = ctypes.sizeof(obj)
    for name, ctype in obj._fields_:
        if isinstance(ctype, type) and issubclass(ctype, ctypes.Structure):
            _init_sizes(getattr(obj, name))


def new(struct_cls: type[S], **fields: Any) -> S:
    """A zeroed `struct_cls` whose `size` (and nested structs' `size`) is its sizeof, then `fields`
    set. `shape` / `stride` accept any sequence of at most MAX_DIMS ints (the rest stay 0). A value
    its C field cannot hold unchanged (out of range, a bool, a float, the wrong struct) is refused."""
    obj = struct_cls()
    _init_sizes(obj)
    for name, value in fields.items():
        what = f"{struct_cls.__name__}.{name}"
        value = check_field(struct_cls, name, value, what)
        try:
            setattr(obj, name, value)
        except (TypeError, ValueError) as e:
            raise KvxError(Status.INVALID_ARGUMENT, f"{what} cannot hold {value!r}: {e}") from None
    return obj
