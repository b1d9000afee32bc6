"""`kvx doctor` on this CPU machine: every format with the kernel serving decode / prefill / write and the reason it
is not the fastest one; bad options exit 2 with one line. (On a GPU:
benchmarks/results/wheel_install_no_toolkit_h200.log.)"""
from __future__ import annotations

import json

import pytest

from kvx_cli.main import main
from kvx_core.formats import list_formats


def test_doctor_json_lists_every_format_with_a_reason_off_cuda(capsys):
    assert main(["doctor", "--json", "--device", "cpu"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["formats"]) == set(list_formats())
    for name, rows in info["formats"].items():
        assert [r["op"] for r in rows] == ["decode", "prefill", "write"], name
        assert all(r["kernel"] == "torch" and r["reason"] == "no CUDA device" for r in rows), (name, rows)
    assert info["versions"]["torch"] and "prebuilt" in info and "driver_cuda" in info


def test_doctor_text_names_the_prebuilt_kernels_and_the_formats(capsys):
    assert main(["doctor", "--device", "cpu", "--formats", "nvfp4,k8v4"]) == 0
    out = capsys.readouterr().out
    assert "prebuilt CUDA kernels:" in out and "nvfp4" in out and "k8v4" in out and "int8 " not in out


@pytest.mark.parametrize("argv", [["--formats", "nvfp4,bogus"], ["--head-dim", "0"], ["--formats", ","]])
def test_doctor_refuses_bad_options_in_one_line(argv, capsys):
    assert main(["doctor", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "doctor" in err


def test_version_names_the_installed_kvx_and_the_abi(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    try:
        dist = importlib.metadata.version("kvx")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH (the GPU machine's suite)
        dist = "(not installed)"
    assert capsys.readouterr().out.strip() == f"kvx {dist}, KVX ABI 1.3.0"
