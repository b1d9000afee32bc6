"""Shared benchmark helpers: L2-flushed event timing (median), copy-bandwidth probe, JSON-lines output."""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import time
from functools import partial

import torch

from kvx_core.ops.graphs import capture

_FLUSH = None


def _flush_buf():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB > 50/60 MB L2
    return _FLUSH


def bench(fn, n: int = 50, warmup: int = 5) -> dict:
    """Median / min / p90 ms of `fn()` over `n` runs, L2 flushed before each (the flush also gives the
    host a head start, so launch overhead of a Python launcher is not timed unless it exceeds it)."""
    buf = _flush_buf()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        buf.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    return {"ms": statistics.median(ts), "ms_min": ts[0], "ms_p90": ts[int(0.9 * (len(ts) - 1))], "runs": n}


def bench_graph(fn, n: int = 50) -> dict | None:
    """Like `bench` but replays a CUDA graph of `fn` (no host overhead at all); None if capture fails."""
    try:
        fn()
        torch.cuda.synchronize()
        g, _ = capture(fn)
        return bench(g.replay, n=n)
    except Exception as e:  # noqa: BLE001
        print("graph capture failed:", repr(e)[:200])
        return None


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy GB/s counting bytes read + written (the workplace's ceiling probe)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.random_(0, 255)
    y = torch.empty_like(x)
    r = bench(partial(y.copy_, x), n=20, warmup=3)
    del x, y
    return 2 * nbytes / (r["ms"] * 1e-3) / 1e9


def env_info() -> dict:
    """What every JSON line records: the GPU (None on a CPU-only machine, with the CPU threads), torch / triton /
    flashinfer versions, the commit and the time."""
    # KVX_COMMIT: the commit of a copied working tree whose .git is not the source's (the GPU machine's copy)
    commit = os.environ.get("KVX_COMMIT")
    try:
        commit = commit or subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                         stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        commit = "unknown"
    if not torch.cuda.is_available():
        return {"gpu": None, "cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "commit": commit,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    p = torch.cuda.get_device_properties(0)
    import triton
    info = {"gpu": p.name, "sms": p.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        import flashinfer
        info["flashinfer"] = flashinfer.__version__
    except Exception:  # noqa: BLE001
        info["flashinfer"] = None
    return info


def time_calls(owner: type, name: str, record, sync: bool = False) -> None:
    """Replace method `name` of class `owner` by a wrapper passing each call's wall seconds to `record(seconds)`;
    with `sync`, the device's queued work is waited for before the call (it is not the call's) and after it (the
    call's device work is)."""
    fn = getattr(owner, name)
    sync = sync and torch.cuda.is_available()

    def timed(*args, **kwargs):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if sync:
                torch.cuda.synchronize()
            record(time.perf_counter() - t)

    setattr(owner, name, timed)


def top_functions(profile: cProfile.Profile, top: int) -> list[list]:
    """The `top` functions of a cProfile run by own time: `[file:line(function), own us, calls]`."""
    own = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])[:top]  # (file, line, name): stats
    return [[f"{os.path.basename(f)}:{line}({name})", round(st[2] * 1e6, 1), st[1]] for (f, line, name), st in own]


def emit(path: str | None, rec: dict) -> None:
    line = json.dumps(rec, sort_keys=True)
    print(line, flush=True)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")


def run_group(cmd: list[str], timeout_s: float) -> int | str:
    """Exit code of `cmd`, or "timeout" once it and every process it started (its process group) are killed."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout"


def run_per_process(script: str, names: list[str], args: list[str], out: str | None, timeout_s: int) -> None:
    """`script --one NAME ARGS [--out OUT]` for each name, one process each (an engine setting gets a fresh process
    and GPU memory); exits naming the ones that failed or ran past `timeout_s`.

    Each child leads its own process group, and one past its limit is killed with the whole group: vLLM's engine core
    is a grandchild that outlived its parent's kill and held 118 GiB of the GPU, so every later dtype of the run
    failed vLLM's free-memory check at startup (H200, 2026-11-28)."""
    failed = []
    for name in names:
        cmd = [sys.executable, script, "--one", name, *args] + (["--out", out] if out else [])
        t = time.perf_counter()
        rc = run_group(cmd, timeout_s)
        print(f"# {name}: exit {rc} in {time.perf_counter() - t:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        sys.exit(f"{os.path.basename(script)}: failed for {', '.join(failed)}")
