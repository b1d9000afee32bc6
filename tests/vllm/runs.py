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
    out = {}
    for name, p in zip(cmds, run_many(list(cmds.values()), jobs=jobs, env=env), strict=True):
        m = re.search(r"^KVX_RESULT (.*)$", p.stdout, re.M)
        assert p.returncode == 0 and m, f"vLLM run {name} failed:\n{(p.stdout + p.stderr)[-4000:]}"
        out[name] = json.loads(m.group(1))
    return out
