"""KVX descriptors (spec §6) as dataclasses over torch tensors, with spec §7.1 validation.

Each descriptor keeps the tensors it describes (so views stay alive and the reference ops can use
them) and converts to its C struct with `to_ctypes()` for the ABI. `validate()` checks every field:
its type, that it fits its C field (kvx_abi.h), and that it agrees with the tensor it describes.
Enum fields given as plain ints, as a C caller passes them, become enums on assignment.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .abi import structs
from .abi.version import KEY_VECTORS
from .enums import (
    BLOCK_TABLE_FLAG_KVCACHEINDEX,
    BlockTableFormat,
    DType,
    Layout,
    Memory,
    QuantFormat,
    ScaleGranularity,
    as_enum,
    kvx_dtype,
    require_enum,
    torch_dtype,
)
from .errors import KvxError, Status, int_value, require
from .layouts import Geometry, check_shape, detect_layout, footprint

CACHE_DTYPES = (DType.F16, DType.BF16, DType.F32, DType.F8_E4M3, DType.F8_E5M2)
"""Element dtypes a v1.0 cache (no quantization descriptor) may hold."""
PACKED_DTYPES = (DType.U8, DType.FP4_E2M1X2, DType.INT4X2)
"""v1.1 storage dtypes that need a quantization descriptor."""
IO_DTYPES = (DType.F16, DType.BF16, DType.F32)
INDEX_DTYPES = (DType.S32, DType.S64)


def memory_of(t: torch.Tensor) -> Memory:
    """KVX memory type of a tensor's storage."""
    if t.device.type == "cpu":
        return Memory.HOST_PINNED if t.is_pinned() else Memory.HOST
    return Memory.DEVICE


def _memories_of(t: torch.Tensor) -> tuple[Memory, ...]:
    """Memory types that may describe `t`: pinned host memory is host memory too; device memory may be unified."""
    if t.device.type == "cpu":
        return (Memory.HOST, Memory.HOST_PINNED) if t.is_pinned() else (Memory.HOST,)
    return (Memory.DEVICE, Memory.UNIFIED)


class _Enums:
    """Base of the descriptors: fields named in `_ENUMS` given as plain ints naming a member become that
    member on assignment (as the C ABI reads them); other values stay for `validate()` to refuse."""

    _ENUMS: ClassVar[dict[str, type]] = {}

    def __setattr__(self, name: str, value: object) -> None:
        cls = self._ENUMS.get(name)
        super().__setattr__(name, as_enum(cls, value) if cls is not None else value)

    def _check_enums(self, what: str) -> None:
        for name, cls in self._ENUMS.items():
            require_enum(cls, getattr(self, name), f"{what}.{name}")


def _require_type(value: object, types: type | tuple[type, ...], what: str, optional: bool = False) -> None:
    """INVALID_ARGUMENT unless `value` is one of `types` (or None when `optional`)."""
    if isinstance(value, types) or (optional and value is None):
        return
    names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
    raise KvxError(Status.INVALID_ARGUMENT,
                   f"{what} must be a {names}{' or None' if optional else ''}, got {type(value).__name__}")


def _check_c(c_struct: type[ctypes.Structure], what: str, **values: object) -> None:
    """Each value must be stored unchanged by the same-named field of `c_struct` (an int in its C range)."""
    for name, value in values.items():
        structs.check_field(c_struct, name, value, f"{what}.{name}")


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.dtype, a.shape, a.stride()) == (b.data_ptr(), b.dtype, b.shape, b.stride())


def _check_no_overlap(shape: tuple[int, ...], stride: tuple[int, ...], what: str) -> None:
    """Strides must be non-negative and map distinct indices to distinct elements (no aliasing)."""
    if any(s < 0 for s in stride):
        raise KvxError(Status.INVALID_ARGUMENT, f"{what}: negative strides {stride} are not allowed")
    span = 1
    for s, n in sorted((s, n) for s, n in zip(stride, shape, strict=True) if n > 1):
        if s < span:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"{what}: strides {stride} overlap for shape {shape} (elements would alias)")
        span = s * n


def _int_tuple(value: object, what: str) -> tuple[int, ...]:
    """`value` (a tuple or list of ints, as the C arrays hold) as a tuple of ints."""
    ints = tuple(int_value(x) for x in value) if isinstance(value, (tuple, list)) else (None,)
    if None in ints:
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} must be a tuple of ints, got {value!r}")
    return ints


@dataclass
class TensorDesc(_Enums):
    """`kvx_tensor_desc_t`: dtype, layout, memory, shape and strides (in elements) of one buffer."""

    _ENUMS: ClassVar[dict[str, type]] = {"dtype": DType, "layout": Layout, "memory": Memory}

    dtype: DType
    layout: Layout
    memory: Memory
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    tensor: torch.Tensor | None = field(default=None, repr=False)
    data_ptr: int = 0

    @classmethod
    def from_torch(cls, t: torch.Tensor, layout: Layout = Layout.CUSTOM, dtype: DType | None = None) -> TensorDesc:
        """Describe `t` (zero-copy). `dtype` overrides the storage dtype for packed types (uint8 bytes)."""
        _require_type(t, torch.Tensor, "tensor")
        kdt = require_enum(DType, dtype, "dtype") if dtype is not None else kvx_dtype(t.dtype)
        require(torch_dtype(kdt) == t.dtype, Status.INVALID_ARGUMENT,
                f"dtype {kdt.name} is stored as {torch_dtype(kdt)}, tensor is {t.dtype}")
        return cls(kdt, require_enum(Layout, layout, "layout"), memory_of(t), tuple(t.shape), tuple(t.stride()), t,
                   t.data_ptr())

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def validate(self, what: str) -> None:
        """Field-level checks shared by every tensor descriptor: each field has its type, fits its C
        field, and agrees with the tensor it describes (dtype, shape, strides, memory, pointer)."""
        _require_type(self.tensor, torch.Tensor, f"{what}.tensor")
        self._check_enums(what)
        require(self.dtype != DType.UNSPECIFIED, Status.INVALID_ARGUMENT, f"{what}: dtype is UNSPECIFIED")
        shape, stride = _int_tuple(self.shape, f"{what}.shape"), _int_tuple(self.stride, f"{what}.stride")
        if not 1 <= len(shape) <= structs.MAX_DIMS or len(stride) != len(shape):
            raise KvxError(Status.INVALID_ARGUMENT, f"{what}: ndim must be 1..{structs.MAX_DIMS} with one stride "
                           f"per dim, got shape {shape} stride {stride}")
        _check_c(structs.TensorDescC, what, data=self.data_ptr)
        require(self.data_ptr != 0 or math.prod(shape) == 0, Status.INVALID_ARGUMENT, f"{what}: data pointer is NULL")
        t = self.tensor  # shape and stride equal the tensor's, hence fit int64
        for name, declared, actual in (("shape", shape, tuple(t.shape)), ("stride", stride, t.stride()),
                                       ("data_ptr", self.data_ptr, t.data_ptr())):
            if declared != actual:
                raise KvxError(Status.INVALID_ARGUMENT,
                               f"{what}: {name} {declared} disagrees with the tensor's {actual}")
        if torch_dtype(self.dtype) != t.dtype:
            raise KvxError(Status.INVALID_ARGUMENT, f"{what}: dtype {self.dtype.name} is stored as "
                           f"{torch_dtype(self.dtype)}, the tensor is {t.dtype}")
        memories = _memories_of(t)
        if self.memory not in memories:
            raise KvxError(Status.INVALID_ARGUMENT, f"{what}: memory {self.memory.name} disagrees with the tensor on "
                           f"{t.device} (expected {' or '.join(m.name for m in memories)})")
        _check_no_overlap(shape, stride, what)

    def to_ctypes(self):
        self.validate("tensor")
        return structs.new(structs.TensorDescC, dtype=self.dtype, layout=self.layout, memory=self.memory,
                           ndim=self.ndim, shape=self.shape, stride=self.stride, data=self.data_ptr or None)


@dataclass
class PoolDesc(_Enums):
    """`kvx_pool_desc_t`: block pools addressed by KVCacheIndex (TRT-LLM): block = base + idx*bytes_per_block."""

    _ENUMS: ClassVar[dict[str, type]] = {"memory": Memory}

    memory: Memory
    bytes_per_block: int
    primary: torch.Tensor | None = field(default=None, repr=False)
    secondary: torch.Tensor | None = field(default=None, repr=False)

    def validate(self, what: str = "pool") -> None:
        """Fields have their types and fit their C fields; `memory` describes the primary pool."""
        self._check_enums(what)
        _check_c(structs.PoolDescC, what, bytes_per_block=self.bytes_per_block)
        require(self.bytes_per_block > 0, Status.INVALID_ARGUMENT, f"{what}.bytes_per_block must be > 0")
        require(self.primary is not None, Status.INVALID_ARGUMENT, f"{what}.primary is NULL")
        _require_type(self.primary, torch.Tensor, f"{what}.primary")
        _require_type(self.secondary, torch.Tensor, f"{what}.secondary", optional=True)
        require(self.memory in _memories_of(self.primary), Status.INVALID_ARGUMENT,
                f"{what}: memory {self.memory.name} disagrees with the primary pool on {self.primary.device}")

    def to_ctypes(self):
        self.validate()
        return structs.new(structs.PoolDescC, memory=self.memory, bytes_per_block=self.bytes_per_block,
                           primary=self.primary.data_ptr() if self.primary is not None else None,
                           secondary=self.secondary.data_ptr() if self.secondary is not None else None)


@dataclass
class ScaleDesc(_Enums):
    """`kvx_scale_desc_t`: FP8 / quantization scales and their granularity."""

    _ENUMS: ClassVar[dict[str, type]] = {"dtype": DType, "granularity": ScaleGranularity}

    dtype: DType
    granularity: ScaleGranularity
    tensor: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_torch(cls, t: torch.Tensor | None, granularity: ScaleGranularity) -> ScaleDesc:
        _require_type(t, torch.Tensor, "scale tensor", optional=True)
        if t is None:
            return cls(DType.F32, ScaleGranularity.NONE)
        return cls(kvx_dtype(t.dtype), require_enum(ScaleGranularity, granularity, "granularity"), t)

    def validate(self, what: str) -> None:
        """Fields have their types; a present tensor is stored in `dtype` and fits the C struct's rank."""
        self._check_enums(what)
        _require_type(self.tensor, torch.Tensor, f"{what}.tensor", optional=True)
        t = self.tensor
        if t is not None:
            require(self.dtype != DType.UNSPECIFIED and torch_dtype(self.dtype) == t.dtype, Status.INVALID_ARGUMENT,
                    f"{what}: dtype {self.dtype.name} disagrees with the tensor's {t.dtype}")
            require(t.dim() <= structs.MAX_DIMS, Status.INVALID_ARGUMENT,
                    f"{what}: a scale tensor has at most {structs.MAX_DIMS} dims, got {t.dim()}")

    def to_ctypes(self):
        self.validate("scale")
        t = self.tensor
        if t is None:
            return structs.new(structs.ScaleDescC, dtype=self.dtype, granularity=self.granularity)
        return structs.new(structs.ScaleDescC, dtype=self.dtype, granularity=self.granularity,
                           ndim=t.dim(), shape=list(t.shape), stride=list(t.stride()), data=t.data_ptr())


@dataclass
class QuantDesc(_Enums):
    """`kvx_quant_desc_t` (v1.1; v1.2 `k_smoothing`; v1.3 `k_center`): the cache format, group size, scale pools,
    global scales and key transform."""

    _ENUMS: ClassVar[dict[str, type]] = {"format": QuantFormat, "k_data_dtype": DType, "v_data_dtype": DType}

    format: QuantFormat
    group_size: int
    k_data_dtype: DType
    v_data_dtype: DType
    k_scales: TensorDesc | None
    v_scales: TensorDesc | None
    k_global_scale: torch.Tensor | None = None
    v_global_scale: torch.Tensor | None = None
    flags: int = 0
    k_smoothing: torch.Tensor | None = None
    """FP32 `[num_kv_heads, head_dim]` per-channel key smoothing (`ops.smoothing`): K is stored divided by it. In the
    C ABI (v1.2) `kvx_quant_desc_t.k_smoothing` with `KVX_QUANT_FLAG_KEY_SMOOTHING`, which `to_ctypes` sets (the
    Python `flags` keep the format's own bits)."""
    k_center: torch.Tensor | None = None
    """FP32 `[num_kv_heads, head_dim]` per-channel key centering (`ops.smoothing`): K is stored as `(K - c) / s`. In
    the C ABI (v1.3) `kvx_quant_desc_t.k_center` with `KVX_QUANT_FLAG_KEY_CENTERING`, which `to_ctypes` sets."""

    @property
    def global_scale_count(self) -> int:
        g = self.k_global_scale
        return 0 if g is None else g.numel()

    def to_ctypes(self):
        for name in ("k_scales", "v_scales"):
            _require_type(getattr(self, name), TensorDesc, f"quant.{name}", optional=True)
        flags = self.flags
        for name, (flag, flag_name, _) in KEY_VECTORS.items():
            v = getattr(self, name)
            _require_type(v, torch.Tensor, f"quant.{name}", optional=True)
            require(v is None or (v.dtype == torch.float32 and v.dim() == 2 and v.is_contiguous()),
                    Status.INVALID_ARGUMENT, f"quant.{name} must be a contiguous FP32 [num_kv_heads, head_dim] "
                    "tensor (the C ABI reads it row-major)")
            require(not self.flags & flag, Status.INVALID_ARGUMENT,
                    f"quant.flags: {flag_name} is set from quant.{name}, not by hand")
            flags |= flag if v is not None else 0
        empty = structs.new(structs.TensorDescC)
        return structs.new(
            structs.QuantDescC, format=self.format, flags=flags, group_size=self.group_size,
            k_data_dtype=self.k_data_dtype, v_data_dtype=self.v_data_dtype,
            k_scales=self.k_scales.to_ctypes() if self.k_scales else empty,
            v_scales=self.v_scales.to_ctypes() if self.v_scales else empty,
            k_global_scale=_f32_ptr(self.k_global_scale), v_global_scale=_f32_ptr(self.v_global_scale),
            global_scale_count=self.global_scale_count,
            **{name: _f32_ptr(getattr(self, name)) for name in KEY_VECTORS})


def _f32_ptr(t: torch.Tensor | None):
    """A `float*` (ctypes POINTER(c_float)) to `t`'s data, or NULL."""
    _require_type(t, torch.Tensor, "global scale", optional=True)
    return None if t is None else ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_float))


@dataclass
class CacheDesc:
    """`kvx_cache_desc_t`: one layer's paged K and V buffers plus optional pool and quantization."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    k: TensorDesc
    v: TensorDesc
    pool: PoolDesc | None = None
    quant: QuantDesc | None = None

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @classmethod
    def from_torch(cls, k: torch.Tensor, v: torch.Tensor, *, block_size: int, num_kv_heads: int, head_dim: int,
                   k_layout: Layout | None = None, v_layout: Layout | None = None, pool: PoolDesc | None = None,
                   quant: QuantDesc | None = None, validate: bool = True) -> CacheDesc:
        """Describe paged K/V tensors (layouts detected from shape/strides unless given) and validate."""
        _require_type(k, torch.Tensor, "cache k")
        _require_type(v, torch.Tensor, "cache v")
        _require_type(quant, QuantDesc, "quant", optional=True)
        require(k.dim() > 0, Status.INVALID_ARGUMENT, "cache k must have a blocks dim, got a 0-D tensor")
        geom = Geometry(int(k.shape[0]), block_size, num_kv_heads, head_dim)
        geom.check()
        kd = require_enum(DType, quant.k_data_dtype, "quant.k_data_dtype") if quant else None
        vd = require_enum(DType, quant.v_data_dtype, "quant.v_data_dtype") if quant else None
        kl = k_layout if k_layout is not None else detect_layout(k, _storage_geometry(geom, kd))
        vl = v_layout if v_layout is not None else detect_layout(v, _storage_geometry(geom, vd))
        desc = cls(geom.num_blocks, block_size, num_kv_heads, head_dim,
                   TensorDesc.from_torch(k, kl, kd), TensorDesc.from_torch(v, vl, vd), pool, quant)
        if validate:
            desc.validate()
        return desc

    def storage_geometry(self, which: str) -> Geometry:
        """Geometry of the K or V data tensor in storage elements (packed formats shrink head_dim)."""
        t = self.k if which == "k" else self.v
        return _storage_geometry(self.geometry, t.dtype)

    def validate(self) -> None:
        """Spec §7.1 / §4.2 validation; raises KvxError with the spec status."""
        _check_c(structs.CacheDescC, "cache", num_blocks=self.num_blocks, block_size=self.block_size,
                 num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        self.geometry.check()
        _require_type(self.k, TensorDesc, "cache.k")
        _require_type(self.v, TensorDesc, "cache.v")
        _require_type(self.pool, PoolDesc, "cache.pool", optional=True)
        _require_type(self.quant, QuantDesc, "cache.quant", optional=True)
        for which, t in (("k", self.k), ("v", self.v)):
            what = f"cache.{which}"
            t.validate(what)
            require(t.layout != Layout.UNSPECIFIED, Status.INVALID_ARGUMENT, f"{what}: layout is UNSPECIFIED")
            allowed = CACHE_DTYPES + (PACKED_DTYPES if self.quant else ())
            if t.dtype not in allowed:
                raise KvxError(Status.INVALID_ARGUMENT, f"{what}: dtype {t.dtype.name} is not a cache dtype (allowed: "
                               f"{', '.join(d.name for d in allowed)}; packed dtypes need a quantization descriptor)")
            check_shape(t.layout, t.shape, self.storage_geometry(which), what)
        if self.k.memory != self.v.memory:
            raise KvxError(Status.INVALID_ARGUMENT, f"cache K and V live in different memories "
                           f"({self.k.memory.name} vs {self.v.memory.name})")
        if self.k.tensor.device != self.v.tensor.device:
            raise KvxError(Status.INVALID_ARGUMENT, f"cache K and V live on different devices "
                           f"({self.k.tensor.device} vs {self.v.tensor.device})")
        if self.quant is None:
            if self.k.dtype != self.v.dtype:
                raise KvxError(Status.INVALID_ARGUMENT, f"cache K dtype {self.k.dtype.name} != V dtype "
                               f"{self.v.dtype.name} (mixed K/V dtypes need a quantization descriptor)")
        else:
            _validate_quant(self.quant, self)
        if self.pool is not None:
            self.pool.validate("cache.pool")
        self._check_disjoint()

    def written_regions(self) -> dict[str, torch.Tensor]:
        """The tensors a write stores into: K and V data, and the K and V scale pools when present."""
        out = {"cache.k": self.k.tensor, "cache.v": self.v.tensor}
        q = self.quant
        for name in ("k_scales", "v_scales"):
            s = getattr(q, name) if q is not None else None
            if s is not None:
                out[f"quant.{name}"] = s.tensor
        return out

    def _check_disjoint(self) -> None:
        """No byte is shared by two of K data, V data, K scales, V scales (a write to one would corrupt
        another), nor by one of them and a global scale. Exact for interleaved strided views (regions of
        one page buffer are fine). K and V (and K and V scales) may be one view only for a pool cache, addressed by
        KV_OFFSETS."""
        regions = [(name, t, footprint(t)) for name, t in self.written_regions().items()]
        for i, (name_a, a, fa) in enumerate(regions):
            for name_b, b, fb in regions[i + 1:]:
                if (name_a, name_b) in (("cache.k", "cache.v"), ("quant.k_scales", "quant.v_scales")) \
                        and self.pool is not None and _same_view(a, b):
                    continue  # TRT-LLM KVBlockArray: one pool (and block-scale pool), K / V told apart by KV_OFFSETS
                if fa.overlaps(fb):
                    raise KvxError(Status.INVALID_ARGUMENT, f"{name_a} and {name_b} overlap in memory, so writing "
                                   "one would corrupt the other; give each its own bytes")
        for g_name in ("k_global_scale", "v_global_scale"):
            g = getattr(self.quant, g_name) if self.quant is not None else None
            if g is None:
                continue
            fg = footprint(g)
            for name, _, ft in regions:
                if fg.overlaps(ft):
                    raise KvxError(Status.INVALID_ARGUMENT,
                                   f"quant.{g_name} overlaps {name} in memory, so a write would change the scale")

    def to_ctypes(self):
        """The C struct of a valid descriptor; returns `(struct, keepalive)` where keepalive holds nested structs."""
        self.validate()
        quant = self.quant.to_ctypes() if self.quant else None
        pool = self.pool.to_ctypes() if self.pool else structs.new(structs.PoolDescC)
        c = structs.new(structs.CacheDescC, num_blocks=self.num_blocks, block_size=self.block_size,
                        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, k=self.k.to_ctypes(),
                        v=self.v.to_ctypes(), pool=pool)
        if quant is not None:
            c.quant = ctypes.pointer(quant)
        return c, quant


def storage_head_dim(head_dim: int, dtype: DType) -> int:
    """Elements per token-head in storage: two 4-bit codes share a byte for FP4_E2M1X2 / INT4X2."""
    if dtype in (DType.FP4_E2M1X2, DType.INT4X2):
        require(head_dim % 2 == 0, Status.INVALID_ARGUMENT, f"head_dim {head_dim} must be even for {dtype.name}")
        return head_dim // 2
    return head_dim


def _storage_geometry(geom: Geometry, dtype: DType | None) -> Geometry:
    if dtype is None:
        return geom
    return Geometry(geom.num_blocks, geom.block_size, geom.num_kv_heads, storage_head_dim(geom.head_dim, dtype))


def _validate_quant(q: QuantDesc, cache: CacheDesc) -> None:
    q._check_enums("quant")
    _check_c(structs.QuantDescC, "quant", group_size=q.group_size, flags=q.flags)
    require(q.format != QuantFormat.NONE, Status.INVALID_ARGUMENT, "quant.format is NONE; omit the descriptor")
    require(q.group_size > 0 and cache.head_dim % q.group_size == 0, Status.INVALID_ARGUMENT,
            f"quant.group_size {q.group_size} must divide head_dim {cache.head_dim}")
    if (cache.k.dtype, cache.v.dtype) != (q.k_data_dtype, q.v_data_dtype):
        raise KvxError(Status.INVALID_ARGUMENT, f"quant data dtypes ({q.k_data_dtype.name}, {q.v_data_dtype.name}) "
                       f"differ from the cache tensors' ({cache.k.dtype.name}, {cache.v.dtype.name})")
    device = cache.k.tensor.device
    for which, s in (("k_scales", q.k_scales), ("v_scales", q.v_scales)):
        _require_type(s, TensorDesc, f"quant.{which}", optional=True)
        if s is None:
            continue
        s.validate(f"quant.{which}")
        require(s.shape[0] == cache.num_blocks, Status.INVALID_ARGUMENT,
                f"quant.{which}: scale pool has {s.shape[0]} blocks, data pool {cache.num_blocks} "
                "(dual pools share block ids)")
        if s.tensor.device != device or s.memory != cache.k.memory:
            raise KvxError(Status.INVALID_ARGUMENT, f"quant.{which} lives in {s.memory.name} on {s.tensor.device}, "
                           f"the data pools in {cache.k.memory.name} on {device}")
    for name in ("k_global_scale", "v_global_scale"):
        _require_type(getattr(q, name), torch.Tensor, f"quant.{name}", optional=True)
    n = q.global_scale_count
    _check_c(structs.QuantDescC, "quant", global_scale_count=n)
    require(n in (0, 1, cache.num_kv_heads), Status.INVALID_ARGUMENT,
            f"global scales must be per tensor (1) or per KV head ({cache.num_kv_heads}), got {n}")
    for name in ("k_global_scale", "v_global_scale"):
        g = getattr(q, name)
        require((g is None) == (n == 0) and (g is None or (g.dtype == torch.float32 and g.numel() == n)),
                Status.INVALID_ARGUMENT, f"quant.{name} must be FP32 with {n} element(s) like k_global_scale")
        if g is not None and g.device != device:
            raise KvxError(Status.INVALID_ARGUMENT, f"quant.{name} is on {g.device}, the data pools on {device}")
    check_key_smoothing(q.k_smoothing, cache.num_kv_heads, cache.head_dim, device)
    check_key_center(q.k_center, cache.num_kv_heads, cache.head_dim, device)


def _check_key_vector(what: str, v: torch.Tensor | None, num_kv_heads: int, head_dim: int, device) -> bool:
    """None (False), or FP32 `[num_kv_heads, head_dim]` on the pools' device (True)."""
    _require_type(v, torch.Tensor, what, optional=True)
    if v is None:
        return False
    require(v.dtype == torch.float32 and tuple(v.shape) == (num_kv_heads, head_dim), Status.INVALID_ARGUMENT,
            f"{what} must be FP32 [{num_kv_heads}, {head_dim}], got {v.dtype} {tuple(v.shape)}")
    require(v.device == torch.device(device), Status.INVALID_ARGUMENT,
            f"{what} is on {v.device}, the data pools on {device}")
    return True


def finite_positive(t: torch.Tensor) -> torch.Tensor:
    """Device bool: every element finite and > 0 (the rule of global scales and smoothing vectors; no host sync,
    so callers can batch it)."""
    return (torch.isfinite(t) & (t > 0)).all()


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Device bool: every element finite (the rule of centering vectors; no host sync)."""
    return torch.isfinite(t).all()


def check_key_smoothing(s: torch.Tensor | None, num_kv_heads: int, head_dim: int, device,
                        what: str = "quant.k_smoothing") -> None:
    """A key-smoothing vector: None, or FP32 `[num_kv_heads, head_dim]` on the pools' device, finite and > 0 (one
    host sync). `what` names it in errors (a KV bundle's vector is checked by the same rule)."""
    if _check_key_vector(what, s, num_kv_heads, head_dim, device):
        require(bool(finite_positive(s)), Status.INVALID_ARGUMENT,
                f"{what} must be finite and > 0 (keys are divided by it)")


def check_key_center(c: torch.Tensor | None, num_kv_heads: int, head_dim: int, device,
                     what: str = "quant.k_center") -> None:
    """A key-centering vector: None, or FP32 `[num_kv_heads, head_dim]` on the pools' device, finite (one host
    sync). `what` as for `check_key_smoothing`."""
    if _check_key_vector(what, c, num_kv_heads, head_dim, device):
        require(bool(all_finite(c)), Status.INVALID_ARGUMENT,
                f"{what} must be finite (it is subtracted from every key)")


@dataclass
class BlockTable(_Enums):
    """`kvx_block_table_t`: PACKED `[seqs, max_blocks]`, RAGGED `indices`+`indptr` (per token), or
    KV_OFFSETS `[seqs, beam, 2, max_blocks]` of TRT-LLM KVCacheIndex values."""

    _ENUMS: ClassVar[dict[str, type]] = {"format": BlockTableFormat}

    format: BlockTableFormat
    indices: torch.Tensor
    seq_count: int
    max_blocks_per_seq: int
    indptr: torch.Tensor | None = None
    beam_width: int = 1
    flags: int = 0

    @classmethod
    def packed(cls, table: torch.Tensor) -> BlockTable:
        _require_type(table, torch.Tensor, "PACKED block table")
        require(table.dim() == 2, Status.INVALID_ARGUMENT, f"PACKED block table must be 2-D, got {tuple(table.shape)}")
        return cls(BlockTableFormat.PACKED, table, int(table.shape[0]), int(table.shape[1]))

    @classmethod
    def ragged(cls, indices: torch.Tensor, indptr: torch.Tensor, max_blocks_per_seq: int) -> BlockTable:
        _require_type(indices, torch.Tensor, "RAGGED indices")
        _require_type(indptr, torch.Tensor, "RAGGED indptr")
        require(indptr.dim() == 1 and indptr.numel() >= 1, Status.INVALID_ARGUMENT,
                "RAGGED indptr must be 1-D with seq_count + 1 entries")
        return cls(BlockTableFormat.RAGGED, indices, indptr.numel() - 1, max_blocks_per_seq, indptr)

    @classmethod
    def kv_offsets(cls, offsets: torch.Tensor) -> BlockTable:
        _require_type(offsets, torch.Tensor, "KV_OFFSETS table")
        require(offsets.dim() == 4 and offsets.shape[2] == 2, Status.INVALID_ARGUMENT,
                f"KV_OFFSETS table must be [seqs, beam, 2, max_blocks], got {tuple(offsets.shape)}")
        b, w, _, m = offsets.shape
        return cls(BlockTableFormat.KV_OFFSETS, offsets, int(b), int(m), beam_width=int(w),
                   flags=BLOCK_TABLE_FLAG_KVCACHEINDEX)

    @property
    def index_dtype(self) -> DType:
        return _index_dtype(self.indices, "block_table.indices")

    @property
    def indices_count(self) -> int:
        return self.indices.numel()

    @property
    def indptr_count(self) -> int:
        return 0 if self.indptr is None else self.indptr.numel()

    def validate(self, cache: CacheDesc | None = None) -> None:
        """Spec §5.1 / §7.1 block-table rules (field types and C ranges, counts, dtypes, indptr, beam width,
        power of two); `indices` is flat (a C buffer) or has the format's shape."""
        self._check_enums("block_table")
        _require_type(self.indices, torch.Tensor, "block_table.indices")
        _require_type(self.indptr, torch.Tensor, "block_table.indptr", optional=True)
        _require_type(cache, CacheDesc, "cache", optional=True)
        _check_c(structs.BlockTableC, "block_table", seq_count=self.seq_count, beam_width=self.beam_width,
                 max_blocks_per_seq=self.max_blocks_per_seq, flags=self.flags, indices_count=self.indices_count,
                 indptr_count=self.indptr_count)
        fmt, dt = self.format, self.index_dtype
        if fmt == BlockTableFormat.KV_OFFSETS:
            require(dt == DType.S32, Status.INVALID_ARGUMENT, f"KV_OFFSETS indices must be S32, got {dt.name}")
            require(self.flags & BLOCK_TABLE_FLAG_KVCACHEINDEX, Status.INVALID_ARGUMENT,
                    "KV_OFFSETS tables must set KVX_BLOCK_TABLE_FLAG_KVCACHEINDEX")
            shape = (self.seq_count, self.beam_width, 2, self.max_blocks_per_seq)
            if cache is not None:
                bs = cache.block_size
                require(bs & (bs - 1) == 0, Status.INVALID_ARGUMENT,
                        f"KV_OFFSETS needs a power-of-two block_size (TRT-LLM tokensPerBlock), got {bs}")
                require(cache.pool is not None, Status.INVALID_ARGUMENT,
                        "KV_OFFSETS needs cache.pool (bytes_per_block and pool base pointers)")
        else:
            require(dt in INDEX_DTYPES, Status.INVALID_ARGUMENT,
                    f"{fmt.name} indices must be S32 or S64, got {dt.name}")
            require(self.beam_width == 1, Status.INVALID_ARGUMENT, f"{fmt.name} tables need beam_width 1")
            shape = (self.seq_count, self.max_blocks_per_seq) if fmt == BlockTableFormat.PACKED else None
        require(self.beam_width >= 1, Status.INVALID_ARGUMENT, "beam_width must be >= 1")
        if fmt == BlockTableFormat.RAGGED:
            require(self.indptr is not None and self.indptr_count == self.seq_count + 1, Status.INVALID_ARGUMENT,
                    f"RAGGED indptr_count must be seq_count + 1 = {self.seq_count + 1}, got {self.indptr_count}")
            ip = self.indptr
            ipdt = _index_dtype(ip, "block_table.indptr")
            require(ipdt in INDEX_DTYPES and ip.dim() == 1, Status.INVALID_ARGUMENT,
                    f"RAGGED indptr must be a 1-D S32/S64 tensor, got {ipdt.name} {tuple(ip.shape)}")
            require(int(ip[0]) == 0 and bool((ip[1:] >= ip[:-1]).all()), Status.INVALID_ARGUMENT,
                    "RAGGED indptr must start at 0 and be non-decreasing")
            want = int(ip[-1])
        else:
            require(self.indptr_count == 0, Status.INVALID_ARGUMENT,
                    f"{fmt.name} tables carry no indptr (indptr_count must be 0, got {self.indptr_count})")
            want = math.prod(shape)
        require(self.indices_count == want, Status.INVALID_ARGUMENT,
                f"{fmt.name} indices_count {self.indices_count} != expected {want}")
        require(self.indices.dim() == 1 or tuple(self.indices.shape) == shape, Status.INVALID_ARGUMENT,
                f"{fmt.name} block_table.indices must be 1-D" + (f" or {list(shape)}" if shape else "")
                + f", got shape {list(self.indices.shape)}")

    def to_ctypes(self):
        self.validate()
        ip = self.indptr
        return structs.new(structs.BlockTableC, format=self.format, index_dtype=self.index_dtype,
                           indptr_dtype=_index_dtype(ip, "indptr") if ip is not None else 0,
                           seq_count=self.seq_count, beam_width=self.beam_width,
                           max_blocks_per_seq=self.max_blocks_per_seq, indices=self.indices.data_ptr() or None,
                           indptr=ip.data_ptr() if ip is not None else None, indices_count=self.indices_count,
                           indptr_count=self.indptr_count, flags=self.flags)


def _index_dtype(t: torch.Tensor, what: str) -> DType:
    _require_type(t, torch.Tensor, what)
    try:
        return kvx_dtype(t.dtype)
    except KvxError:
        raise KvxError(Status.INVALID_ARGUMENT, f"{what}: dtype {t.dtype} is not S32 or S64") from None


@dataclass
class SlotMapping:
    """`kvx_slot_mapping_t`: one global slot per token; `invalid_slot` (and any negative slot) is a no-op."""

    slots: torch.Tensor
    invalid_slot: int = -1

    @property
    def token_count(self) -> int:
        return self.slots.numel()

    def validate(self, cache: CacheDesc) -> None:
        _require_type(cache, CacheDesc, "cache")
        dt = _index_dtype(self.slots, "slot_mapping.slots")
        require(dt in INDEX_DTYPES and self.slots.dim() == 1, Status.INVALID_ARGUMENT,
                f"slot mapping must be a 1-D S32/S64 tensor, got {dt.name} {tuple(self.slots.shape)}")
        _check_c(structs.SlotMappingC, "slot_mapping", invalid_slot=self.invalid_slot, token_count=self.token_count)
        total = cache.num_blocks * cache.block_size
        valid = self.slots[(self.slots != self.invalid_slot) & (self.slots >= 0)]
        if valid.numel():
            hi = int(valid.max())
            require(hi < total, Status.OUT_OF_RANGE,
                    f"slot {hi} is out of range: the cache has {cache.num_blocks} blocks x "
                    f"{cache.block_size} tokens = {total} slots")

    def to_ctypes(self):
        return structs.new(structs.SlotMappingC, dtype=_index_dtype(self.slots, "slot_mapping.slots"),
                           token_count=self.token_count, invalid_slot=self.invalid_slot,
                           slots=self.slots.data_ptr() or None)


@dataclass
class SeqLens:
    """`kvx_seq_lens_t`: cached tokens per sequence."""

    lengths: torch.Tensor

    @property
    def seq_count(self) -> int:
        return self.lengths.numel()

    def validate(self, table: BlockTable, block_size: int) -> None:
        _require_type(table, BlockTable, "block table")
        dt = _index_dtype(self.lengths, "seq_lens.lengths")
        require(dt in INDEX_DTYPES and self.lengths.dim() == 1, Status.INVALID_ARGUMENT,
                "seq_lens must be a 1-D S32/S64 tensor")
        _check_c(structs.SeqLensC, "seq_lens", seq_count=self.seq_count)
        require(self.seq_count == table.seq_count, Status.INVALID_ARGUMENT,
                f"seq_lens has {self.seq_count} sequences, block table {table.seq_count}")
        if self.seq_count:
            require(int(self.lengths.min()) >= 0, Status.INVALID_ARGUMENT, "sequence lengths must be >= 0")
            cap = table.max_blocks_per_seq * block_size
            require(table.format == BlockTableFormat.RAGGED or int(self.lengths.max()) <= cap, Status.OUT_OF_RANGE,
                    f"a sequence length {int(self.lengths.max())} exceeds max_blocks_per_seq * block_size = {cap}")

    def to_ctypes(self):
        return structs.new(structs.SeqLensC, dtype=_index_dtype(self.lengths, "seq_lens.lengths"),
                           seq_count=self.seq_count, lengths=self.lengths.data_ptr() or None)


@dataclass
class KvIoDesc:
    """`kvx_kv_io_desc_t`: dense `[num_tokens, num_kv_heads, head_dim]` K and V (input of write,
    output of gather)."""

    key: torch.Tensor
    value: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.key.shape[0])

    def validate(self, cache: CacheDesc, what: str) -> None:
        """Spec §7: num_tokens, num_kv_heads and head_dim must agree with the cache."""
        _require_type(cache, CacheDesc, "cache")
        for name, t in (("key", self.key), ("value", self.value)):
            _require_type(t, torch.Tensor, f"{what}.{name}")
            require(t.dim() == 3, Status.INVALID_ARGUMENT,
                    f"{what}.{name} must be [num_tokens, num_kv_heads, head_dim], got {tuple(t.shape)}")
            require(kvx_dtype(t.dtype) in IO_DTYPES, Status.UNSUPPORTED,
                    f"{what}.{name} dtype {t.dtype} unsupported (F16, BF16, F32)")
            n, h, d = t.shape
            require(n == self.num_tokens, Status.INVALID_ARGUMENT,
                    f"{what}: key has {self.num_tokens} tokens, {name} {n}")
            require(h == cache.num_kv_heads and d == cache.head_dim, Status.INVALID_ARGUMENT,
                    f"{what}.{name}: [{h} heads, {d} head_dim] != cache [{cache.num_kv_heads}, {cache.head_dim}]")
            require(t.device == cache.k.tensor.device, Status.INVALID_ARGUMENT,
                    f"{what}.{name} is on {t.device}, the cache on {cache.k.tensor.device}")
        _check_c(structs.KvIoDescC, what, num_tokens=self.num_tokens)

    def to_ctypes(self, cache: CacheDesc):
        self.validate(cache, "io")
        return structs.new(structs.KvIoDescC, key=TensorDesc.from_torch(self.key).to_ctypes(),
                           value=TensorDesc.from_torch(self.value).to_ctypes(), num_tokens=self.num_tokens,
                           num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim)


@dataclass
class WriteDesc:
    """`kvx_write_desc_t`: tokens to store and where (slot mapping), with optional FP8 scales."""

    io: KvIoDesc
    slots: SlotMapping
    k_scale: ScaleDesc | None = None
    v_scale: ScaleDesc | None = None

    def validate(self, cache: CacheDesc) -> None:
        _require_type(self.io, KvIoDesc, "write.io")
        _require_type(self.slots, SlotMapping, "write.slots")
        for name in ("k_scale", "v_scale"):
            scale = getattr(self, name)
            _require_type(scale, ScaleDesc, f"write.{name}", optional=True)
            if scale is not None:
                scale.validate(f"write.{name}")
        self.io.validate(cache, "write.io")
        self.slots.validate(cache)
        require(self.slots.token_count == self.io.num_tokens, Status.INVALID_ARGUMENT,
                f"slot mapping has {self.slots.token_count} slots for {self.io.num_tokens} tokens")


@dataclass
class GatherDesc:
    """`kvx_gather_desc_t`: gather `min(seq_len, max_seq_len)` tokens per sequence into ragged dense K/V."""

    block_table: BlockTable
    seq_lens: SeqLens
    max_seq_len: int

    def output_lengths(self) -> torch.Tensor:
        """Tokens gathered per output sequence (beams of KV_OFFSETS tables are separate sequences)."""
        n = self.seq_lens.lengths.to(torch.int64).clamp(max=self.max_seq_len)
        return n.repeat_interleave(self.block_table.beam_width)

    def validate(self, cache: CacheDesc) -> None:
        _require_type(self.block_table, BlockTable, "gather.block_table")
        _require_type(self.seq_lens, SeqLens, "gather.seq_lens")
        _check_c(structs.GatherDescC, "gather", max_seq_len=self.max_seq_len)
        self.block_table.validate(cache)
        self.seq_lens.validate(self.block_table, cache.block_size)
