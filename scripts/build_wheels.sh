#!/usr/bin/env bash
# Build the wheels users install into dist/: kvx (with its CUDA kernels prebuilt by nvcc: KVX_BUILD_CUDA=1 requires
# nvcc, as in CI; set KVX_BUILD_CUDA=auto to build a pure-Python kvx wheel where there is none) and the three
# engine plugins. Uses .venv's pip (scripts/setup_env.sh) to run the PEP 517 builds.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVX_BUILD_CUDA="${KVX_BUILD_CUDA:-1}"
rm -rf dist build && mkdir -p dist
for src in . plugins/kvx_vllm plugins/kvx_tgi plugins/kvx_trtllm; do
  .venv/bin/python -m pip wheel -q --no-deps -w dist "$src"
  rm -rf "$src/build"  # setuptools' in-tree staging: never mistaken for the source later
done
ls -l dist
