"""Where a suite's time goes: Triton compiling, the fp32 oracle, the timed benches, and the rest.

A suite process wraps three entry points once (``install``): ``triton.compiler.compile`` (what
every JIT kernel calls on its first launch of a specialization, a cache hit included),
each public function of ``nsa_core.reference`` (the oracle) and ``timing.bench``. Time is charged
to the innermost phase running (a kernel compiled inside a bench is compile time, not bench
time); on a GPU the oracle's phase ends with a synchronize, so its kernels are its own. A case's
``run`` is its duration less the three.
"""
from __future__ import annotations

import functools
import inspect
import time

PHASES = ("compile", "oracle", "bench")

_spent = dict.fromkeys(PHASES, 0.0)
_installed: list[str] = []           # the device ``install`` was called for
_stack: list[list[float]] = []       # per open phase: [start, time charged to phases inside it]


def _charged(phase: str, fn, sync=None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _stack.append([time.perf_counter(), 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            if sync is not None:
                sync()
            t0, inner = _stack.pop()
            took = time.perf_counter() - t0
            _spent[phase] += took - inner
            if _stack:
                _stack[-1][1] += took
    wrapper.__nsa_phase__ = phase
    return wrapper


def install(device: str) -> list[str]:
    """Wrap the three entry points (once); returns the phases that could not be observed (a
    Triton without ``triton.compiler.compile``), which a report then says it did not measure."""
    missing = []
    _installed.append(device)
    try:
        import triton.compiler as tc
        if not hasattr(tc.compile, "__nsa_phase__"):
            tc.compile = _charged("compile", tc.compile)
    except (ImportError, AttributeError):
        missing.append("compile")
    from nsa_core import reference
    sync = None
    if device == "cuda":
        import torch
        sync = torch.cuda.synchronize
    for name, fn in vars(reference).items():
        if (inspect.isfunction(fn) and fn.__module__ == reference.__name__ and not name.startswith("_")
                and not hasattr(fn, "__nsa_phase__")):
            setattr(reference, name, _charged("oracle", fn, sync))
    from nsa_validate.measure import timing
    if not hasattr(timing.bench, "__nsa_phase__"):
        timing.bench = _charged("bench", timing.bench)
    return missing


def installed() -> bool:
    return bool(_installed)


def take() -> dict[str, float]:
    """Seconds spent in each phase since the last ``take`` (the running case's), and reset."""
    out = {p: round(s, 3) for p, s in _spent.items()}
    for p in PHASES:
        _spent[p] = 0.0
    return out
