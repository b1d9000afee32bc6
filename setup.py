"""Build hooks of the `kvx` wheel: the CUDA kernels are compiled here, where the wheel is built, and ship inside it.

Why: a machine where `pip install vllm` works has no CUDA toolkit as a rule (torch and vLLM bring their own CUDA
libraries), so kernels compiled at first use would silently not exist there. `build_py` runs nvcc once
(`kvx_core/ops/cuda/toolchain.py`: SASS for sm_89 and sm_90a, PTX for newer GPUs, the CUDA runtime linked
statically) into `kvx_core/ops/cuda/prebuilt/` with a manifest, and the wheel is tagged for the platform.

`KVX_BUILD_CUDA`: `auto` (default) builds when nvcc is found and otherwise makes a pure-Python wheel (its kernels
are then built at first use where nvcc exists, else Triton serves; `kvx doctor` says which); `1` requires nvcc (CI
and release builds); `0` never builds. Editable installs never build (the source tree builds at first use).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _toolchain():
    spec = importlib.util.spec_from_file_location("kvx_cuda_toolchain", HERE / "kvx_core/ops/cuda/toolchain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _cuda_nvcc() -> str | None:
    """The nvcc that builds the wheel's kernels, None when this build makes a pure-Python wheel."""
    mode = os.environ.get("KVX_BUILD_CUDA", "auto")
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"KVX_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return None
    nvcc = _toolchain().nvcc_path()
    if nvcc is None and mode == "1":
        raise SystemExit("KVX_BUILD_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    if nvcc is None:
        print("warning: nvcc not found: building a kvx wheel without prebuilt CUDA kernels")
    return nvcc


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        nvcc = None if self.editable_mode else _cuda_nvcc()
        if nvcc is not None:
            tc = _toolchain()
            out = Path(self.build_lib) / "kvx_core" / "ops" / "cuda" / "prebuilt"
            print(f"building the KVX CUDA kernels with {nvcc} (SASS {', '.join(tc.WHEEL_SASS)}, PTX {tc.WHEEL_PTX})")
            tc.build_prebuilt(out, nvcc)


class KvxDistribution(Distribution):
    """With prebuilt kernels the distribution is binary: installed into platlib, its wheel tagged for the platform."""

    def has_ext_modules(self) -> bool:
        return _cuda_nvcc() is not None


class PlatformWheel(bdist_wheel):
    """A wheel holding the prebuilt library is for this platform and any Python 3 (the library links no Python)."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        return ("py3", "none", plat) if not self.root_is_pure else (python, abi, plat)


setup(distclass=KvxDistribution, cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})
