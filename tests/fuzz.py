"""Fuzzing the readers of outside bytes (bundles, KVTC buffers, calibration files, tickets) under a memory cap.

A reader of forged bytes may only return or raise `KvxError`: anything else (a `ValueError`, a `RecursionError`,
an `OverflowError`, an allocation the memory cap refuses, a hang) is a finding. `run_capped` runs a target
function many times in a subprocess whose address space is capped (`RLIMIT_AS`) at what the interpreter holds once
torch, KVX and the target's module are imported plus `HEADROOM_BYTES` (512 MiB; the imports take ~0.5 GiB with a CPU
torch, several GiB of reservations with a CUDA one), so a reader that believes a forged size and allocates half a GiB
fails here, as it would crash a server; it reports the first case that escaped with its traceback and the seed
that reproduces it.

A target is a module-level function `target(rng: random.Random) -> None` in an importable module: it builds one
forged input (usually a `mutate_bytes` / `mutate_json` of a valid one) and calls the reader; `KvxError` is caught by
the runner. Cases use the seeds `seed .. seed + cases - 1`; run one by hand:
`python -m tests.fuzz MODULE:FUNC SEED 1 0`.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import struct
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADROOM_BYTES = 1 << 29  # address space a run may take beyond its imports
THREAD_ENV = {"MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
"""The child's allocator and thread settings: the cap measures what a reader allocates, not what threads reserve.
Each thread started after the cap (torch's intra-op pool, the bundle hash pool: one per core up to 16) would get
its own 64 MiB glibc arena reservation, so on a 16-core machine the pools alone passed the 512 MiB headroom
("can't start new thread", MemoryError in zlib) where a 2-core machine passed."""
TIMEOUT_S = 900  # a hang, not a slow machine: 300 cases of the slowest reader take ~20 s on 2 idle cores

# values that break readers that trust a field: sizes near the limits of every integer width, non-finite and
# non-integer numbers, wrong types, huge strings
EXTREME_JSON = [0, -1, 1, 2, 3, 7, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 + 5,
                -(2**63) - 1, 10**30, 1.5, -0.0, 1e308, math.nan, math.inf, -math.inf, True, False, None, "",
                "x" * 4096, "float32", "nvfp4", [], [0], [-1, 2**40], {}, {"a": 1}]
EXTREME_INTS = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFFFFFFFFFFFFFF,
                0xFFFFFFFFFFFFFFFF]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """One to three random damages of `data`: bit flips, truncation, appended or inserted bytes, a slice
    duplicated, or an aligned integer field overwritten with an extreme value (little-endian u16/u32/u64)."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        n = len(out)
        if op == 0 and n:
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(n)
                out[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            del out[rng.randrange(n):]
        elif op == 2:
            out += rng.randbytes(rng.randint(1, 64))
        elif op == 3:
            i = rng.randint(0, n)
            out[i:i] = rng.randbytes(rng.randint(1, 64))
        elif op == 4 and n:
            i = rng.randrange(n)
            j = min(n, i + rng.randint(1, 256))
            out[j:j] = out[i:j]
        elif n >= 8:
            width, fmt = rng.choice([(2, "<H"), (4, "<I"), (8, "<Q")])
            i = rng.randrange(0, max(1, n - width)) & ~(width - 1)
            value = rng.choice(EXTREME_INTS) & ((1 << (8 * width)) - 1)
            out[i:i + width] = struct.pack(fmt, value)
    return bytes(out)


def _leaves(obj, path=()):
    """(path, value) of every value in a JSON tree, containers included."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))


DEEP = "\x00kvx-fuzz-deep\x00"
"""Stands for a 100k-deep nesting of lists in a tree (`dumps_json` writes it out): Python cannot hold one."""
_DEEP_JSON = json.dumps(DEEP)
_DEEP_TEXT = "[" * 100_000 + "]" * 100_000


def _extreme(rng: random.Random):
    """A copy of one of `EXTREME_JSON` (a later mutation in the same tree must not grow the shared list or dict, which
    would leak into every later case and, appended into itself, nest without end)."""
    return copy.deepcopy(rng.choice(EXTREME_JSON))


def mutate_json(obj, rng: random.Random):
    """A copy of the JSON tree `obj` with one to three values replaced by extreme ones (`EXTREME_JSON`, a
    100k-deep nesting, a neighbour's value), a key deleted, or a key added."""
    obj = json.loads(json.dumps(obj))
    for _ in range(rng.randint(1, 3)):
        spots = list(_leaves(obj))
        path, _ = rng.choice(spots)
        op = rng.randrange(5)
        if op == 0:
            new = _extreme(rng)
        elif op == 1:
            new = DEEP
        elif op == 2:
            new = json.loads(json.dumps(rng.choice(spots)[1]))  # a copy: an ancestor would make a cycle
        else:
            new = None
        if not path:
            if op < 3:
                obj = new
            continue
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        if op == 3:
            del parent[key]
        elif op == 4:
            if isinstance(parent, dict):
                parent[f"extra{rng.randrange(100)}"] = _extreme(rng)
            else:
                parent.append(_extreme(rng))
        else:
            parent[key] = new
    return obj


def dumps_json(obj) -> bytes:
    """JSON bytes of a forged tree: NaN / Infinity are written the way Python writes them (not standard JSON: a
    reader must refuse them), and each `DEEP` as a 100k-deep nesting."""
    return json.dumps(obj, allow_nan=True).replace(_DEEP_JSON, _DEEP_TEXT).encode()


def run_capped(target: str, *, cases: int = 300, seed: int = 0, headroom_bytes: int = HEADROOM_BYTES,
               env: dict | None = None) -> None:
    """Run `target` ("package.module:function") `cases` times in a fresh interpreter under an address-space cap
    (`headroom_bytes` above its imports);
    fail (AssertionError) with the case's seed and traceback if one raised anything but `KvxError`, and with the
    reason if the process died (memory, signal) or hung past `TIMEOUT_S`."""
    cmd = [sys.executable, "-m", "tests.fuzz", target, str(seed), str(cases), str(headroom_bytes)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                           env={**os.environ, **THREAD_ENV, **(env or {})})
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{target}: {cases} fuzz cases did not finish in {TIMEOUT_S} s (a reader hangs?); "
                             f"last output: {(e.stdout or '')[-2000:]}") from None
    assert p.returncode == 0, (f"{target} (seed {seed}) exited {p.returncode} with {headroom_bytes >> 20} MiB "
                               f"of address space above its imports:\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}")


def _address_space() -> int:
    """Bytes of address space this process holds now (VmSize)."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    return kib << 10


def _main(target: str, seed: int, cases: int, headroom_bytes: int) -> int:
    import importlib

    import torch  # noqa: F401 - imported before the cap is measured

    from kvx_core.errors import KvxError

    module, func = target.split(":")
    fn = getattr(importlib.import_module(module), func)
    if headroom_bytes:
        import resource
        cap = _address_space() + headroom_bytes
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    refused = 0
    for case in range(cases):
        case_seed = seed + case
        try:
            fn(random.Random(case_seed))
        except KvxError:
            refused += 1
        except BaseException:  # noqa: BLE001 - everything else is the finding
            print(f"case seed {case_seed} (reproduce: python -m tests.fuzz {target} {case_seed} 1 0) raised:")
            traceback.print_exc(file=sys.stdout)
            return 1
    print(f"{target}: {cases} cases, {refused} refused with KvxError, {cases - refused} accepted")
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(_main(a[0], int(a[1]), int(a[2]), int(a[3]) if len(a) > 3 else HEADROOM_BYTES))
