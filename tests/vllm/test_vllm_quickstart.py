"""The vLLM quick start of the README and docs/guide/vllm.md runs as written on this CPU: its Python block (the
blocks marked `covered-by: tests/vllm/test_vllm_quickstart.py`) as a script in a fresh process, vLLM's engine in a
process of its own (the `__main__` guard) and the KV cache sized by `VLLM_CPU_KVCACHE_SPACE`.

The one change: the model id `HuggingFaceTB/SmolLM2-135M` becomes the local copy of that model the other vLLM
tests use (CI has no network). The greedy continuation of "The capital of France is" must name Paris, and the
KVX backend must have served the nvfp4 cache (its startup log line).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.docblocks import blocks, doc_files, repo_root

pytestmark = pytest.mark.vllm

MODEL_ID = '"HuggingFaceTB/SmolLM2-135M"'
TIMEOUT_S = 600  # a first run compiles the model with torch.compile (~75 s on 2 idle cores)


def _quickstart_blocks() -> list[str]:
    """The distinct Python quick-start blocks of the docs (the README's and the vLLM guide's are the same)."""
    root = repo_root()
    codes = {b.code for d in doc_files(root) for b in blocks(d)
             if b.lang == "python" and b.mark == ("covered-by", "tests/vllm/test_vllm_quickstart.py")}
    assert codes, "no python block marked `covered-by: tests/vllm/test_vllm_quickstart.py` in the docs"
    return sorted(codes)


CODES = _quickstart_blocks()


@pytest.mark.parametrize("code", CODES, ids=[f"block{i}" for i in range(len(CODES))])
def test_quickstart_runs_as_written(code, checkpoint, tmp_path):
    assert code.count(MODEL_ID) == 1, f"the quick start no longer names {MODEL_ID}:\n{code}"
    script = tmp_path / "quickstart.py"
    script.write_text(code.replace(MODEL_ID, repr(checkpoint)))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # the block sets it
    r = subprocess.run([sys.executable, script.name], check=False, cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-5000:]}"
    assert "Paris" in r.stdout, r.stdout[-3000:]
    assert "KVX attention backend: format nvfp4" in r.stderr + r.stdout, r.stderr[-5000:]  # the KVX cache served it
