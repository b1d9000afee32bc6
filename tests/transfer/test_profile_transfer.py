"""`benchmarks/profile_transfer.py` (the GPU profile of a bundle export / import per layer, issue 36) runs on the CPU
end to end: one JSON line per pair and op with every field the GPU session reads, the CUDA ones empty here."""
from __future__ import annotations

import json
import os
import sys

from ..procs import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PER_OP = {"host_us_per_layer", "wall_us_per_layer", "untraced_host_us_per_layer", "top_host_ops", "top_python"}
CUDA_ONLY = {"gpu_kernel_us_per_layer", "kernels", "top_kernels", "launch_calls", "launches_per_layer", "memcpy",
             "host_alloc", "syncs"}


def test_profile_transfer_writes_a_line_per_pair_and_op_on_the_cpu(tmp_path):
    out = tmp_path / "profile.jsonl"
    p = run([sys.executable, os.path.join(ROOT, "benchmarks", "profile_transfer.py"), "--device", "cpu",
             "--tokens", "16", "--layers", "2", "--pairs", "bf16:bf16,nvfp4:nvfp4", "--runs", "1", "--top", "5",
             "--out", str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["src"], r["dst"], r["op"]) for r in recs] == [("bf16", "bf16", "export"), ("bf16", "bf16", "import"),
                                                           ("nvfp4", "nvfp4", "export"), ("nvfp4", "nvfp4", "import")]
    for r in recs:
        assert r["bench"] == "profile_transfer" and (r["device"], r["layers"], r["tokens"]) == ("cpu", 2, 16)
        assert PER_OP | CUDA_ONLY <= r.keys() and all(r[k] is None for k in CUDA_ONLY)
        assert r["host_us_per_layer"] > 0 and r["wall_us_per_layer"] >= r["host_us_per_layer"]
        assert r["untraced_host_us_per_layer"] >= 0 and r["bundle_bytes"] > 0
        assert 0 < len(r["top_host_ops"]) <= 5
        assert 0 < len(r["top_python"]) <= 5
        for ranked in ("top_host_ops", "top_python"):
            assert all(isinstance(name, str) and us >= 0 and calls > 0 for name, us, calls in r[ranked])
