#!/usr/bin/env bash
# On the GPU machine: KVX as a user installs it, with no CUDA toolkit. Installs dist/*.whl (scripts/build_wheels.sh)
# into a folder on PYTHONPATH, hides every nvcc (a private mount namespace puts an empty folder over
# /usr/local/cuda/bin; CUDA_HOME unset; PATH without CUDA folders) and points $KVX_CUDA_CACHE at an empty folder
# (it must stay empty: nothing is compiled), then runs `kvx doctor`, tests/test_installed_wheel.py (the GPU test too)
# and the CUDA decode / write / attention-plan GPU tests from a copy of tests/ without the source packages, and
# `vllm serve` of a tiny random Llama (head_dim 128, GQA 2) with --kv-cache-dtype kvx_nvfp4 and one completion.
# Usage, in the repository root with vLLM 0.26 on PYTHONPATH (../shared/gpu): bash scripts/gpu_wheel_check.sh OUTDIR
set -uo pipefail
out=$(realpath "${1:?usage: gpu_wheel_check.sh OUTDIR}")
if [ -z "${KVX_NO_NVCC_NS:-}" ]; then
  exec unshare -m env KVX_NO_NVCC_NS=1 bash -c 'mount -t tmpfs none /usr/local/cuda/bin && exec bash "$0" "$1"' "$0" "$out"
fi
root=$PWD
target=/tmp/kvx-wheels
rm -rf "$target"
python3 -m pip install -q --no-index --no-deps --target "$target" dist/kvx-*.whl dist/kvx_vllm-*.whl dist/kvx_trtllm-*.whl
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
unset CUDA_HOME CUDA_PATH
PATH=$(echo "$PATH" | tr : '\n' | grep -v cuda | paste -sd:)
export PATH KVX_CUDA_CACHE
KVX_CUDA_CACHE=$(mktemp -d)
echo "nvcc on PATH: $(command -v nvcc || echo none); /usr/local/cuda/bin: $(ls /usr/local/cuda/bin | wc -l) files"
stage=$(mktemp -d)
cp -r tests pyproject.toml "$stage"/
cd "$stage"
python3 -m kvx_cli.main doctor 2>&1 | tee "$out/doctor.txt"
KVX_INSTALLED_WHEEL=1 python3 -m pytest -q -p no:cacheprovider tests/test_installed_wheel.py -rA 2>&1 | tee "$out/pytest_wheel.log"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cuda_decode.py tests/kernels/test_write_kernel.py \
  tests/kernels/test_attention_plan.py 2>&1 | tail -5 | tee -a "$out/pytest_wheel.log"
echo "KVX_CUDA_CACHE after the tests: $(ls -A "$KVX_CUDA_CACHE" | wc -l) files" | tee -a "$out/pytest_wheel.log"
python3 -c "
from pathlib import Path
from tests.tiny_llama import save_tiny_llama
save_tiny_llama(Path('/tmp/tiny-llama'), hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=4096)"
# FlashInfer JIT-compiles its sampler with nvcc at vLLM startup: without a toolkit vLLM must sample in torch
VLLM_USE_FLASHINFER_SAMPLER=0 bash "$root/scripts/vllm_serve_check.sh" /tmp/tiny-llama kvx_nvfp4 "$out/serve_kvx_nvfp4.log" 2>&1 | tee "$out/serve.txt"
echo "KVX_CUDA_CACHE after vllm serve: $(ls -A "$KVX_CUDA_CACHE" | wc -l) files" | tee -a "$out/serve.txt"
