"""What the CLI shows on stderr: the environment table, the progress of a run (a bar per suite on
a terminal, one plain line per event in a CI log), the comparison with a baseline and the verdict.
Machine output (``--json``) is the CLI's own, on stdout; nothing here decides a status.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nsa_validate.run.listener import Listener
from nsa_validate.report.schema import run_level

if TYPE_CHECKING:
    from nsa_validate.env.envcheck import EnvReport


class _Stderr:
    """The process's stderr for rich, minus failures: a closed terminal (SIGHUP) or a dead pipe
    (`| tee` killed by Ctrl-C) must not stop the run from writing its folder. It keeps the stream it
    started with: rich's live display points ``sys.stderr`` back at this console while it draws
    (writing to ``sys.stderr`` from here would loop forever)."""

    def __init__(self) -> None:
        self.stream = sys.stderr

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"


err = Console(file=_Stderr(), soft_wrap=True)   # lines are never wrapped: CI logs are not terminals
STYLE = {"pass": "green", "partial": "yellow", "ok": "green", "fail": "red", "error": "red", "broken": "red",
         "skip": "yellow", "degraded": "yellow", "info": "cyan", "n/a": "dim"}

def styled(s: str) -> str:
    return f"[{STYLE.get(s, 'white')}]{s}[/]"


def show_env(rep: EnvReport) -> None:
    f = rep.facts
    gpu = f.get("gpu") or {}
    t = Table(title=f"environment: {styled(rep.verdict)}", title_justify="left")
    for c in ("check", "status", "detail", "fix"):
        t.add_column(c, overflow="fold")
    t.add_row("versions", "", f"python {f.get('python')} · torch {f.get('torch')} (CUDA {f.get('torch_cuda')}) · "
              f"triton {f.get('triton')} · flash-attn {(f.get('flash_attn') or {}).get('version', '-')}", "")
    if gpu:
        tel = f.get("telemetry") or {}
        t.add_row("GPU", "", f"{gpu['name']} {gpu['sm']} {gpu['memory_gib']} GiB · driver {tel.get('driver_version', '?')} "
                  f"(CUDA {f.get('driver_cuda')}) · cuDNN {f.get('cudnn')} · SM {tel.get('clocks.sm', '?')} MHz "
                  f"{tel.get('temperature.gpu', '?')} C {tel.get('power.draw', '?')} W", "")
    for x in rep.findings:
        t.add_row(x.check, styled(x.status), escape(x.detail), escape(x.fix))
    err.print(t)


def show_comparison(cmp: dict) -> None:
    t = Table("metric", "baseline", "run", "change", "verdict", title=f"vs baseline {cmp['baseline']}: "
              f"{styled('fail' if cmp['status'] == 'regression' else 'pass')} (gate: +{cmp['max_regression_pct']}% "
              f"beyond the sample spread)", title_justify="left")
    for r in cmp["rows"]:
        if r["verdict"] != "ok":
            t.add_row(escape(r["metric"]), r["baseline"], r["run"], r["change"],
                      styled("fail") if r["verdict"] == "regression" else r["verdict"])
    err.print(t)
    for w in cmp.get("warnings", []):
        err.print(f"[yellow]warning[/]: {escape(w)}")
    if cmp.get("not_compared"):
        err.print(f"not compared (not selected in this run): {', '.join(cmp['not_compared'])}")
    err.print(f"{sum(r['verdict'] == 'ok' for r in cmp['rows'])} more metrics ok; "
              f"{len(cmp['regressions'])} regression(s)")


class ConsoleListener(Listener):
    """Progress on stderr: on a terminal, a bar per suite with the case running now and an ETA
    from the profile's ``expected_s``; else (a CI log) one plain line per event."""

    def __init__(self) -> None:
        self.expected_s: dict[str, float] = {}
        self.live = err.is_terminal
        self.t0 = time.monotonic()
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[eta]}"), TextColumn("{task.fields[running]}"),
                            console=err, transient=False, disable=not self.live)
        self.tasks: dict[str, object] = {}
        self.shown: dict[str, int] = {}
        self.processes: dict[str, int] = {}

    def line(self, text: str) -> None:
        err.print(f"[{time.monotonic() - self.t0:7.1f}s] {text}", highlight=False, markup=False)

    def profile_resolved(self, profile) -> None:
        self.expected_s = profile.suites.expected_s

    def run_started(self, run_dir: Path) -> None:
        err.print(f"run folder: {run_dir}")

    def env_checked(self, report) -> None:
        show_env(report)

    def env_broken(self) -> None:
        err.print("[red]environment broken[/]: suites stopped, none counts (fix the findings above, or pass --keep-going)")

    def suites_running(self):
        self.t0 = time.monotonic()
        return self.bar

    def suite_started(self, name: str, where: str, processes: int = 1) -> None:
        self.shown[name] = 0
        self.processes[name] = processes
        if self.live:
            self.tasks[name] = self.bar.add_task(f"{name:9s}{where}", total=None, eta="", running="")
        else:
            self.line(f"{name}{where}: started" + (f" ({processes} processes)" if processes > 1 else ""))

    def suite_progress(self, name, done, total, running, elapsed_s) -> None:
        if self.live:
            self.bar.update(self.tasks[name], completed=len(done), total=total, running=running or "",
                            eta=eta(self.expected_s.get(name), elapsed_s, self.processes.get(name, 1)))
            return
        for c in done[self.shown[name]:]:
            why = f": {c.reason[:160]}" if c.status in ("fail", "error") else ""
            self.line(f"{name}/{c.id} {c.status} ({c.duration_s:.1f} s)"
                      f" [{len(done)}/{total if total is not None else '?'}]{why}")
        self.shown[name] = len(done)

    def suite_finished(self, name, where, s) -> None:
        if self.live:
            self.bar.update(self.tasks[name], description=f"{name:9s}{where} {s.status}", completed=len(s.cases),
                            total=len(s.cases), eta="", running="")
            return
        self.suite_progress(name, s.cases, len(s.cases), None, 0.0)
        c = s.counts
        self.line(f"{name}{where}: {s.status} in {s.duration_s:.1f} s ({c['pass']} passed, {c['fail']} "
                  f"failed, {c['error']} errors, {c['skip']} skipped)")

    def interrupted(self, signals: list[str]) -> None:
        err.print(f"[yellow]interrupted[/] ({', '.join(signals) or 'KeyboardInterrupt'}): writing what was finished")

    def shared_gpu_overlaps(self, overlaps: list[str]) -> None:
        err.print(f"[red]a timed case shared the GPU[/]: {escape(overlaps[0])} (+{len(overlaps) - 1} more; "
                  f"logs/gpu*_share.jsonl)")


def eta(expected_s: float | None, elapsed_s: float, processes: int = 1) -> str:
    """A suite's ETA from the profile's expected duration (one process; ``processes`` share its
    cases): '~40 s left', or how far past it is."""
    if not expected_s:
        return ""
    expected_s = expected_s / processes
    left = expected_s - elapsed_s
    return f"~{left:.0f} s left" if left >= 0 else f"{-left:.0f} s past the profile's ~{expected_s:.0f} s"


def show_verdict(res: dict, run_dir: Path) -> None:
    t = Table("suite", "status", "pass", "fail", "error", "skip", "time (s)", "note", title="suites", title_justify="left")
    for n, s in res["suites"].items():
        c = s["counts"]
        t.add_row(n, styled(s["status"]), str(c["pass"]), str(c["fail"]), str(c["error"]), str(c["skip"]),
                  f"{s['duration_s']:.1f}", escape(s.get("reason", "")))
    err.print(t)
    v = res["verdict"]
    for b in v["blocking"][:20]:
        err.print(f"  [red]✗[/] {escape(b)}")
    if len(v["blocking"]) > 20:
        err.print(f"  … and {len(v['blocking']) - 20} more (report.md lists them all)")
    for name, why in v.get("not_exercised", {}).items():
        err.print(f"  [yellow]○[/] {name} not exercised: {escape(why)}")
    tt = v["totals"]
    level = run_level(res["manifest"])
    err.print(f"VERDICT: {escape(v.get('headline', v['status'].upper()))}{' (strict)' if v['strict'] else ''} · level {level} · {tt['pass']} passed, "
              f"{tt['fail']} failed, {tt['error']} errors, {tt['skip']} skipped · report: {run_dir / 'report.md'}",
              highlight=False)
