#!/usr/bin/env python3
"""Set-up and everyday commands for orbit_pt, on a fresh machine with only Python 3.10+.

    python3 dev.py demo     # the demo: a 2-rank FSDP fine-tune, preempted, resumed, compared
    python3 dev.py test     # the quick tests, minutes (extra arguments go to pytest)
    python3 dev.py test --full   # the full tier: several processes, S3, sweeps (CI runs both)
    python3 dev.py test --all    # both tiers in one run
    python3 dev.py lint     # ruff check, ruff format --check, mypy
    python3 dev.py docs     # the docs site (mkdocs build --strict) into ./site

Each command creates (or reuses) ./.venv and installs what it needs into it. PyTorch is
installed first and pinned to a CPU build: an unpinned `torch` would pull a multi-GB CUDA build.
Set ORBIT_PT_TORCH to another requirement (e.g. "torch==2.6.0") to test against another release.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
TORCH = os.environ.get("ORBIT_PT_TORCH", "torch==2.13.0")
STAMP = VENV / ".orbit-pt-installed"


def ensure_venv() -> None:
    """Create .venv and install orbit_pt with its dev extra, unless already up to date."""
    if sys.version_info < (3, 10):  # noqa: UP036 -- dev.py runs before anything is installed
        sys.exit(f"orbit_pt needs Python 3.10 or newer; this is {sys.version.split()[0]}")
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()
    if STAMP.is_file() and STAMP.read_text() == wanted and PYTHON.exists():
        return
    if not PYTHON.exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    print(f"installing {TORCH} (CPU build) and orbit_pt[dev] into {VENV}", flush=True)
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[dev]"], check=True)
    STAMP.write_text(wanted)


def run(*args: str) -> int:
    return subprocess.run([str(PYTHON), *args], cwd=ROOT).returncode


def main() -> int:
    command, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("help", [])
    if command == "demo":
        ensure_venv()
        return run("examples/demo.py", *rest)
    if command == "test":
        ensure_venv()
        tiers = {"--full": "full and not slow", "--all": "not slow"}
        chosen = [arg for arg in rest if arg in tiers]
        marks = tiers[chosen[-1]] if chosen else "not slow and not full"
        return run("-m", "pytest", "-m", marks, *(arg for arg in rest if arg not in tiers))
    if command == "lint":
        ensure_venv()
        return max(
            run("-m", "ruff", "check", "."),
            run("-m", "ruff", "format", "--check", "."),
            run("-m", "mypy"),
        )
    if command == "docs":
        ensure_venv()
        # mkdocs-material prints a banner about its successor on every build; it is not ours.
        os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
        return run("-m", "mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"), *rest)
    print(__doc__)
    return 0 if command in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
