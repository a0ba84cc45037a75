"""Suite runner: each suite in its own pytest process with a timeout, records collected.

A CUDA fault, an OOM or a hang kills only that suite's process; the cases it finished are kept
(the plugin appends them as they finish) and the suite is marked ``error`` with the cause.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from nsa_validate import orphans
from nsa_validate.env import interpret
from nsa_validate.suite.context import RunContext
from nsa_validate.paths import REPO_ROOT
from nsa_validate.report.schema import CaseRecord, SuiteResult, suite_status
from nsa_validate.report.extra import SuiteExtra, combined, merged
from nsa_validate.config.registry import SUITES, Suite



def suite_env(ctx: RunContext) -> dict:
    """Environment of a suite process (``interpret.child_env``), on a shard its one GPU, and its
    share of the CPU's threads when the suite runs as several processes. pytest loads no plugin a
    package installed (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``): a suite runs with the project's own
    hooks only (one that reorders or reruns cases would change what is checked), and each of a
    GPU run's fifteen processes would import them at its start."""
    env = interpret.child_env(ctx.device, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    if ctx.workers > 1 and "OMP_NUM_THREADS" not in os.environ:     # the suite's processes share the cores
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // ctx.workers))
    if ctx.gpu_index is not None:      # a shard of `oneshot --gpus`: this suite sees one GPU
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[ctx.gpu_index] if visible else str(ctx.gpu_index)
    return env


def read_records(path: Path, bad: list[str] | None = None,
                 ready: list[float] | None = None) -> tuple[int | None, list[CaseRecord], str | None]:
    """(cases collected, the finished cases, the case running now or None) from a suite's records. A
    line that is not a record (cut short by a dying process, or damaged) is skipped; ``bad`` gets a
    description of each such line but a cut-short last one; ``ready`` each process's start-up, the
    ``ready_s`` of its collection line (its start to its cases' collection)."""
    collected, cases, running = None, [], None
    if not path.exists():
        return None, [], None
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines, 1):
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise ValueError(f"a JSON {type(d).__name__}, not a record")
            if "collected" in d:
                if type(d["collected"]) is not int:
                    raise ValueError(f"collected: {d['collected']!r} is not a count")
                collected = d["collected"]
                if ready is not None and isinstance(d.get("ready_s"), (int, float)):
                    ready.append(float(d["ready_s"]))
            elif "running" in d:
                running = d["running"] if isinstance(d["running"], str) else None
            else:
                cases.append(CaseRecord(**d))
                running = None
        except (ValueError, TypeError) as e:
            if bad is not None and not (i == len(lines) and isinstance(e, json.JSONDecodeError)):
                bad.append(f"line {i}: {str(e).splitlines()[0][:200]}")
    return collected, cases, running


def kill(p) -> None:
    """Kill a suite process's group (it leads one) unless it has ended, and wait for its exit code. ``p``: a
    ``subprocess.Popen`` or a fork server's ``Forked``. A forked child is reaped by the server, which says so
    later: it can be gone, its group with it, while ``poll`` still says it runs (a ``--timeout 1`` run's
    one-second suite met this in CI: ESRCH from ``killpg`` ended the run as "error: No such process")."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def run_suite(suite: Suite, ctx: RunContext, run_dir: Path,
              on_progress: Callable[[list[CaseRecord], int | None, str | None], None] = lambda done, total, running: None,
              should_stop: Callable[[], bool] = lambda: False, server=None) -> SuiteResult:
    """One suite as ``ctx.workers`` pytest processes: with more than one, each takes the next case
    from a shared counter (``suite/claim.py``) and all append to one records file; the first
    process logs to ``logs/<suite>.log``, the k-th to ``logs/<suite>.<k>.log``. ``server``: a
    ``forkserver.Server`` to fork them from (where it cannot, each is started as a new process)."""
    ctx_path = run_dir / "suites" / f"{suite.name}.context.json"
    rec_path = run_dir / "suites" / f"{suite.name}.records.jsonl"
    ctx.out_dir = str(run_dir / "suites" / suite.name)
    # the process that starts them: a suite process dies with it (``plugin._watch_parent``)
    ctx.parent_pid = server.proc.pid if server is not None and not server.ended else os.getpid()
    Path(ctx.out_dir).mkdir(parents=True, exist_ok=True)
    ctx.save(ctx_path)
    cmd = [sys.executable, "-m", "pytest", str(suite.path), "-q", "-rfEs", "-p", "no:cacheprovider",
           "--rootdir", str(REPO_ROOT), "--nsa-context", str(ctx_path), "--nsa-records", str(rec_path),
           *(["-k", ctx.select] if ctx.select else [])]
    if ctx.workers > 1:
        cmd += ["--claim-from", str(run_dir / "suites" / f"{suite.name}.claim")]
    timeout = ctx.timeout_s or ctx.profile.timeout(suite.name)
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    env = suite_env(ctx)
    problem = ""
    interrupted = False
    try:
        for k in range(ctx.workers):
            log_path = run_dir / "logs" / (f"{suite.name}.log" if not k else f"{suite.name}.{k}.log")
            one = cmd + (["--nsa-worker", str(k)] if ctx.workers > 1 else [])
            with open(log_path, "w") as log:
                log.write("$ " + " ".join(one) + "\n")
                log.flush()
                forked = server.spawn(one[3:], env, log_path) if server is not None else None
                procs.append(forked or subprocess.Popen(one, cwd=REPO_ROOT, env=env, stdout=log,
                                                        stderr=subprocess.STDOUT, start_new_session=True,
                                                        preexec_fn=orphans.die_with_parent()))
        while any(p.poll() is None for p in procs):
            time.sleep(0.3)
            total, done, running = read_records(rec_path)
            on_progress(done, total, running)
            if time.monotonic() - t0 > timeout:
                problem = f"timed out after {timeout}s"
                break
            if should_stop():
                problem = "interrupted"
                break
    except KeyboardInterrupt:      # keep the cases this suite finished; the caller re-raises
        problem, interrupted = "interrupted", True
    finally:
        for p in procs:
            kill(p)
        for f in (run_dir / "suites").glob(f"{suite.name}.claim*"):    # the processes' shared counter
            f.unlink(missing_ok=True)
    codes = [p.returncode for p in procs]
    killed = next((rc for rc in codes if rc is not None and rc < 0), None)
    odd = next((rc for rc in codes if rc not in (0, 1, 5)), None)     # pytest: 0 ok, 1 failures, 5 nothing collected
    rc = killed if killed is not None else odd if odd is not None else max(codes, default=None)
    total, cases, _ = read_records(rec_path)
    if not problem:
        if killed is not None:
            problem = f"process killed by signal {signal.Signals(-killed).name}"
        elif odd is not None:
            problem = f"pytest exited with code {odd} (collection or internal error)"
        elif total is None:         # its plan was never written: it ended while importing or collecting
            problem = f"the suite's process ended (exit code {rc}) before it had collected its cases: nothing ran"
        elif total == 0 and not ctx.select:
            problem = "the suite collected no case (a suite with nothing to run at this level still has its placeholders)"
        elif len(cases) < total:
            problem = f"process ended after {len(cases)} of {total} cases"
    result = suite_result(suite.name, run_dir, problem, round(time.monotonic() - t0, 2), rc)
    if interrupted:
        raise SuiteInterrupted(result)
    return result


# matplotlib (a summary's plots) is not thread-safe: two suites that ended together and summarised at
# once on the runner's threads failed inside its mathtext parser (pyparsing), so one at a time
_SUMMARISING = threading.Lock()


def suite_result(name: str, run_dir: Path, problem: str = "", duration_s: float = 0.0,
                 returncode: int | None = None) -> SuiteResult:
    """A suite's result from what its process left in the run folder: the case records, and the
    tables and notes it saved (``extra.json``). ``problem``: why the process ended early, if it did
    (an error case says so)."""
    bad: list[str] = []
    ready: list[float] = []
    total, cases, _ = read_records(run_dir / "suites" / f"{name}.records.jsonl", bad, ready)
    if bad:
        cases.append(CaseRecord("suite-records", name, "error", f"{len(bad)} malformed line(s) in "
                                f"suites/{name}.records.jsonl were skipped, {bad[0]}"))
    if problem:
        cases.append(CaseRecord("suite-process", name, "error", f"{problem}; see logs/{name}.log"))
    out_dir = run_dir / "suites" / name
    parts = []
    for path in sorted(out_dir.glob("extra*.json")):      # extra.json, then extra.1.json, … of its processes
        try:
            parts.append(json.loads(path.read_text()))
        except (OSError, ValueError):     # cut short by a process killed while writing it
            pass
    extra = combined(parts) if parts else {}
    summarise = SUITES[name].summarise if name in SUITES else None
    ctx_path = run_dir / "suites" / f"{name}.context.json"
    if summarise is not None and ctx_path.exists():
        summary = SuiteExtra(str(out_dir), "summary.json")
        try:
            with _SUMMARISING:
                summarise(cases, RunContext.load(ctx_path), summary)
        except Exception as e:         # a summary that cannot be made is the suite's error, not the run's end
            cases.append(CaseRecord("summary", name, "error", f"the suite's summary failed: {type(e).__name__}: {e}"))
            problem = problem or "summary failed"
        extra = merged(extra, summary.data)
    return SuiteResult(name, suite_status(cases, problem), duration_s, cases, reason=problem,
                       log=f"logs/{name}.log", returncode=returncode, extra=extra,
                       startup_s=round(max(ready), 2) if ready else None)


class SuiteInterrupted(KeyboardInterrupt):
    """Ctrl-C / SIGTERM during a suite: carries what that suite finished."""

    def __init__(self, result: SuiteResult) -> None:
        super().__init__("interrupted")
        self.result = result
