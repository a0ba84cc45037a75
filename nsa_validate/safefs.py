"""Writing files without ever losing what the user had: atomic replaces, unique backups, locks.

Every file the tool writes over (results, baselines, profiles) goes through ``atomic_write``: the
new text lands in a temporary file beside the target and is renamed over it, so a reader (or a
crash, a signal, a full disk) sees the old file or the new one, never half of one. A file that is
replaced is first copied to ``backup``'s ``NAME.bak-<UTC time>-<n>`` (created exclusively, so two
backups in the same second never share a name), and writers of one target serialise on ``lock``.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) in one rename; the temporary file is removed on
    failure. The file keeps the mode it had (a new one: 0666 less the umask, as open() gives)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:              # name the file the user knows, not our temporary one
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        try:
            mode = path.stat().st_mode & 0o7777
        except OSError:
            mode = 0o666 & ~_UMASK
        os.fchmod(fd, mode)          # mkstemp makes 0600: a colleague could not read the results
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:          # (a write error carries no file name; a rename's names ours)
            raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def backup(path: Path) -> Path:
    """Copy ``path`` to a new ``NAME.bak-<UTC time>[-n]`` beside it (never an existing file) and return it."""
    path = Path(path)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for n in range(1, 10000):
        dest = path.with_name(f"{path.name}.bak-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            with open(dest, "xb") as out, open(path, "rb") as src:
                shutil.copyfileobj(src, out)
                out.flush()
                os.fsync(out.fileno())
            return dest
        except FileExistsError:
            continue
        except BaseException:
            with contextlib.suppress(OSError):
                if dest.exists() and dest.stat().st_size < path.stat().st_size:
                    dest.unlink()           # a copy cut short is not a backup
            raise
    raise OSError(errno.EEXIST, "no free backup name", str(path))


@contextlib.contextmanager
def lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for writing ``path`` (a ``.NAME.lock`` file beside it; POSIX flock)."""
    import fcntl
    path = Path(path)
    lock_path = path.with_name(f".{path.name}.lock")
    with open(lock_path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def rewrite_keeping_backup(path: Path, fn) -> Path:
    """Under ``lock(path)``: back up ``path``, then atomically replace it with ``fn(its text)``
    (read under the lock, so concurrent rewrites compose). Returns the backup."""
    with lock(path):
        text = fn(Path(path).read_text(encoding="utf-8"))
        kept = backup(path)
        atomic_write(path, text)
        return kept


def replace_keeping_backup(path: Path, text: str) -> Path | None:
    """Under ``lock(path)``: back up an existing ``path``, then atomically write ``text`` there.
    Returns the backup (None when there was no file)."""
    with lock(path):
        kept = backup(path) if Path(path).exists() else None
        atomic_write(path, text)
        return kept
