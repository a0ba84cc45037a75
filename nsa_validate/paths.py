"""Where the project's own files are: the repository root (the package is installed editable, or
run from a checkout), its profiles folder, and the user's cache folder for what a later command can
reuse (kept bytecode, a passing interpreter probe). Run folders and baselines go to the current
directory instead (``rundir``)."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILE_DIR = REPO_ROOT / "profiles"


def kernel_sources() -> list[Path]:
    """The Triton kernels' source files (``kernels/*.py``), in a fixed order: what a cache keyed on the
    kernels' code (the kept interpreter probe, the warming's marker) hashes."""
    return sorted((REPO_ROOT / "kernels").glob("*.py"))


def user_cache() -> Path | None:
    """``$XDG_CACHE_HOME/nsa-validate`` (an absolute XDG_CACHE_HOME; else ``~/.cache``); None without a
    home to put it in."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(root):
        try:
            root = str(Path.home() / ".cache")
        except RuntimeError:                     # no HOME and no passwd entry
            return None
    return Path(root) / "nsa-validate"
