"""The benchmarks' one-process-per-setting runner (`benchmarks/common.run_group`): a run past its limit takes every
process it started with it, so the next setting starts on a free GPU (vLLM's engine core, a grandchild, outlived a
plain kill and held the GPU's memory: every later dtype of that bench run failed at startup)."""
from __future__ import annotations

import os
import sys
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from common import run_group  # noqa: E402


def _alive(pid: int) -> bool:
    """Running, not a zombie: where nothing reaps orphans (a container's PID 1 may not), a killed one stays a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_run_past_its_limit_is_killed_with_its_grandchild(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(120)
    """))
    t = time.monotonic()
    assert run_group([sys.executable, str(script)], timeout_s=5) == "timeout"
    assert time.monotonic() - t < 60
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the grandchild outlived its run's timeout"


def test_exit_codes_pass_through():
    assert run_group([sys.executable, "-c", "raise SystemExit(3)"], timeout_s=60) == 3
    assert run_group([sys.executable, "-c", "pass"], timeout_s=60) == 0
