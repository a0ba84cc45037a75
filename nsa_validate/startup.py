"""The command's first instant: SIGINT, SIGTERM and SIGHUP are caught before anything heavy is
imported (``catch_early``, called by ``nsa_validate.__main__.main``, the ``nsa-validate`` entry
point). A Ctrl-C while Python imports the CLI and torch would otherwise end in a traceback, or be
lost; ``take_early`` hands what arrived to the CLI, which stops at once."""
from __future__ import annotations

import signal

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
