"""Where the CUDA kernel library comes from (`kvx_core.ops.cuda.locate`): prebuilt -> nvcc -> unavailable.

A wheel-installed KVX must serve a GPU with no CUDA toolkit when its prebuilt library covers the GPU and the driver,
and must say why not otherwise (never a raw FileNotFoundError from an engine). These tests drive the choice with
hand-made manifests and a fake driver version; the real library is loaded in tests/test_installed_wheel.py (CPU) and
on the GPU machine.
"""
from __future__ import annotations

import json

import pytest

from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format
from kvx_core.ops import cuda
from kvx_core.ops.cuda import toolchain
from kvx_core.ops.decode import choose_backend


def manifest(**kw) -> dict:
    m = {"library": toolchain.PREBUILT_LIBRARY, "sass": ["89", "90a"], "ptx": "89", "cuda": "13.0",
         "sources_sha256": toolchain.sources_digest(), "nvcc": "test"}
    return {**m, **kw}


@pytest.mark.parametrize("cap", [(9, 0), (8, 9), (10, 0), (12, 0)])
def test_prebuilt_serves_covered_gpus_on_a_new_enough_driver(cap):
    assert cuda.prebuilt_reason(manifest(), cap, (13, 0)) is None
    assert cuda.prebuilt_reason(manifest(), cap, (13, 2)) is None


@pytest.mark.parametrize("m, cap, driver, words", [
    (None, (9, 0), (13, 0), "ships no prebuilt kernels"),
    (manifest(sources_sha256="0" * 64), (9, 0), (13, 0), "other CUDA sources"),
    (manifest(sass=["90a"], ptx=None), (8, 9), (13, 0), "not sm_89"),
    (manifest(sass=["90a"], ptx="90"), (8, 9), (13, 0), "not sm_89"),
    (manifest(), (9, 0), (12, 8), "driver supporting CUDA 13.0"),
    (manifest(), (9, 0), None, "no NVIDIA driver"),
])
def test_prebuilt_refusal_says_why(m, cap, driver, words):
    why = cuda.prebuilt_reason(m, cap, driver)
    assert why is not None and words in why


def test_old_gpus_are_refused_before_any_library():
    with pytest.raises(KvxError) as e:
        cuda.prebuilt_reason(manifest(), (8, 0), (13, 0))
    assert e.value.status == Status.UNSUPPORTED


def _with_manifest(tmp_path, m: dict):
    (tmp_path / toolchain.MANIFEST).write_text(json.dumps(m))
    (tmp_path / toolchain.PREBUILT_LIBRARY).write_bytes(b"")
    return tmp_path


def test_locate_prefers_the_prebuilt_library(tmp_path, monkeypatch):
    d = _with_manifest(tmp_path, manifest())
    monkeypatch.setattr(cuda, "driver_cuda_version", lambda: (13, 0))
    monkeypatch.setattr(cuda, "build", lambda arch: pytest.fail("nvcc must not run when the prebuilt one serves"))
    src = cuda.locate((9, 0), manifest_dir=d)
    assert (src.origin, src.path, src.arch) == ("prebuilt", d / toolchain.PREBUILT_LIBRARY, "90a")


def test_locate_builds_with_nvcc_when_the_driver_is_older(tmp_path, monkeypatch):
    d = _with_manifest(tmp_path, manifest())
    monkeypatch.setattr(cuda, "driver_cuda_version", lambda: (12, 4))
    monkeypatch.setattr(cuda, "build", lambda arch: tmp_path / f"built-{arch}.so")
    src = cuda.locate((9, 0), manifest_dir=d)
    assert src.origin == "nvcc" and src.path == tmp_path / "built-90a.so"
    assert "driver supporting CUDA 12.4" in src.detail


def test_locate_without_prebuilt_or_nvcc_says_both_reasons(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda, "driver_cuda_version", lambda: (13, 0))
    monkeypatch.setattr(cuda, "nvcc_path", lambda: None)
    src = cuda.locate((9, 0), manifest_dir=tmp_path)
    assert src.origin == "unavailable" and src.path is None
    assert "ships no prebuilt kernels" in src.detail and "nvcc not found" in src.detail


def test_build_without_nvcc_is_unsupported(monkeypatch):
    monkeypatch.setattr(cuda, "nvcc_path", lambda: None)
    with pytest.raises(KvxError) as e:
        cuda.build("90a")
    assert e.value.status == Status.UNSUPPORTED and "CUDA_HOME" in e.value.message


def test_choose_falls_back_to_triton_with_the_reason_and_refuses_when_cuda_is_asked_for():
    def unavailable():
        raise KvxError(Status.UNSUPPORTED, "no KVX CUDA kernels for sm_90a: because")

    want = cuda.Choice("triton", "no KVX CUDA kernels for sm_90a: because")
    assert cuda.choose(None, "auto", unavailable, "decode") == want
    with pytest.raises(KvxError, match="head_dim 96"):  # asked for CUDA: refused, never a silent fallback
        cuda.choose("head_dim 96", "cuda", unavailable, "decode")
    assert cuda.choose(None, "auto", lambda: None, "decode") == cuda.Choice("cuda", None)


def test_decode_choice_off_cuda_names_the_reason():
    import torch

    c = choose_backend(None, get_format("nvfp4"), torch.bfloat16, torch.device("cpu"), 1, 8, 8, 128, 16, None)
    assert c.backend == "triton" and c.reason
    assert choose_backend("triton", get_format("nvfp4"), torch.bfloat16, torch.device("cpu"), 1, 8, 8, 128, 16,
                          None) == cuda.Choice("triton", None)


def test_locate_with_a_failing_nvcc_is_unavailable_with_nvccs_message(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda, "driver_cuda_version", lambda: (13, 0))

    def failing(arch):
        raise KvxError(Status.INTERNAL_ERROR, "nvcc failed (nvcc ...): error: unsupported gpu architecture")

    monkeypatch.setattr(cuda, "build", failing)
    src = cuda.locate((9, 0), manifest_dir=tmp_path)
    assert src.origin == "unavailable" and "unsupported gpu architecture" in src.detail


def test_locate_with_missing_sources_says_reinstall(tmp_path, monkeypatch):
    """The wheel of the first release shipped no .cu files: an engine died with FileNotFoundError. Now: a reason."""
    gone = tmp_path / "paged_decode_mma.cu"
    monkeypatch.setattr(toolchain, "SOURCES", (gone, toolchain.SOURCES[1]))
    monkeypatch.setattr(cuda, "build", lambda arch: pytest.fail("nothing to build from"))
    src = cuda.locate((9, 0), manifest_dir=tmp_path)
    assert src.origin == "unavailable" and "paged_decode_mma.cu" in src.detail and "reinstall" in src.detail


@pytest.mark.parametrize("text", ['{"sass": "90a"}', "[1]", "NaN", '{"sass": ["90a"], "ptx": "8x", "cuda": "13.0", '
                                  '"sources_sha256": "", "library": "l"}', "\xff"])
def test_a_damaged_manifest_is_a_reason_not_a_crash(tmp_path, monkeypatch, text):
    (tmp_path / toolchain.MANIFEST).write_bytes(text.encode("latin-1"))
    monkeypatch.setattr(cuda, "driver_cuda_version", lambda: (13, 0))
    monkeypatch.setattr(cuda, "nvcc_path", lambda: None)
    src = cuda.locate((9, 0), manifest_dir=tmp_path)
    assert src.origin == "unavailable" and "manifest" in src.detail, src.detail
