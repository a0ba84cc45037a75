"""Suites sharing one GPU without disturbing each other's measurements.

When several suite processes run on one GPU at once (``oneshot`` on a GPU), every case holds a
lock on a file of that GPU: shared for a parity case (any number run together: their kernels
only need to be right), exclusive for a case marked ``nsa_exclusive`` (a timing, a hardware
counter, most of the GPU's memory), which therefore runs with nothing else on the GPU. ``flock``
locks belong to the open file: they go away with the process, killed or not.

Starting up (importing torch, collecting, creating a CUDA context) also disturbs a measurement, so a
suite process holds the lock shared from its start until its first case (``announce``), and the
runner holds it shared until every suite process of the GPU has announced itself
(``wait_until_started``): the first timed case waits until everyone has started.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import os


def acquire(path: str, exclusive: bool) -> int:
    """Take the GPU lock at ``path`` (created if missing); returns the descriptor that holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    return fd


def release(fd: int) -> None:
    os.close(fd)


@contextlib.contextmanager
def hold(path: str, exclusive: bool):
    """Hold the GPU lock at ``path`` for the block: exclusive or shared."""
    fd = acquire(path, exclusive)
    try:
        yield
    finally:
        release(fd)


def announce(path: str) -> int:
    """A suite process has started: hold the lock shared (until its first case) and say so."""
    fd = acquire(path, exclusive=False)
    with open(f"{path}.started-{os.getpid()}", "w"):
        pass
    return fd


def started(path: str) -> int:
    """How many suite processes have announced themselves on the lock at ``path``."""
    return len(glob.glob(glob.escape(path) + ".started-*"))
