"""`benchmarks/bench_nixl.py` end to end: two processes hand bundles over through NIXL and the consumer's imported
rows equal those of a cache built the producer's way but never transferred (the oracle), bit for bit. On CPU: host
memory over UCX TCP loopback, tiny sizes; on the GPU machine (`gpu`): device memory from cuda:0 to cuda:1."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

try:
    import nixl  # noqa: F401
except ImportError:
    if os.environ.get("CI"):  # scripts/setup_env.sh installs it: missing in CI is a failure, not a skip
        raise
    pytest.skip("NIXL not installed: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1", allow_module_level=True)

from ..procs import run  # noqa: E402
from .test_nixl import LOOPBACK_TLS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_nixl import rows_digest  # noqa: E402
from bench_transfer import _filled  # noqa: E402

FIELDS = {"bench", "memory", "format", "tokens", "layers", "bundle_bytes", "read_gbps", "read_ms", "import_gbps",
          "request_ms", "d2d_gbps", "read_x_d2d", "import_x_d2d", "imported_xxh64", "bit_exact", "producer",
          "consumer", "ucx_tls", "commit", "torch"}


def _bench(tmp_path, *args: str, env: dict | None = None) -> list[dict]:
    out = tmp_path / "nixl.jsonl"
    p = run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_nixl.py"), *args, "--out", str(out)],
            cwd=ROOT, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def _oracle(fmt: str, tokens: int, layers: int, device: str) -> str:
    """The digest of the producer's rows, from a cache filled the same way here (never exported)."""
    cache = _filled(fmt, SimpleNamespace(tokens=tokens, layers=layers, device=device), torch.Generator().manual_seed(0))
    return rows_digest(cache, tokens)


def test_host_memory_between_two_processes_imports_bit_for_bit(tmp_path):
    recs = _bench(tmp_path, "--format", "nvfp4,bf16", "--tokens", "40", "--layers", "2", "--runs", "1",
                  "--memory", "host", "--ucx-tls", LOOPBACK_TLS, env={"UCX_NET_DEVICES": "lo"})
    assert [(r["format"], r["memory"]) for r in recs] == [("nvfp4", "host"), ("bf16", "host")]
    for r in recs:
        assert FIELDS <= r.keys() and r["bench"] == "nixl" and r["ucx_tls"] == LOOPBACK_TLS
        assert r["bit_exact"] and r["imported_xxh64"] == _oracle(r["format"], 40, 2, "cpu")
        assert r["bundle_bytes"] > 0 and r["read_ms"] > 0 and r["request_ms"] > 0


@pytest.mark.gpu
@pytest.mark.multigpu
def test_device_memory_from_cuda0_to_cuda1_imports_bit_for_bit(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
    recs = _bench(tmp_path, "--format", "nvfp4,bf16", "--tokens", "1024", "--layers", "4", "--runs", "2",
                  "--memory", "device", "--devices", "0,1")
    assert [(r["format"], r["memory"]) for r in recs] == [("nvfp4", "device"), ("bf16", "device")]
    for r in recs:
        assert FIELDS <= r.keys() and (r["producer"], r["consumer"]) == ("cuda:0", "cuda:1")
        assert r["bit_exact"] and r["imported_xxh64"] == _oracle(r["format"], 1024, 4, "cuda:0")
        assert r["d2d_gbps"] > 0 and r["read_x_d2d"] > 0
