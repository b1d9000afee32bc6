"""What a `pip install` of the built wheels puts on a machine (runs in `scripts/test_wheels.sh`, KVX_INSTALLED_WHEEL=1).

The CPU half of "a wheel-installed KVX needs no CUDA toolkit": the packages are imported from site-packages (not a
source tree), the kvx wheel carries the CUDA sources and a prebuilt kernel library built from exactly those sources
for sm_90a, the library loads without a GPU or toolkit and its parameter structs match the ctypes mirrors, and
`kvx doctor` reports it. The GPU half (the library serving decode / write and vLLM) is `tests/core/test_gpu.py` and
`scripts/vllm_serve_check.sh` run from the wheels on the GPU machine (benchmarks/results/wheel_install_h100.log).
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sources import PACKAGES

pytestmark = pytest.mark.skipif(os.environ.get("KVX_INSTALLED_WHEEL") != "1",
                                reason="checks an installed wheel: run by scripts/test_wheels.sh")


def test_packages_come_from_installed_wheels():
    """Each package (all of tests/sources.py's) sits beside its wheel's .dist-info (site-packages or a pip --target
    folder), outside the checkout the tests run from: the suite checks the installed code, which CI runs it against
    instead of the source tree (scripts/run_tests.sh)."""
    checkout = Path(__file__).resolve().parents[1]
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
        where = Path(next(iter(spec.submodule_search_locations))).resolve().parent
        assert checkout not in where.parents and where != checkout, f"{name} from the checkout {where}"
        dist = name if name in ("kvx_vllm", "kvx_tgi", "kvx_trtllm") else "kvx"
        assert list(where.glob(f"{dist}-*.dist-info")), f"{name} at {where}: no {dist} .dist-info beside it"


def test_wheel_ships_sources_and_a_prebuilt_library_built_from_them():
    from kvx_core.ops.cuda import prebuilt_manifest, toolchain

    assert all(s.is_file() for s in toolchain.SOURCES)
    m = prebuilt_manifest()
    assert m is not None, "the kvx wheel has no prebuilt CUDA kernels (built without nvcc?)"
    assert m["sources_sha256"] == toolchain.sources_digest()
    assert "90a" in m["sass"] and m["ptx"] and m["cuda"]
    assert (toolchain.PREBUILT_DIR / m["library"]).is_file()


def test_prebuilt_library_loads_without_gpu_and_matches_the_mirrors():
    from kvx_core.ops.cuda import mirror_mismatch, toolchain
    from kvx_core.ops.cuda.decode import DecodeParams
    from kvx_core.ops.cuda.write import WriteParams

    lib = ctypes.CDLL(str(toolchain.PREBUILT_DIR / toolchain.PREBUILT_LIBRARY))
    assert mirror_mismatch(lib, "kvx_decode_params_size", DecodeParams, "kvx_decode_params_layout") is None
    assert lib.kvx_write_params_size() == ctypes.sizeof(WriteParams)


def test_doctor_reports_the_prebuilt_kernels():
    p = subprocess.run([sys.executable, "-m", "kvx_cli.main", "doctor", "--json", "--formats", "nvfp4"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["prebuilt"]["sass"] and info["versions"]["kvx"]


@pytest.mark.gpu
def test_prebuilt_library_serves_this_gpu_without_a_toolkit():
    """On a Hopper / Ada GPU with a CUDA 13 driver and no nvcc: the wheel's library serves decode and write, and
    nothing is compiled (`$KVX_CUDA_CACHE` stays empty)."""
    import torch

    from kvx_core.ops import backends
    from kvx_core.ops.cuda import cache_dir, library_source, nvcc_path

    assert nvcc_path() is None, "run with no nvcc reachable (scripts/gpu_wheel_check.sh hides it)"
    src = library_source(torch.device("cuda"))
    assert src.origin == "prebuilt", src.detail
    rows = {s.op: s for s in backends.serving("nvfp4", "cuda")}
    assert rows["decode"].kernel == "cuda" and rows["write"].kernel == "cuda", rows
    assert not any(cache_dir().glob("*.so")), f"something was built into {cache_dir()}"
