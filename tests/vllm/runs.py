"""Offline vLLM runs of the tests: runner scripts (`vllm_*_run.py`) that print one `KVX_RESULT <json>` line."""
from __future__ import annotations

import json
import re

from ..procs import run_many


def results(cmds: dict[str, list], env: dict[str, str]) -> dict[str, dict]:
    """Each named runner command's parsed result. The runs are independent processes, run two at a time
    (`run_many`: one run's compute overlaps the other's single-threaded start-up); a failed run fails the
    caller with its name and the tail of its output."""
    out = {}
    for name, p in zip(cmds, run_many(list(cmds.values()), env=env), strict=True):
        m = re.search(r"^KVX_RESULT (.*)$", p.stdout, re.M)
        assert p.returncode == 0 and m, f"vLLM run {name} failed:\n{(p.stdout + p.stderr)[-4000:]}"
        out[name] = json.loads(m.group(1))
    return out
