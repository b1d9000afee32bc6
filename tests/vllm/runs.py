"""Offline vLLM runs of the tests: runner scripts (`vllm_*_run.py`) that print one `KVX_RESULT <json>` line."""
from __future__ import annotations

import json
import re

import torch

from ..procs import JOBS, run_many


def results(cmds: dict[str, list], env: dict[str, str]) -> dict[str, dict]:
    """Each named runner command's parsed result. The runs are independent processes, run two at a time on CPU
    (`run_many`: a SmolLM2 run is mostly single-threaded, the second core takes the other run) and one at a time
    on a GPU (a vLLM run there takes most of its memory); a failed run fails the caller with its name and the
    tail of its output."""
    jobs = 1 if torch.cuda.is_available() else JOBS
    return {name: parse(name, p.returncode, p.stdout, p.stderr)
            for name, p in zip(cmds, run_many(list(cmds.values()), jobs=jobs, env=env), strict=True)}


def parse(name: str, returncode: int, stdout: str, stderr: str = "") -> dict:
    """A finished runner's `KVX_RESULT` JSON; a failed run fails the caller with its name and its output's tail."""
    m = re.search(r"^KVX_RESULT (.*)$", stdout, re.M)
    assert returncode == 0 and m, f"vLLM run {name} failed:\n{(stdout + stderr)[-4000:]}"
    return json.loads(m.group(1))
