"""Compiled bytecode for Python installs that keep none.

Many GPU images install torch without its ``.pyc`` files and set ``PYTHONDONTWRITEBYTECODE=1`` (or
keep site-packages read-only): every Python process then compiles the torch sources it imports
again. A suite process imports most of torch (its kernel watcher, ``torch.profiler``, pulls in
``torch._dynamo`` and sympy), and a GPU run starts fifteen or more of them at once: on an H200 pod
so set up, ~7 s of each process's start went to ``compile()`` (docs/decisions.md). ``enable``,
called first by the ``nsa-validate`` entry point, keeps that bytecode in a cache folder of its own
(``sys.pycache_prefix``) for this process and the processes it starts, where torch has none beside
its sources and the folder can be written; nothing is written next to anyone's sources, and a prefix
the user set is left as it is. With the prefix, Python reads all bytecode from that folder (not from
beside other packages' sources): a first run compiles what it imports there once.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from nsa_validate import paths


def cache_dir() -> Path | None:
    """``pycache`` in the user's cache folder (``paths.user_cache``); None without a home to put it in."""
    root = paths.user_cache()
    return root / "pycache" if root is not None else None


def _writable(folder: Path) -> bool:
    """The folder exists (made now if need be) and this process may write in it: bytecode that cannot
    be written would be compiled again by every process, where the prefix also hides the bytecode
    beside the other packages' sources."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def _torch_has_bytecode() -> bool | None:
    """Whether torch's ``__init__`` has its bytecode where this interpreter looks for it (None: no torch)."""
    spec = importlib.util.find_spec("torch")          # finds the package without importing it
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        return Path(importlib.util.cache_from_source(spec.origin)).exists()
    except (NotImplementedError, ValueError):
        return None


_STATE: dict = {"prefix": None, "why": "not checked"}


def enable() -> dict:
    """Keep bytecode under ``cache_dir()`` for this process and its children where torch's is missing.
    -> the state the run records (``state``)."""
    if sys.pycache_prefix:
        _STATE.update(prefix=sys.pycache_prefix, why="the prefix set by PYTHONPYCACHEPREFIX")
    elif (has := _torch_has_bytecode()) is not False:
        _STATE.update(prefix=None, why="torch has its bytecode" if has else "no torch")
    elif (folder := cache_dir()) is None or not _writable(folder):
        _STATE.update(prefix=None, why=f"torch has no bytecode, and {folder or 'no home folder'} cannot be written")
    else:
        prefix = str(folder)
        sys.pycache_prefix = prefix
        sys.dont_write_bytecode = False
        os.environ["PYTHONPYCACHEPREFIX"] = prefix             # the suites' and helpers' processes
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        _STATE.update(prefix=prefix, why="torch had no bytecode: kept in this folder")
    return state()


def state() -> dict:
    """``{"prefix": folder or None, "why": ...}``: where this process keeps compiled bytecode."""
    return dict(_STATE)
