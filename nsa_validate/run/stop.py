"""The run's stop flag, set by SIGINT / SIGTERM / SIGHUP."""
from __future__ import annotations

import signal
import threading

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class Stop:
    """Installed before the run folder exists; a signal never raises inside the run (so no
    finished case is ever dropped): the suite in flight sees the flag within a poll, kills its
    process and keeps what it finished, and the run writes its folder marked interrupted. A second
    signal only hurries the first."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signals: list[str] = []
        self._old: dict = {}

    def __enter__(self) -> "Stop":
        for s in STOP_SIGNALS:
            if signal.getsignal(s) is signal.SIG_IGN:       # e.g. SIGHUP under nohup: stays ignored
                continue
            self._old[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _on_signal(self, signum, frame) -> None:
        self.signals.append(signal.Signals(signum).name)
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()
