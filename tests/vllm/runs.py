"""Offline vLLM runs of the tests: runner scripts (`vllm_*_run.py`) that print one `KVX_RESULT <json>` line."""
from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

from ..procs import JOBS, run, run_many

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


ROOT = Path(__file__).resolve().parents[2]


def root_on_path(env: dict[str, str]) -> str:
    """`env`'s PYTHONPATH with the repository root first: runners that hand vLLM's workers a probe by module name
    (`tests.vllm....`) need it importable in every worker process."""
    return os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))


def jobs() -> int:
    """Independent vLLM runs at once: `JOBS` on CPU (a SmolLM2 run is mostly single-threaded, the second core takes
    the other run), one on a GPU (a vLLM run there takes most of its memory)."""
    return 1 if torch.cuda.is_available() else JOBS


def threads() -> int:
    """OpenMP threads per vLLM run: the cores shared among the `jobs()` runs at once. Two SmolLM2 runs at once with 2
    threads each on 2 cores took 90 s apiece, with 1 thread 22 s (measured 2026-11-28: OpenMP threads spin at their
    barriers, so oversubscribed cores make every run wait on the other's)."""
    return max(1, (os.cpu_count() or 1) // jobs())


ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(threads()),
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""The offline runs' environment: 1 GiB of CPU KV cache, `threads()` OpenMP threads, engine core in the runner's
process (its hooks see the engine)."""


def results(cmds: dict[K, list], env: dict[str, str]) -> dict[K, dict]:
    """Each named runner command's parsed result. The runs are independent processes, `jobs()` at a time (started
    in `cmds`' order: the longest first keeps both cores busy to the end); a failed run fails the caller with its
    name and the tail of its output."""
    return {name: parse(name, p.returncode, p.stdout, p.stderr)
            for name, p in zip(cmds, run_many(list(cmds.values()), jobs=jobs(), env=env), strict=True)}


def batched(runs: dict[K, list], runner: Path, env: dict[str, str]) -> dict[K, dict]:
    """Each named run's result (`runs`: name -> its runner arguments, in order, the longest first), the runs dealt
    in turn to `jobs()` runner processes that do theirs one after another (`runner --runs`): each process imports
    vLLM once, not once per run; a failed run fails the caller with its process's runs' names and output."""
    lanes = [tuple(list(runs)[i::jobs()]) for i in range(jobs())]
    cmds = {lane: [sys.executable, str(runner), "--runs", json.dumps([runs[name] for name in lane])]
            for lane in lanes if lane}
    out = {name: r for lane, rs in results(cmds, env).items() for name, r in zip(lane, rs, strict=True)}
    return {name: out[name] for name in runs}


def started(cmds: dict[K, list], env: dict[str, str], pool: ThreadPoolExecutor) -> dict[K, Future[dict]]:
    """Each named runner command submitted to `pool` (`jobs()` workers; in `cmds`' order): its parsed result's
    future (failing as `results` does), so a test takes a finished run's result and checks it while later runs
    still go."""
    def one(name: K, cmd: list) -> dict:
        p = run(cmd, env=env)
        return parse(name, p.returncode, p.stdout, p.stderr)

    return {name: pool.submit(one, name, cmd) for name, cmd in cmds.items()}


def each(calls: dict[K, Callable[[], T]]) -> dict[K, T]:
    """Each independent call's result, `jobs()` at a time (started in `calls`' order): e.g. chains of vLLM runs
    that hand KV to each other in turn, one chain per store; the first failure fails the caller."""
    with ThreadPoolExecutor(jobs()) as pool:
        return dict(zip(calls, pool.map(lambda call: call(), calls.values()), strict=True))


def requested(request, names: Iterable[str]) -> list[str]:
    """Those of the module fixtures `names` that a selected test of the requesting module uses: a fixture that
    starts several fixtures' runs at once starts only those the selected tests need (`-k`, one test id)."""
    used = {name for item in request.session.items if item.module is request.module for name in item.fixturenames}
    return [name for name in names if name in used]


def parse(name: str, returncode: int, stdout: str, stderr: str = "") -> dict:
    """A finished runner's `KVX_RESULT` JSON; a failed run fails the caller with its name and its output's tail."""
    m = re.search(r"^KVX_RESULT (.*)$", stdout, re.M)
    assert returncode == 0 and m, f"vLLM run {name} failed:\n{(stdout + stderr)[-4000:]}"
    return json.loads(m.group(1))
