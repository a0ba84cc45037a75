"""Suites sharing one GPU without disturbing each other's measurements.

When several suite processes run on one GPU at once (``oneshot`` on a GPU), every case holds a
lock on a file of that GPU: shared for a parity case (any number run together: their kernels
only need to be right), exclusive for a case marked ``nsa_exclusive`` (a timing, a hardware
counter, most of the GPU's memory), which therefore runs with nothing else on the GPU. ``flock``
locks belong to the open file: they go away with the process, killed or not.
"""
from __future__ import annotations

import contextlib
import fcntl
import os


@contextlib.contextmanager
def hold(path: str, exclusive: bool):
    """Hold the GPU lock at ``path`` (created if missing) for the block: exclusive or shared."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)
