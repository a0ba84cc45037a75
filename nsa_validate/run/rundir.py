"""Run folders: ``<out>/<short-sha>[-dirty]/<UTC-timestamp>-<host>/``, never overwritten."""
from __future__ import annotations

import os
import re
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from nsa_validate.errors import UsageError
from nsa_validate.paths import REPO_ROOT



def default_out() -> Path:
    """Where run folders go without ``--out``: ``artifacts/`` under the current directory (the
    repository's own when run from it, as ``make oneshot`` does)."""
    return Path.cwd() / "artifacts"


def git_info(root: Path = REPO_ROOT) -> dict:
    """The project's commit and whether its tree differs from it. Only where ``root`` is itself a git
    work tree's top: a copy of the project inside another repository is ``nogit``, not that repository's
    commit. The tool's own files (``.NAME.lock`` beside a file it wrote, ``baselines/``) do not make a
    tree dirty."""
    def git(*args):
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        return r.stdout.rstrip("\n") if r.returncode == 0 else None
    sha, dirty = None, False
    try:
        top = git("rev-parse", "--show-toplevel")
        if top and Path(top).resolve() == Path(root).resolve():
            sha = git("rev-parse", "HEAD")
            status = git("status", "--porcelain") if sha else ""
            dirty = any(not _tool_file(line[3:]) for line in (status or "").splitlines())
    except (OSError, subprocess.TimeoutExpired):
        sha, dirty = None, False
    return {"commit": sha, "short": sha[:7] if sha else "nogit", "dirty": dirty}


def _tool_file(path: str) -> bool:
    """A path ``git status`` lists that the tool itself writes into a project."""
    path = path.strip().strip('"').rstrip("/")
    name = path.rsplit("/", 1)[-1]
    return path == "baselines" or path.startswith("baselines/") or (name.startswith(".") and name.endswith(".lock"))


SYSTEM_DIRS = tuple(Path(p) for p in ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/sbin", "/sys",
                                         "/usr"))
PACKAGE_DIRS = tuple(REPO_ROOT / d for d in ("nsa_validate", "nsa_core", "kernels", "suites", "profiles", ".git"))


def expand(path) -> Path:
    """``~`` expanded; UsageError (not a traceback) for ``~nosuchuser``."""
    try:
        return Path(path).expanduser()
    except RuntimeError as e:
        raise UsageError(f"cannot expand '{path}' ({e})") from None


def resolve(path: Path) -> Path:
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as e:       # a symlink loop, a path too long
        raise UsageError(f"cannot resolve '{path}' ({e})") from None


def process_identity(pid: int) -> dict | None:
    """{"start": clock ticks since boot, "pid_ns": the PID namespace} of a live process on Linux
    ({} elsewhere), None when there is no such process: a pid that was reused, or one recorded in
    another container, is not mistaken for the run's process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    ident = {}
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ident["start"] = int(stat.rsplit(")", 1)[1].split()[19])
        ident["pid_ns"] = os.readlink(f"/proc/{pid}/ns/pid")
    except (OSError, ValueError, IndexError):
        pass
    return ident


def check_out(out: str | None) -> Path:
    """Validate ``--out``: not empty, not a system location or a folder of the package itself, a
    directory we can create and write in (relative paths, '..' included, are fine)."""
    if out is None:
        root = default_out()
    else:
        if not str(out).strip():
            raise UsageError("--out is empty; give the folder to put run folders in")
        root = expand(out)
        real = resolve(root)
        if is_system_location(real):
            raise UsageError(f"--out '{out}' is a system location ({real}); choose a folder of your own")
        if any(real == d or d in real.parents for d in PACKAGE_DIRS):
            raise UsageError(f"--out '{out}' is inside the tool's own code ({real}); choose another folder")
        if (run := enclosing_run(real)) is not None:
            raise UsageError(f"--out '{out}' is inside the run folder '{run}'; a run never writes into another")
        root = real                   # absolute: suite processes run in the repository, not in this folder
    if root.exists() and not root.is_dir():
        raise UsageError(f"--out '{root}' exists and is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out '{root}' is not writable ({e.strerror or e})") from None
    return root


def is_system_location(path: Path) -> bool:
    """``path`` (resolved) is ``/`` or lies in one of the system's own folders (``SYSTEM_DIRS``)."""
    return path == Path("/") or any(path == d or d in path.parents for d in SYSTEM_DIRS)


def enclosing_run(path: Path) -> Path | None:
    """The run folder (one holding a ``manifest.json`` or ``results.json``) that ``path`` is or lies in, or None."""
    for d in (path, *path.parents):
        if (d / "manifest.json").is_file() or (d / "results.json").is_file():
            return d
    return None


def commit_label(git: dict) -> str:
    """``<short-sha>[-dirty]``: the run folder's parent, and the commit CSVs and plots name."""
    return git["short"] + ("-dirty" if git["dirty"] else "")


def node_name(node: str | None) -> str:
    """The node a run is recorded under (``--node``, else this machine's host name); UsageError when blank."""
    if node is None:
        return socket.gethostname()
    if not node.strip():
        raise UsageError("--node is empty; give the node's name (or leave --node out for the host name)")
    return node.strip()


def create(root: Path, git: dict, node: str | None = None) -> Path:
    """A fresh run folder ``<root>/<commit-label>/<UTC stamp>-<node>`` (the node's name, default the
    host's, made safe for a file name) with its ``suites/`` and ``logs/``."""
    stamp = utc_stamp()
    # a file name, not a path; cut short of the file system's 255-byte limit on a component
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node_name(node))[:120] or "host"
    d = fresh_dir(root / commit_label(git), f"{stamp}-{safe}")
    for sub in ("suites", "logs"):
        (d / sub).mkdir()
    return d


def fresh_dir(parent: Path, name: str) -> Path:
    """Create and return ``parent/name`` (or ``name-2``, ``name-3`` …): never an existing folder."""
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        d = parent / (name + (f"-{n}" if n > 1 else ""))
        try:
            d.mkdir()
        except FileExistsError:
            continue
        return d
    raise UsageError(f"could not create a fresh folder under {parent}")


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def utc_stamp() -> str:
    """The current UTC time for file names: 20261121T213324Z."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
