"""Compiled bytecode for Python installs that keep none.

Many GPU images install torch without its ``.pyc`` files and set ``PYTHONDONTWRITEBYTECODE=1`` (or
keep site-packages read-only): every Python process then compiles the torch sources it imports
again. A suite process imports most of torch (its kernel watcher, ``torch.profiler``, pulls in
``torch._dynamo`` and sympy), and a GPU run starts fifteen or more of them at once: on an H200 pod
so set up, ~7 s of each process's start went to ``compile()`` (docs/decisions.md). ``enable``,
called first by the ``nsa-validate`` entry point, keeps that bytecode in a cache folder of its own
(``sys.pycache_prefix``) for this process and the processes it starts, where torch has none beside
its sources; nothing is written next to anyone's sources, and a prefix the user set is left as it is.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/nsa-validate/pycache`` (default ``~/.cache``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "nsa-validate" / "pycache"


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
    elif _torch_has_bytecode() is not False:
        _STATE.update(prefix=None, why="torch has its bytecode" if _torch_has_bytecode() else "no torch")
    else:
        prefix = str(cache_dir())
        sys.pycache_prefix = prefix
        sys.dont_write_bytecode = False
        os.environ["PYTHONPYCACHEPREFIX"] = prefix             # the suites' and helpers' processes
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        _STATE.update(prefix=prefix, why="torch had no bytecode: kept in this folder")
    return state()


def state() -> dict:
    """``{"prefix": folder or None, "why": ...}``: where this process keeps compiled bytecode."""
    return dict(_STATE)
