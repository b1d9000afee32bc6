"""Subprocesses that tests start: their timeouts catch hangs, not slow machines.

A timeout sized for a quiet machine fails tests on a busy one: the README's test command, run while other jobs
shared its 2 cores, ended with 25 vLLM tests in error, each `vllm_run.py` past its fixed 300 s (the same tests pass
in 9:42 in all when the machine is quiet). So every subprocess and every wait for a server gets `HANG_S`, and a
timeout fails the test naming what ran, how long it ran and its last output lines.
"""
from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HANG_S = 1800
"""A hang, not a slow machine: 3x the largest fixed limit the tests had (600 s, a vLLM CPU run with preemption) and
6x the 300 s that 25 vLLM runs overran on a shared machine."""


def _tail(*outputs: str | bytes | None, chars: int = 4000) -> str:
    text = "".join(o.decode(errors="replace") if isinstance(o, bytes) else (o or "") for o in outputs)
    return text[-chars:] or "(none)"


def hung(what: str, seconds: float, *outputs: str | bytes | None) -> str:
    """The failure message of a subprocess (or server) still running past its timeout."""
    return (f"{what}: still running after {seconds:.0f} s (timeout {HANG_S} s, meant for a hang, not a slow "
            f"machine); last output:\n{_tail(*outputs)}")


def _name(cmd: list) -> str:
    text = " ".join(map(str, cmd))
    return text if len(text) <= 300 else text[:300] + " ..."


def run(cmd: list, *, timeout: float = HANG_S, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, **kwargs)`; past `timeout` the process is killed and
    the test fails with `hung`'s message instead of a bare `TimeoutExpired`."""
    start = time.monotonic()
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(hung(_name(cmd), time.monotonic() - start, e.stdout, e.stderr)) from None


JOBS = 2
"""Subprocesses `run_many` runs at once: CI's 2 cores. A vLLM CPU run spends a large part of its time in
single-threaded work (imports, engine start-up, Python between steps) that a second run's compute overlaps."""


def run_many(cmds: list[list], *, jobs: int = JOBS, **kwargs) -> list[subprocess.CompletedProcess]:
    """`run(cmd, **kwargs)` for independent commands, at most `jobs` at a time; the results in `cmds`' order."""
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda cmd: run(cmd, **kwargs), cmds))


def wait(proc: subprocess.Popen, what: str, log: Path | None = None, timeout: float = HANG_S) -> int:
    """`proc.wait()` for a process writing to `log`; past `timeout` it is killed and the test fails with `hung`'s
    message and the log's last lines."""
    start = time.monotonic()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(hung(what, time.monotonic() - start, log.read_text(errors="replace") if log else None)
                             ) from None


def communicate(proc: subprocess.Popen, what: str, input: str | None = None,
                timeout: float = HANG_S) -> tuple[str | None, str | None]:
    """`proc.communicate(input)`; past `timeout` the process is killed and the test fails with `hung`'s message."""
    start = time.monotonic()
    try:
        return proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(hung(what, time.monotonic() - start, out, err)) from None
