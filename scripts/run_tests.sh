#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs). GPU tests are deselected
# here (no CUDA); they run on the GPU machine with `pytest -m gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python -m pytest -q -m "not gpu" "$@"
