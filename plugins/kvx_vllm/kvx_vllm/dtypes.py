"""The `kvx_*` cache dtypes and how vLLM learns them (`add_cache_dtypes`, by the mode `api_check` detected).

"registry" (vLLM 0.33): each name is registered with `vllm.config.cache.register_kv_cache_dtype`, whose handler
stores it as `torch.uint8` and reports `KVQuantMode.NONE` (not `CUSTOM`, which 0.33 defines with the value of
`OCTAVE_K3V4`, so it would be read as that mode).

"literal" (vLLM 0.26-0.32, no cache-dtype registry, RFC #51751): `--kv-cache-dtype` choices, pydantic validation
of `CacheConfig.cache_dtype` and the selector's assert all read the `CacheDType` Literal in
`vllm/config/cache.py`. `add_cache_dtypes` extends that Literal everywhere it was copied (the config
field, `vllm.v1.attention.selector`, `EngineArgs`), rebuilds the pydantic dataclasses that embed it,
clears the cached CLI kwargs, and maps the names to `torch.uint8` in `STR_DTYPE_TO_TORCH_DTYPE`
(KVX pages are bytes). vLLM's `get_kv_quant_mode` reports NONE for them: the backend takes its
format from `format_name`, never from vLLM's quant mode.
"""
from __future__ import annotations

from typing import Literal, get_args

import torch

from kvx_core.formats.registry import ENGINE_SERVED, list_formats

KVX_CACHE_DTYPES: dict[str, str] = {f"kvx_{name}": name for name in ENGINE_SERVED}
"""vLLM cache dtype -> KVX cache format (the `_rot` variant when rotation is on), one `kvx_<name>` per format the
registry lists as engine-served (`ENGINE_SERVED`)."""


def is_kvx_dtype(cache_dtype: object) -> bool:
    """True for the cache dtypes this plugin serves."""
    return isinstance(cache_dtype, str) and cache_dtype in KVX_CACHE_DTYPES


def format_name(cache_dtype: str, rotate: bool) -> str:
    """The KVX format of a `kvx_*` cache dtype: e.g. ('kvx_nvfp4', True) -> 'nvfp4_rot'.

    Raises ValueError for a dtype that is not a `kvx_*` one, and for rotation of a format that has no
    rotated variant (kvx_int8).
    """
    if not is_kvx_dtype(cache_dtype):
        raise ValueError(f"KVX: {cache_dtype!r} is not a KVX cache dtype; "
                         f"expected one of {', '.join(KVX_CACHE_DTYPES)}")
    name = KVX_CACHE_DTYPES[cache_dtype] + ("_rot" if rotate else "")
    if name not in list_formats():
        raise ValueError(f"KVX: {cache_dtype} has no rotated variant; Hadamard rotation is defined for "
                         f"{', '.join(d for d in KVX_CACHE_DTYPES if KVX_CACHE_DTYPES[d] + '_rot' in list_formats())}. "
                         'Drop "rotate" from --additional-config \'{"kvx": {...}}\'.')
    return name


def add_cache_dtypes(mode: str) -> None:
    """Make vLLM accept the `kvx_*` names (idempotent): through its registry or by widening the Literal."""
    if mode == "registry":
        _register_cache_dtypes()
    elif mode == "literal":
        _widen_cache_dtype_literal()
    else:
        raise ValueError(f"KVX: unknown cache-dtype mode {mode!r}")


def _register_cache_dtypes() -> None:
    import vllm.config.cache as cache_mod
    from vllm.v1.kv_cache_interface import KVQuantMode

    for name in KVX_CACHE_DTYPES:
        if cache_mod.is_known_kv_cache_dtype(name):
            continue

        class KvxCacheDType:
            """A KVX cache dtype: bytes (pages of data and scales); vLLM's quantized kernels must not touch it."""

            def torch_dtype(self) -> torch.dtype:
                return torch.uint8

            def quant_mode(self) -> KVQuantMode:
                return KVQuantMode.NONE

        KvxCacheDType.name = name
        cache_mod.register_kv_cache_dtype(name)(KvxCacheDType)


def _widen_cache_dtype_literal() -> None:
    import vllm.config as config_pkg
    import vllm.config.cache as cache_mod
    import vllm.engine.arg_utils as arg_utils
    import vllm.v1.attention.selector as selector
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.utils import torch_utils

    old = cache_mod.CacheDType
    if all(d in get_args(old) for d in KVX_CACHE_DTYPES):
        return
    new = Literal[tuple(get_args(old)) + tuple(KVX_CACHE_DTYPES)]  # type: ignore[valid-type]
    cache_mod.CacheDType = new
    selector.CacheDType = new
    for cls, field in ((cache_mod.CacheConfig, "cache_dtype"), (arg_utils.EngineArgs, "kv_cache_dtype")):
        cls.__annotations__[field] = new
        cls.__dataclass_fields__[field].type = new
    rebuild_dataclass(cache_mod.CacheConfig, force=True)
    rebuild_dataclass(config_pkg.VllmConfig, force=True)
    arg_utils._compute_kwargs.cache_clear()
    for name in KVX_CACHE_DTYPES:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE[name] = torch.uint8
