#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs). GPU tests are deselected
# here (no CUDA); they run on the GPU machine with `pytest -m gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
# Tests whose dependencies are missing fail instead of skipping when CI is set: nothing skips silently.
export CI=1
exec python -m pytest -q -m "not gpu" "$@"
