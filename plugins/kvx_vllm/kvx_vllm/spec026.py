"""vLLM 0.26-0.27's page model ("spec_hook", `compat`): a `kvx_*` layer's page size comes from
`Attention.get_kv_cache_spec`, which `install_version_hooks` wraps so the layer gets a `KvxFullAttentionSpec` /
`KvxSlidingWindowSpec` (vLLM's spec with the page of the format's bytes). Later page models size pages in the
backend (`customize_spec`) and need no hook. Imports nothing from vLLM at module level."""
from __future__ import annotations

import functools
from typing import Any


def install_version_hooks(page_mode: str) -> None:
    """Hooks the detected page model needs beyond the backend class (idempotent): the spec hook for "spec_hook"
    only (on later models it would be ignored and leave vLLM's dense page)."""
    if page_mode == "spec_hook":
        _install_page_spec_026()


def _install_page_spec_026() -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    if getattr(Attention.get_kv_cache_spec, "_kvx", False):
        return
    original = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        from .dtypes import is_kvx_dtype

        spec = original(self, vllm_config)
        if spec is None or not is_kvx_dtype(self.kv_cache_dtype):
            return spec
        return kvx_spec(spec, vllm_config)

    get_kv_cache_spec._kvx = True
    Attention.get_kv_cache_spec = get_kv_cache_spec


def kvx_spec(spec: Any, vllm_config: Any) -> Any:
    """vLLM 0.26-0.27: the layer's `FullAttentionSpec` / `SlidingWindowSpec` as its KVX subclass of the run's format
    (the same fields, the page of the format's bytes), so vLLM's hybrid allocator mixes full and window groups of
    one page size."""
    from dataclasses import fields

    from kvx_core.formats import get_format

    from .options import check_config
    from .pages import token_bytes

    classes = spec_classes()
    if type(spec) not in classes:
        raise ValueError(f"KVX cache dtype {vllm_config.cache_config.cache_dtype}: this layer needs a "
                         f"{type(spec).__name__} (chunked local attention, ...), which the KVX vLLM backend does not "
                         "serve; use another --kv-cache-dtype")
    fmt = get_format(check_config(vllm_config))
    kw = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    return classes[type(spec)](**kw, kvx_token_bytes=token_bytes(fmt, spec.num_kv_heads, spec.head_size))


@functools.cache
def spec_classes() -> dict[type, type]:
    """vLLM's spec class -> its KVX subclass (`KvxFullAttentionSpec`, `KvxSlidingWindowSpec`), defined once vLLM
    0.26-0.27 is importable. Each is managed as its vLLM base (vLLM's registry walks the MRO)."""
    from dataclasses import dataclass, replace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    def subclass(base: type) -> type:
        @dataclass(frozen=True, kw_only=True)
        class KvxSpec(base):
            """A layer whose page holds one block of a KVX format: `block_size * kvx_token_bytes` (K and V
            payload plus scales of all KV heads)."""

            kvx_token_bytes: int = 0

            @property
            def real_page_size_bytes(self) -> int:
                assert self.kvx_token_bytes > 0, f"{type(self).__name__} without its bytes per token"
                return self.block_size * self.kvx_token_bytes

            @classmethod
            def merge(cls, specs):
                merged = super().merge(specs)
                if len({s.kvx_token_bytes for s in specs}) != 1:
                    raise ValueError("KVX: the layers of one KV cache group need the same bytes per token")
                return replace(merged, kvx_token_bytes=specs[0].kvx_token_bytes)

        KvxSpec.__name__ = KvxSpec.__qualname__ = "Kvx" + base.__name__
        return KvxSpec

    return {base: subclass(base) for base in (FullAttentionSpec, SlidingWindowSpec)}


def __getattr__(name: str) -> type:
    """`kvx_vllm.spec026.KvxFullAttentionSpec` / `KvxSlidingWindowSpec` by name, defined on first lookup: vLLM's
    multiprocess executor (every TP > 1 run) pickles each worker's KV-cache specs to the engine core, and pickle
    finds a class by its module and name; without this lookup the workers' replies fail to pickle and the engine
    core waits for them until it times out (seen with vLLM 0.26 at TP=2 on two H200s)."""
    if name.startswith("Kvx") and name.endswith("Spec"):  # the names `spec_classes` gives; vLLM imported then
        for cls in spec_classes().values():
            if cls.__name__ == name:
                return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
