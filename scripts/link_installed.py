"""Seed a venv with distributions already installed in another venv, as hard links.

Why: the test command builds three venvs (.venv, .venv-vllm, .venv-tgi) that each need the same CPU
torch 2.13.0 (~750 MB) and some the same triton (~650 MB); three full copies overflowed CI's disk.
A hard-linked distribution is a normal install to pip (its RECORD and metadata are linked with it), so
pip then reports the requirement satisfied, and replacing or uninstalling it in one venv unlinks only
that venv's names. Console scripts are rewritten (their shebang names the venv's python), not linked.

Usage: python scripts/link_installed.py SRC_VENV DST_VENV NAME==VERSION ...
A distribution is linked only when SRC has exactly that version and DST has none of that name.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import sys
from pathlib import Path


def site_packages(venv: Path) -> Path:
    """The venv's site-packages (venvs made by `python3 -m venv` with this script's interpreter version)."""
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def find(site: Path, name: str) -> md.Distribution | None:
    key = name.lower().replace("_", "-")
    for dist in md.distributions(path=[str(site)]):
        if dist.metadata["Name"].lower().replace("_", "-") == key:
            return dist
    return None


def link_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem: a copy is still a correct install
        shutil.copy2(src, dst)


def link_distribution(dist: md.Distribution, src_venv: Path, dst_venv: Path) -> int:
    """Link every file the distribution's RECORD lists; returns the number of files."""
    src_site, dst_site = site_packages(src_venv), site_packages(dst_venv)
    src_bin = (src_venv / "bin").resolve()
    n = 0
    for rel in dist.files or ():
        src = (src_site / rel).resolve()
        if not src.is_file():
            continue
        if src.parent == src_bin:  # console script: same text, this venv's interpreter
            dst = dst_venv / "bin" / src.name
            text = src.read_text()
            first, _, rest = text.partition("\n")
            dst.write_text(f"#!{(dst_venv / 'bin' / 'python').absolute()}\n{rest}" if first.startswith("#!")
                           else text)
            dst.chmod(0o755)
        else:
            link_file(src, dst_site / rel)
        n += 1
    return n


def main(argv: list[str]) -> int:
    if len(argv) < 3 or any("==" not in a for a in argv[2:]):
        print(__doc__.split("Usage: ")[1].splitlines()[0], file=sys.stderr)
        return 2
    src_venv, dst_venv = Path(argv[0]), Path(argv[1])
    src_site, dst_site = site_packages(src_venv), site_packages(dst_venv)
    if not src_site.is_dir() or not dst_site.is_dir():
        return 0  # nothing to share from (or into): pip installs as usual
    for spec in argv[2:]:
        name, version = spec.split("==")
        dist = find(src_site, name)
        if dist is None or dist.version != version or find(dst_site, name) is not None:
            continue
        print(f"link_installed: {name} {version} from {src_venv} ({link_distribution(dist, src_venv, dst_venv)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
