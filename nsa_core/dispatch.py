"""The dispatch log: what actually executed. Every branch implementation calls ``note()`` as it
runs, so a suite can assert "the Triton selection kernel ran" from evidence rather than from a
flag (a guard that silently falls back to SDPA cannot pass for FA-2); ``profiler_range`` /
``ranged`` name the work in ``torch.profiler`` so the GPU kernels can be attributed too.

Imports nothing of the project: kernels and the torch paths report here, ``routing`` decides.
"""
from __future__ import annotations

import functools
import threading
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Iterator


@dataclass(eq=False)      # identity: nested captures must each remove their own log
class DispatchLog:
    """Counts of (phase, branch, backend) executions observed while active, and the routing
    decisions made meanwhile ((phase, branch) -> {"backend: why (query)"})."""
    counts: Counter = field(default_factory=Counter)
    decisions: dict = field(default_factory=dict)

    def ran(self, phase: str, branch: str, backend: str) -> int:
        return self.counts[(phase, branch, backend)]

    def backends(self, phase: str | None = None) -> dict[str, list[str]]:
        """{branch: sorted backends that ran} (optionally for one phase)."""
        out: dict[str, set] = {}
        for (ph, br, be) in self.counts:
            if phase is None or ph == phase:
                out.setdefault(br, set()).add(be)
        return {br: sorted(bes) for br, bes in sorted(out.items())}

    def summary(self) -> list[dict]:
        return [{"phase": p, "branch": b, "backend": be, "calls": n}
                for (p, b, be), n in sorted(self.counts.items())]


# Process-wide, not per thread: autograd runs a CUDA backward pass on its own device thread, and
# a kernel's backward must be seen by the capture that wrapped the forward.
_logs: list[DispatchLog] = []
_lock = threading.Lock()


class _Diverted(threading.local):
    """Per thread, though: a CUDA graph's capture (``diverted``) records the capturing thread's work only.
    ``log`` defaults on the class: a thread that never set it reads None without the AttributeError that
    ``getattr(local, "log", None)`` raises and catches inside (~0.6 µs a note here; a decode call makes three)."""
    log: DispatchLog | None = None


_diverted = _Diverted()


def _targets() -> list[DispatchLog]:
    """The logs a note goes to. Empty (a user's decode loop: three notes a call), a note returns before the
    lock; a capture starting meanwhile on another thread misses it, as it would have after the lock."""
    log = _diverted.log
    return _logs if log is None else [log]


def note(phase: str, branch: str, backend: str) -> None:
    """Called by every branch implementation when it actually runs."""
    if not _targets():
        return
    with _lock:
        for log in _targets():
            log.counts[(phase, branch, backend)] += 1


def decided(phase: str, branch: str, backend: str, reason: str, query: str) -> None:
    """Called by the routing policy for each decision, so a run records what it was asked and chose."""
    if not _targets():
        return
    with _lock:
        for log in _targets():
            log.decisions.setdefault((phase, branch), set()).add(f"{backend}: {reason} ({query})")


RANGE_PREFIX = "nsa:"


def profiler_range(phase: str, branch: str):
    """A ``torch.profiler`` range named ``nsa:<phase>/<branch>`` around a branch's work, so the GPU
    kernels it launches can be attributed to it; no range when nothing profiles (a range costs
    ~8 µs of host time, H100 host: a replayed decode step pays it every token)."""
    import torch
    if not torch.autograd._profiler_enabled():
        return nullcontext()
    return torch.profiler.record_function(f"{RANGE_PREFIX}{phase}/{branch}")


def ranged(phase: str, branch: str):
    """Decorator: the function runs inside ``profiler_range(phase, branch)``, so a case that
    observes several launchers in one block can tell their kernels apart. Only for launchers whose
    kernels come from ATen ops: torch.profiler (2.11, H100) attributed none of the Triton kernels
    launched inside such a range to it, so the Triton launchers are observed block-wide instead."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with profiler_range(phase, branch):
                return fn(*args, **kwargs)
        return inner
    return wrap


@contextmanager
def capture() -> Iterator[DispatchLog]:
    log = DispatchLog()
    with _lock:
        _logs.append(log)
    try:
        yield log
    finally:
        with _lock:
            _logs.remove(log)


@contextmanager
def diverted() -> Iterator[DispatchLog]:
    """Notes this thread makes inside go to a log of their own, not to the logs active outside: for
    work that is recorded rather than run (a CUDA graph's capture), whose replays ``replay`` the
    notes. Other threads' notes are not diverted."""
    log, outer = DispatchLog(), _diverted.log
    _diverted.log = log
    try:
        yield log
    finally:
        _diverted.log = outer


def replay(log: DispatchLog) -> None:
    """Note again what ``log`` holds: the work it recorded ran once more (a CUDA graph's replay)."""
    if not _targets():
        return
    with _lock:
        for outer in _targets():
            outer.counts.update(log.counts)
