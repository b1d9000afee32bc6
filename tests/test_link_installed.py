"""scripts/link_installed.py: a distribution installed in one venv appears in another as hard links to the same
files (console scripts rewritten for the other venv's python), only at the exact version and only where the
target has none; importlib.metadata then finds it there."""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"


def _load():
    spec = importlib.util.spec_from_file_location("link_installed", ROOT / "scripts" / "link_installed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _venv(root: Path) -> Path:
    (root / "lib" / PY / "site-packages").mkdir(parents=True)
    (root / "bin").mkdir()
    return root


def _install(venv: Path, name: str, version: str) -> None:
    """A minimal wheel install: a package, its dist-info with METADATA and RECORD, and a console script."""
    site = venv / "lib" / PY / "site-packages"
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(f"VERSION = {version!r}\n")
    di = site / f"{name}-{version}.dist-info"
    di.mkdir()
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (venv / "bin" / f"{name}-cli").write_text(f"#!{venv}/bin/python\nimport {name}\n")
    rec = [f"{name}/__init__.py,,", f"{di.name}/METADATA,,", f"{di.name}/RECORD,,", f"../../../bin/{name}-cli,,"]
    (di / "RECORD").write_text("\n".join(rec) + "\n")


def test_links_the_exact_version_once(tmp_path, capsys):
    link = _load()
    src, dst = _venv(tmp_path / "a"), _venv(tmp_path / "b")
    _install(src, "alpha", "1.0")
    _install(src, "beta", "2.0")
    assert link.main([str(src), str(dst), "alpha==1.0", "beta==3.0", "gamma==1.0"]) == 0
    site_a, site_b = (v / "lib" / PY / "site-packages" for v in (src, dst))
    assert os.path.samefile(site_a / "alpha" / "__init__.py", site_b / "alpha" / "__init__.py")
    assert not (site_b / "beta").exists()  # another version: pip installs it
    script = (dst / "bin" / "alpha-cli").read_text()
    assert script.startswith(f"#!{dst.absolute()}/bin/python\n") and os.access(dst / "bin" / "alpha-cli", os.X_OK)
    dist = next(d for d in md.distributions(path=[str(site_b)]) if d.metadata["Name"] == "alpha")
    assert dist.version == "1.0"
    capsys.readouterr()
    assert link.main([str(src), str(dst), "alpha==1.0"]) == 0  # already there: untouched
    assert capsys.readouterr().out == ""


def test_missing_venvs_and_bad_arguments(tmp_path):
    link = _load()
    assert link.main([str(tmp_path / "none"), str(tmp_path / "other"), "torch==2.13.0"]) == 0  # nothing to share
    assert link.main(["a", "b", "torch"]) == 2  # NAME==VERSION required
