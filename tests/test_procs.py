"""tests/procs.py: a subprocess past its timeout fails the test naming what ran, how long, and its last output."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from .procs import HANG_S, JOBS, communicate, run, run_many, wait

SLOW = "import time; print('started', flush=True); time.sleep(60)"


def test_timeouts_are_for_hangs():
    assert HANG_S >= 1800


def test_run_names_the_command_its_time_and_output():
    assert run([sys.executable, "-c", "print('ok')"]).stdout == "ok\n"
    with pytest.raises(AssertionError) as e:
        run([sys.executable, "-c", SLOW], timeout=1)
    msg = str(e.value)
    assert "time.sleep(60)" in msg and "still running after" in msg and "last output:" in msg


def test_communicate_and_wait_kill_the_process_and_show_its_output(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", SLOW], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with pytest.raises(AssertionError, match=r"the sleeper: still running after \d+ s"):
        communicate(p, "the sleeper", timeout=1)
    assert p.poll() is not None  # killed, not left behind
    log = tmp_path / "log"
    with log.open("w") as f:
        p = subprocess.Popen([sys.executable, "-c", SLOW], stdout=f, stderr=subprocess.STDOUT)
    while "started" not in log.read_text():  # the output the message must show is there (however slow the start)
        time.sleep(0.05)
    with pytest.raises(AssertionError, match=r"the server: still running after \d+ s[\s\S]*started"):
        wait(p, "the server", log, timeout=1)
    assert p.wait() != 0


# each waits (up to 60 s) for the other's file: passes only if the two run at the same time
MEET = ("import pathlib, sys, time; d = pathlib.Path(sys.argv[1]); (d / sys.argv[2]).touch(); end = time.time() + 60\n"
        "while not (d / sys.argv[3]).exists() and time.time() < end: time.sleep(0.05)\n"
        "print(sys.argv[2], (d / sys.argv[3]).exists())")


def test_run_many_runs_two_at_once_and_keeps_the_order(tmp_path):
    assert JOBS == 2
    out = run_many([[sys.executable, "-c", MEET, str(tmp_path), a, b] for a, b in (("a", "b"), ("b", "a"))])
    assert [p.stdout for p in out] == ["a True\n", "b True\n"]
    failed = run_many([[sys.executable, "-c", "raise SystemExit(3)"], [sys.executable, "-c", "print(1)"]])
    assert [p.returncode for p in failed] == [3, 0]  # a failed run comes back to its caller's check


def test_run_many_fails_like_run_on_a_hang():
    with pytest.raises(AssertionError, match="still running after"):
        run_many([[sys.executable, "-c", "print(1)"], [sys.executable, "-c", SLOW]], timeout=1)
