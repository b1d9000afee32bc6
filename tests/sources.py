"""Where the KVX packages' source files are, for tests that read them (not import them).

The checkout holds them; the wheel stage (scripts/test_wheels.sh) runs the tests from a copy of the repository
without them, so there the installed copies are read instead: the same tests check what the wheels ship.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

#: Each package and where the checkout holds it.
PACKAGES = {
    "kvx_core": "kvx_core",
    "kvx_adapters": "kvx_adapters",
    "kvx_cli": "kvx_cli",
    "kvx_demo": "kvx_demo",
    "kvx_vllm": "plugins/kvx_vllm/kvx_vllm",
    "kvx_tgi": "plugins/kvx_tgi/kvx_tgi",
    "kvx_trtllm": "plugins/kvx_trtllm/kvx_trtllm",
}


def package_dirs(root: Path) -> dict[str, Path]:
    """Package name -> its directory: the checkout's under `root`, else the installed one. A package found in
    neither fails the calling test (a scan over nothing would pass without checking anything)."""
    out = {}
    for name, rel in PACKAGES.items():
        where = root / rel
        if not where.is_dir():
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.submodule_search_locations, f"{name}: not in {root}, not installed"
            where = Path(next(iter(spec.submodule_search_locations)))
        out[name] = where
    return out
