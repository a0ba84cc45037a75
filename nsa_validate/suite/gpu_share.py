"""Suites sharing one GPU without disturbing each other's measurements.

When several suite processes run on one GPU at once (``oneshot`` on a GPU), every case holds a
lock on a file of that GPU: shared for a parity case (any number run together: their kernels
only need to be right), exclusive for a case marked ``nsa_exclusive`` (a timing, a hardware
counter, most of the GPU's memory), which therefore runs with nothing else on the GPU. ``flock``
locks belong to the open file: they go away with the process, killed or not.

Starting up (importing torch, collecting, creating a CUDA context) also disturbs a measurement, so a
suite process holds the lock shared from its start until its first case (``announce``), and the
runner holds it shared until every suite process of the GPU has announced itself (``started``):
the first timed case waits until everyone has started. ``collect`` moves the hold logs into the run's
``logs/`` and returns the exclusive holds that overlapped another (there should be none).

``flock`` favours no one: a timed case waiting for the lock while other processes take it shared, case
after case, waits until they have no case left. On a cold pod that put every timed case after the
last parity case, when the compiles were done and the CPU idle, one after another (H200, quick: the
last 14 s of 61 s). So a case asks at a turnstile first (``<lock>.turn``): a timed case holds it
while it waits for the GPU, and a parity case passes it only when no timed case is waiting; the
timed cases then run as soon as their setups are done, while the run's warming processes compile
on the CPU (``prewarm``: at a lower CPU priority) and the parity cases wait. That only for a case that
times nothing (``nsa_exclusive(beside_warming=True)``: a check that needs most of the GPU's memory), or
whose first timings are GPU-bound and that waits for the warming itself before the rest
(``hold.let_go_while``: the layer bench's dense layers, then the NSA layer); a case that times anything else
first waits, holding nothing, for the warming to end (``wait_warming``): host times taken beside fifteen
compiling processes read high (H200: the decode loop's host cost a call 38.0 µs beside them against 20.4
in the warm run that followed).
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import time
from pathlib import Path


def lock_path(run_dir: Path, gpu: int) -> str:
    """The lock file of local GPU ``gpu`` for one run (removed by ``collect``)."""
    return str(Path(run_dir) / f".gpu{gpu}.lock")


def acquire(path: str, exclusive: bool, queued: bool = True) -> int:
    """Take the GPU lock at ``path`` (created if missing); returns the descriptor that holds it.
    ``queued``: through the turnstile, held (exclusive) or passed (shared) until the lock is taken;
    False for the start-up holds, which a waiting timed case needs to see released."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    turn = os.open(f"{path}.turn", os.O_RDWR | os.O_CREAT, 0o644) if queued else None
    try:
        if turn is not None:
            fcntl.flock(turn, mode)
        fcntl.flock(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    finally:
        if turn is not None:
            os.close(turn)             # the turnstile is released once the lock is held
    return fd


def release(fd: int) -> None:
    os.close(fd)


class hold:
    """Hold the GPU lock at ``path`` for a ``with`` block: exclusive or shared. Each stretch held is logged
    to ``<path>.log`` (pid, mode, start and end on the monotonic clock, ``what``): the record that timed
    cases ran alone (``overlaps``). ``let_go_while(wait, what)`` ends a stretch (logged as ``what``), calls
    ``wait()`` holding nothing, and takes the lock again, through the turnstile: a timed case whose first
    timings are GPU-bound and whose last ones are not waits there for a quiet CPU (``wait_warming``)."""

    def __init__(self, path: str, exclusive: bool, what: str = ""):
        self.path, self.exclusive, self.what = path, exclusive, what
        self.fd: int | None = None

    def __enter__(self) -> "hold":
        self._take()
        return self

    def __exit__(self, *exc) -> None:
        self._let_go(self.what)

    def let_go_while(self, wait, what: str) -> None:
        self._let_go(what)
        wait()
        self._take()

    def _take(self) -> None:
        self.fd, self.t0 = acquire(self.path, self.exclusive), time.monotonic()

    def _let_go(self, what: str) -> None:
        if self.fd is None:                 # interrupted while waiting to take it again: nothing held
            return
        t1 = time.monotonic()
        fd, self.fd = self.fd, None         # forgotten first: an interrupt here never closes it twice
        release(fd)
        with open(f"{self.path}.log", "a") as f:     # one short line per write: appends do not interleave
            f.write(json.dumps({"pid": os.getpid(), "exclusive": self.exclusive, "t0": self.t0, "t1": t1,
                                "what": what}) + "\n")


def _holds(log_path: str) -> list[dict]:
    """A hold log's lines (a line cut short by a killed process skipped)."""
    rows = []
    with open(log_path, errors="replace") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return [r for r in rows if isinstance(r, dict) and {"t0", "t1", "exclusive", "what"} <= r.keys()]


def overlaps(log_path: str) -> list[str]:
    """Exclusive holds in a hold log that overlapped any other hold (should be none)."""
    rows = _holds(log_path)
    bad = []
    for a in rows:
        if a["exclusive"]:
            bad += [f"{a['what']} overlapped {b['what']}" for b in rows
                    if b is not a and b["t0"] < a["t1"] and a["t0"] < b["t1"]]
    return bad


def warming_lock(path: str) -> int:
    """The lock the run's warming processes hold shared for as long as any of them lives: taken here, its
    descriptor handed to the first of them (inherited by those it forks: one open file, so the lock goes with
    the last); the caller closes its own copy once that process has started."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def wait_warming(path: str) -> None:
    """Until no warming process of the run is left (at once where none was started, or the run has removed
    their folder)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


def warming_running(path: str, tries: int = 3) -> bool:
    """Whether a warming process of the run still lives (holds its lock), without waiting for it: the
    lock is found held ``tries`` times, 10 ms apart (a case past ``wait_warming`` holds it for an instant
    as the warming ends, which one look would take for the warming)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        for i in range(tries):
            if i:
                time.sleep(0.01)
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
        return True
    finally:
        os.close(fd)


def announce(path: str) -> int:
    """A suite process has started: hold the lock shared (until its first case) and say so."""
    fd = acquire(path, exclusive=False, queued=False)
    with open(f"{path}.started-{os.getpid()}", "w"):
        pass
    return fd


def started(path: str) -> int:
    """How many suite processes have announced themselves on the lock at ``path``."""
    return len(glob.glob(glob.escape(path) + ".started-*"))


def alone(run_dir: Path, until: float | None = None) -> dict[str, float]:
    """The cases that held a GPU alone, from the run's kept hold logs (``collect``): the case's node id →
    seconds, summed over GPUs. ``until`` (the monotonic clock): only the seconds before it, and only
    the cases that had some (those timed while the warming processes still compiled)."""
    out: dict[str, float] = {}
    for log in sorted((Path(run_dir) / "logs").glob("gpu*_share.jsonl")):
        for h in _holds(str(log)):
            t1 = h["t1"] if until is None else min(h["t1"], until)
            if h["exclusive"] and t1 > h["t0"]:
                out[h["what"]] = round(out.get(h["what"], 0.0) + t1 - h["t0"], 2)
    return out


def collect(run_dir: Path) -> list[str]:
    """After the run: each GPU's hold log kept as ``logs/gpuN_share.jsonl``, the lock and start
    files removed; returns the exclusive holds that overlapped another, across GPUs."""
    run_dir, bad = Path(run_dir), []
    for log in sorted(run_dir.glob(".gpu*.lock.log")):
        with contextlib.suppress(OSError):
            (run_dir / "logs").mkdir(exist_ok=True)
            kept = run_dir / "logs" / f"{log.name.split('.')[1]}_share.jsonl"
            log.replace(kept)
            bad += overlaps(str(kept))
    for f in run_dir.glob(".gpu*.lock*"):
        with contextlib.suppress(OSError):
            f.unlink()
    return bad
