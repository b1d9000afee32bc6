"""ABI versioning and size guards (spec §3, §6): what a KVX consumer checks before it reads a
provider's structs."""
from __future__ import annotations

import ctypes

from ..enums import QUANT_FLAG_KEY_CENTERING, QUANT_FLAG_KEY_SMOOTHING
from ..errors import KvxError, Status, int_value
from .structs import CACHE_DESC_V1_0_SIZE, V1_0_SIZES, CacheDescC, QuantDescC, VersionC, field_type, fits

__all__ = [
    "ABI_VERSION",
    "CACHE_DESC_V1_0_SIZE",
    "center_of",
    "check_struct_size",
    "get_version",
    "negotiate",
    "quant_of",
    "smoothing_of",
]

ABI_VERSION: tuple[int, int, int] = (1, 3, 0)
"""(KVX_VERSION_MAJOR, KVX_VERSION_MINOR, KVX_VERSION_PATCH) of kvx_abi.h."""


def get_version() -> VersionC:
    """Python `kvx_get_version`: this package's ABI version, `size` set."""
    major, minor, patch = ABI_VERSION
    return VersionC(ctypes.sizeof(VersionC), major, minor, patch)


def negotiate(provider: VersionC | tuple[int, int, int]) -> None:
    """Accept a provider of the same major version, older or newer minor (structs are
    size-guarded); raise KvxError(INCOMPATIBLE) on a different major version, and
    KvxError(INVALID_ARGUMENT) on anything that is not a `VersionC` or three uint32 ints."""
    if isinstance(provider, VersionC):
        check_struct_size(provider, VersionC)
        major, minor, patch = provider.major, provider.minor, provider.patch
    else:
        u32 = field_type(VersionC, "major")
        if not (isinstance(provider, (tuple, list)) and len(provider) == 3 and all(fits(x, u32) for x in provider)):
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"version must be a VersionC or (major, minor, patch) uint32 ints, got {provider!r}")
        major, minor, patch = (int_value(x) for x in provider)
    if major != ABI_VERSION[0]:
        raise KvxError(
            Status.INCOMPATIBLE,
            f"provider ABI {major}.{minor}.{patch} has major version {major}; "
            f"this consumer speaks KVX {ABI_VERSION[0]}.x only",
        )


def check_struct_size(
    struct_obj_or_size: ctypes.Structure | int,
    struct_cls: type[ctypes.Structure],
    min_size: int | None = None,
) -> int:
    """Validate a struct's `size` field (spec §6): smaller than `min_size` (default: the struct's
    v1.0 size) raises KvxError(INVALID_ARGUMENT); larger is a newer minor and accepted.
    Returns how many bytes of it this consumer may read: min(size, sizeof(struct_cls))."""
    if isinstance(struct_obj_or_size, ctypes.Structure):
        if not isinstance(struct_obj_or_size, struct_cls):
            raise KvxError(
                Status.INVALID_ARGUMENT,
                f"expected a {struct_cls.__name__}, got {type(struct_obj_or_size).__name__}",
            )
        size = struct_obj_or_size.size
    elif fits(struct_obj_or_size, field_type(struct_cls, "size")):
        size = int_value(struct_obj_or_size)
    else:
        raise KvxError(
            Status.INVALID_ARGUMENT,
            f"expected a {struct_cls.__name__} or its uint32 size, got {struct_obj_or_size!r}",
        )
    if min_size is None:
        min_size = V1_0_SIZES.get(struct_cls, ctypes.sizeof(struct_cls))
    if size < min_size:
        raise KvxError(
            Status.INVALID_ARGUMENT,
            f"{struct_cls.__name__}.size is {size}, smaller than its v1.0 size {min_size} "
            f"(was the struct zero-initialised without setting size?)",
        )
    return min(size, ctypes.sizeof(struct_cls))


def quant_of(cache: CacheDescC) -> QuantDescC | None:
    """The v1.1 quantization descriptor of `cache`, or None when absent: a v1.0-sized cache
    descriptor (size < sizeof(CacheDescC)) or a NULL `quant`. Size-checks both structs."""
    if check_struct_size(cache, CacheDescC) < ctypes.sizeof(CacheDescC) or not cache.quant:
        return None
    quant = cache.quant.contents
    check_struct_size(quant, QuantDescC)
    return quant


KEY_VECTORS: dict[str, tuple[int, str, str]] = {
    "k_smoothing": (QUANT_FLAG_KEY_SMOOTHING, "KVX_QUANT_FLAG_KEY_SMOOTHING", "v1.2"),
    "k_center": (QUANT_FLAG_KEY_CENTERING, "KVX_QUANT_FLAG_KEY_CENTERING", "v1.3"),
}
"""The key-transform vectors of `kvx_quant_desc_t`: field -> (the quant flag set iff it is non-NULL, the flag's C
name, the ABI version that appended it). An older consumer refuses the unknown flag instead of misreading keys."""


def _key_vector_of(quant: QuantDescC, field: str):
    """Key-transform pointer `field` of `quant`, or None when NULL or beyond the descriptor's `size` (a producer
    older than the field). The flag and the pointer must agree (INVALID_ARGUMENT otherwise): a flag without a
    vector, or a vector an older consumer would not know to apply."""
    flag, flag_name, since = KEY_VECTORS[field]
    readable = check_struct_size(quant, QuantDescC)
    end = getattr(QuantDescC, field).offset + ctypes.sizeof(ctypes.c_void_p)
    ptr = getattr(quant, field) if readable >= end and getattr(quant, field) else None
    flagged = bool(quant.flags & flag)
    if flagged != (ptr is not None):
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"kvx_quant_desc_t: {flag_name} and {field} disagree (flag {'set' if flagged else 'clear'}, "
                       f"{field} {'set' if ptr is not None else f'NULL or beyond a pre-{since} size'})")
    return ptr


def smoothing_of(quant: QuantDescC):
    """The v1.2 key smoothing pointer (`float*` to `[num_kv_heads, head_dim]`) of a quantization descriptor, or
    None: a v1.1-sized descriptor has none. The flag and the pointer must agree (INVALID_ARGUMENT otherwise)."""
    return _key_vector_of(quant, "k_smoothing")


def center_of(quant: QuantDescC):
    """The v1.3 key centering pointer (`float*` to `[num_kv_heads, head_dim]`) of a quantization descriptor, or
    None: a v1.2-sized (or older) descriptor has none. The flag and the pointer must agree (INVALID_ARGUMENT
    otherwise)."""
    return _key_vector_of(quant, "k_center")
