"""What a run tells its caller as it goes (the CLI draws bars or log lines from it)."""
from __future__ import annotations

import contextlib
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
        """The environment is broken and the run gates on it: no suite will run."""

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
