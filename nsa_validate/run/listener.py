"""What a run tells its caller as it goes (the CLI draws bars or log lines from it)."""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from nsa_validate.report.schema import CaseRecord, SuiteResult


class Listener:
    """Every method is a no-op here; a caller overrides those it shows. Suite methods may be
    called from several threads at once (suites sharing a GPU run side by side)."""

    def profile_resolved(self, profile) -> None:
        """``profile``: the run's ``profiles.Profile`` (its expected suite times, for ETAs)."""

    def run_started(self, run_dir: Path) -> None:
        """The run folder exists and holds its manifest."""

    def env_checked(self, report) -> None:
        """``report``: the ``envcheck.EnvReport`` of this machine."""

    def env_broken(self) -> None:
        """The environment is broken and the run gates on it: the suites were stopped, none counts."""

    def suites_running(self) -> contextlib.AbstractContextManager:
        """Entered while the suites run (e.g. a live display)."""
        return contextlib.nullcontext()

    def suite_started(self, name: str, where: str, processes: int = 1) -> None:
        """``where``: " gpuN" when the run spans GPUs, else ""; ``processes``: how many pytest
        processes take the suite's cases."""

    def suite_progress(self, name: str, done: list[CaseRecord], total: int | None, running: str | None,
                       elapsed_s: float) -> None:
        """The cases finished so far, how many were collected, the case running now."""

    def suite_finished(self, name: str, where: str, result: SuiteResult) -> None:
        pass

    def interrupted(self, signals: list[str]) -> None:
        """A signal (named) stopped the run; what finished is being written."""

    def shared_gpu_overlaps(self, overlaps: list[str]) -> None:
        """Timed cases that did not have their GPU alone (``gpu_share.collect``)."""


class Held(Listener):
    """The suites' events (``suite_*``) for ``inner``, kept in order until ``release``, then passed on
    as they come: the suites start beside the environment check, whose report is shown first."""

    def __init__(self, inner: Listener) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._kept: list | None = []          # None once released

    def _on(self, event: str, *args) -> None:
        with self._lock:
            if self._kept is not None:
                self._kept.append((event, args))
                return
        getattr(self.inner, event)(*args)

    def release(self) -> None:
        """Pass on what was kept (under the lock: a later event waits for it), then every event."""
        with self._lock:
            kept, self._kept = self._kept or [], None
            for event, args in kept:
                getattr(self.inner, event)(*args)

    def suite_started(self, name: str, where: str, processes: int = 1) -> None:
        self._on("suite_started", name, where, processes)

    def suite_progress(self, name, done, total, running, elapsed_s) -> None:
        self._on("suite_progress", name, done, total, running, elapsed_s)

    def suite_finished(self, name, where, result) -> None:
        self._on("suite_finished", name, where, result)
