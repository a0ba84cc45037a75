"""Where the project's own files are: the repository root (the package is installed editable, or
run from a checkout) and its profiles folder. Run folders and baselines go to the current
directory instead (``rundir``)."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILE_DIR = REPO_ROOT / "profiles"
