"""The command's first instant: SIGINT, SIGTERM and SIGHUP are caught before anything heavy is
imported (``catch_early``, called by ``nsa_validate.__main__.main``, the ``nsa-validate`` entry
point). A Ctrl-C while Python imports the CLI and torch would otherwise end in a traceback, or be
lost; ``take_early`` hands what arrived to the CLI, which stops at once."""
from __future__ import annotations

import os
import signal
import time

_NAMES = ("SIGINT", "SIGTERM", "SIGHUP")
_early: list[str] = []
_saved: dict = {}


def _catch(signum, frame) -> None:
    _early.append(signal.Signals(signum).name)


def catch_early() -> None:
    """Record the stop signals from now on (an ignored signal stays ignored)."""
    for name in _NAMES:
        s = getattr(signal, name, None)
        if s is not None and signal.getsignal(s) is not signal.SIG_IGN:
            _saved[s] = signal.signal(s, _catch)


def take_early() -> list[str]:
    """The signals received since ``catch_early``, and the handlers restored to what they were."""
    for s, h in _saved.items():
        signal.signal(s, h)
    _saved.clear()
    got, _early[:] = list(_early), []
    return got


def process_age() -> float | None:
    """Seconds since this process started (Linux: its start time in /proc against the boot-time clock,
    to a clock tick); None where that cannot be read. The run records it as its ``start`` phase: Python's
    own start and the CLI's imports before the run began, the part no timer inside the run sees."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None
