#!/usr/bin/env bash
# Set up the environment and run the main job: `kvx demo` (embedded default model and text).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec kvx demo "$@"
