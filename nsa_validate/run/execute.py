"""``execute``: one run from request to finished run folder.

Profile and device (``profiles.resolve``), the run folder and its manifest, the suites (each its own
pytest process: ``runner.run_suite``) one after another, at once on a GPU (``gpu_share``), or sharded
over GPUs, started beside the environment check; SIGINT/SIGTERM/SIGHUP stop it cleanly.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from nsa_validate import __version__, pycache, startup
from nsa_validate.config import profiles
from nsa_validate.env import envcheck, interpret
from nsa_validate.run import compare, forkserver, prewarm, rundir
from nsa_validate.suite import gpu_share
from nsa_validate.suite.context import RunContext
from nsa_validate.errors import UsageError
from nsa_validate.config.registry import SUITES
from nsa_validate.run.finish import finish, mark_failed
from nsa_validate.run.listener import Held, Listener
from nsa_validate.run.stop import Stop
from nsa_validate.run.runner import SuiteInterrupted, run_suite
from nsa_validate.report.schema import CaseRecord, SuiteResult, write_json


@dataclass
class RunRequest:
    """What the user asked for (``suite`` / ``oneshot`` options), typed; recorded in the manifest."""
    suites: list[str]
    profile: str | None = None            # name or path; None: the one for this machine's GPU
    level: str = profiles.DEFAULT_LEVEL
    out: str | None = None                # root of run folders; None: ./artifacts
    strict: bool = False
    gate_env: bool = False                # a broken environment stops the suites, none counts (oneshot)
    allowed_skips: dict[str, str] = field(default_factory=dict)
    baseline: dict | None = None          # ``compare.load``: gate timings and statuses against it
    max_regression: float = compare.DEFAULT_MAX_REGRESSION_PCT
    n_gpus: int = 1
    share_gpu: bool | None = None         # None: at once on a GPU, one after another on a CPU
    select: str | None = None             # pytest -k for every suite
    timeout: int | None = None            # seconds per suite instead of the profile's
    workers: int | None = None            # pytest processes per suite; None: from the machine's cores
    node: str | None = None               # the node's name (manifest, folder name); None: the host name


@dataclass
class Outcome:
    run_dir: Path
    status: str                           # complete | interrupted | env-broken
    results: dict                         # results.json's content


def check_select(expr: str | None) -> None:
    """``-k``: an expression pytest can parse (it would fail every suite otherwise); UsageError."""
    if expr is None:
        return
    try:
        from _pytest.mark.expression import Expression    # pytest's own -k parser
    except ImportError:                                  # (private: where it moves, the suites report it)
        return
    try:
        Expression.compile(expr)
    except Exception as e:                               # noqa: BLE001  (ParseError, across pytest versions)
        raise UsageError(f"-k {expr!r} is not a pytest expression ({str(e).splitlines()[0]})") from None


def execute(req: RunRequest, listener: Listener | None = None, stop: Stop | None = None) -> Outcome:
    """Run ``req``; ``listener`` hears of each step. An OSError (a full disk) marks the folder
    ``error: <why>`` and propagates. ``stop``: signal handling the caller installed already (before it
    imported torch: a signal there would be lost); a signal before the run folder exists raises
    KeyboardInterrupt and leaves no folder."""
    t_start, started = time.monotonic(), startup.process_age()
    # bad input (a named profile that does not load, a -k pytest cannot parse, an --out that cannot be
    # written) is reported before any process starts
    named = profiles.load(req.profile, req.level) if req.profile else None
    check_select(req.select)
    root = rundir.check_out(req.out)
    early = _start_warming(req)
    server = _start_forkserver(req)
    try:
        with contextlib.nullcontext(stop) if stop is not None else Stop() as stop:
            return _execute(req, named, root, listener or Listener(), stop, t_start, started, early, server)
    finally:
        if server is not None:
            server.close()
        if early is not None:
            early.close()


def _execute(req: RunRequest, named: profiles.Profile | None, root: Path, listener: Listener, stop: Stop,
             t_start: float, started: float | None, early: prewarm.Prewarm | None,
             server: forkserver.Server | None) -> Outcome:
    """``execute`` once the input is checked: ``named`` is ``--profile``'s profile as read then (None: the
    GPU's), ``root`` is ``--out``'s folder (``rundir.check_out``)."""
    node = rundir.node_name(req.node)
    prof, device = profiles.resolve(req.profile, req.level, loaded=named)
    if server is not None and device != server.device:      # its imports were made for another device
        server.close()
        server = None
    warming, warm_note = _prewarm(req, prof, device, t_start, early)
    t_profile = time.monotonic()
    listener.profile_resolved(prof)
    rep = t_env = None
    if req.baseline is not None:       # a baseline from another machine is refused before anything runs
        rep, t_env = envcheck.collect(wait=False), time.monotonic()
        compare.check_same_machine(compare.key_of(rep.to_dict(), prof.name, prof.level, req.select), req.baseline)
    git = rundir.git_info()
    if stop.is_set():                  # before anything was written: nothing to keep
        raise KeyboardInterrupt
    run_dir = rundir.create(root, git, node)
    names = req.suites
    shards = shard(names, prof, req.n_gpus)
    # on a GPU the suites run at once by default (their compiles overlap; timed cases run alone);
    # on a CPU they would only compete for its cores
    share_gpu = (device == "cuda" and len(names) > 1) if req.share_gpu is None else req.share_gpu
    workers = plan_workers(shards, prof, device, req.share_gpu, req.workers)
    if device == "cuda" and req.share_gpu is None and any(w > 1 for w in workers.values()):
        share_gpu = True               # a suite's processes share its GPU: its timed cases take the lock
    manifest = {"run_id": f"{run_dir.parent.name}/{run_dir.name}", "commit": git["commit"], "dirty": git["dirty"],
                "command": ["nsa-validate", *sys.argv[1:]], "profile": prof.name, "profile_source": prof.source,
                "level": prof.level, "tool_version": __version__,
                "device": device, "strict": req.strict, "suites": names, "started": rundir.utc_now(),
                "ended": None, "status": "running", "allowed_skips": req.allowed_skips,
                # who runs it: a folder left "running" by a process that is gone is stale (``repair``)
                "pid": os.getpid(), "host": socket.gethostname(), "process": rundir.process_identity(os.getpid()),
                "node": node,         # --node (a scheduler's node name), else the host: merge groups runs by it
                "gpus": {n: i for i, queue in enumerate(shards) for n in queue} if req.n_gpus > 1 else None,
                "share_gpu": share_gpu, "workers": workers, "select": req.select, "timeout_s": req.timeout,
                "bytecode": pycache.state(), **({"prewarm": warm_note} if warm_note else {})}
    if prof.device == "cuda" and device != "cuda":
        manifest["note"] = f"profile {prof.name} asks for a GPU but none is visible: GPU-only cases skip"
    results: dict[str, SuiteResult] = {}
    status = "complete"
    threads: list[threading.Thread] = []
    preload: threading.Thread | None = None
    # the suites start now, beside the environment check (on a fresh pod's first run it reads torch's,
    # Triton's and flash-attn's libraries from disk: seconds); their events are shown once its report is.
    # A broken environment stops them (``gate_env``) and nothing they did counts
    held, broken = Held(listener), threading.Event()
    halt = _Either(stop.event, broken)
    suites: _Background | None = None
    t_suites = time.monotonic()
    try:
        write_json(run_dir / "manifest.json", manifest)
        listener.run_started(run_dir)
        if not stop.is_set():
            locks = warming.locks if warming is not None else run_dir / ".compile"
            preload = _preload_reporting(any(SUITES[n].summarise for n in names if n in SUITES))
            t_suites = time.monotonic()
            alive = str(warming.alive) if warming is not None else None
            suites = _Background(lambda: _run_suites(req, prof, device, run_dir, manifest, git, shards, share_gpu,
                                                     workers, results, held, halt, locks, server, alive))
        if rep is None:
            rep = envcheck.collect(wait=False)     # PyTorch's own report finishes beside the suites (``complete``)
            t_env = time.monotonic()
        write_json(run_dir / "env.json", rep.to_dict())
        listener.env_checked(rep)
        if req.gate_env and rep.verdict == "broken":
            status = "env-broken"
            broken.set()
            if suites is not None:
                suites.wait(reraise=False)
            results.clear()
            listener.env_broken()
        elif suites is not None:
            with listener.suites_running():
                held.release()
                threads = suites.wait()
    except KeyboardInterrupt as e:     # not from our signals (they only set the flag); kept as a last resort
        if isinstance(e, SuiteInterrupted):
            results[e.result.name] = e.result
        stop.event.set()
    except OSError as e:
        if suites is not None:         # its suite processes killed, what they did not counted
            broken.set()
            suites.wait(reraise=False)
        if warming is not None:
            warming.summary(run_dir)   # stops its processes; its record kept where the disk still allows
        mark_failed(run_dir, manifest, e)
        _joined(preload)
        raise
    if stop.is_set():
        status = "interrupted"
        if suites is not None and not threads:     # stopped before the run waited for them (during the env check)
            suites.wait(reraise=False)
        for th in threads:             # each shard kills its suite process and returns
            th.join(timeout=60)
        listener.interrupted(list(dict.fromkeys(stop.signals)))
    # where the wall time went: the process's start to this run's (Python, the CLI's imports), the profile's
    # resolution (torch's import, the GPU's start) with the environment check, of which the profile's, and
    # the suites, from when they started (beside the environment check, unless a baseline had it first)
    manifest["phases_s"] = {**({"start": round(started, 2)} if started is not None else {}),
                            "env": round((t_env or time.monotonic()) - t_start, 2),
                            "profile": round(t_profile - t_start, 2),
                            "suites_from": round(t_suites - t_start, 2),
                            "suites": round(time.monotonic() - t_suites, 2)}
    if warming is not None:
        manifest["prewarm"] = {**warm_note, **warming.summary(run_dir)}
        manifest["phases_s"]["prewarm"] = manifest["prewarm"]["wall_s"]
    shutil.rmtree(run_dir / ".compile", ignore_errors=True)     # the compile locks (compile_once)
    if share_gpu:                  # who held each GPU when: kept under logs/, and checked
        bad = manifest["gpu_share_overlaps"] = gpu_share.collect(run_dir)
        if bad:
            listener.shared_gpu_overlaps(bad)
        held = gpu_share.alone(run_dir)          # the timed cases, each alone on its GPU
        if held:
            manifest["gpu_alone_s"] = held
            manifest["phases_s"]["alone"] = round(sum(held.values()), 2)
        if warming is not None and warming.last_end is not None:
            # alone on the GPU while the warming processes compiled (cases that time nothing, or GPU-bound work
            # only: ``gpu_share``)
            manifest["prewarm"]["alone_beside_s"] = gpu_share.alone(run_dir, until=warming.last_end)
    for name in names:
        if name not in results and status != "env-broken":
            results[name] = SuiteResult(name, "skip", reason=f"not run: {status}",
                                        cases=[CaseRecord("not-run", name, "skip", f"run {status}", placeholder=True)])
    results = {n: results[n] for n in names if n in results}
    _joined(preload)
    try:
        if rep.pending is not None:    # the report env.json was written with, now with PyTorch's own
            write_json(run_dir / "env.json", rep.complete(timeout=5 if status == "interrupted" else 60).to_dict())
        res = finish(run_dir, manifest, rep.to_dict(), prof, results, req.strict, status, req.allowed_skips,
                     req.baseline, req.max_regression)
    except OSError as e:
        mark_failed(run_dir, manifest, e)
        raise
    return Outcome(run_dir, status, res)


class _Either:
    """Set when either event is: what the suites poll (a signal, or the environment found broken)."""

    def __init__(self, *events: threading.Event) -> None:
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


class _Background:
    """``fn()`` on a thread of its own from now; ``wait`` returns its value, or raises what it raised."""

    def __init__(self, fn) -> None:
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn,), name="suites", daemon=True)
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            self.value = fn()
        except BaseException as e:     # noqa: BLE001  raised again by ``wait`` on the caller's thread
            self.error = e

    def wait(self, reraise: bool = True):
        while self.thread.is_alive():  # in short joins: a signal's handler runs on this (the main) thread
            self.thread.join(0.2)
        if self.error is not None and reraise:
            raise self.error
        return self.value


def _run_suites(req, prof, device, run_dir, manifest, git, shards, share_gpu, workers, results, listener, stop,
                locks, server=None, warming=None):
    """Every suite, on the threads the sharing mode asks for; returns those threads. ``stop``: polled
    (``is_set``); once set, each suite kills its processes and keeps what they finished."""
    def work(queue: list[str], gpu_index: int | None, lock: str | None = None) -> None:
        for name in queue:
            if stop.is_set():
                return
            where = f" gpu{gpu_index}" if gpu_index is not None else ""
            t_suite = time.monotonic()
            listener.suite_started(name, where, workers[name])

            def progress(done, total, running=None):
                listener.suite_progress(name, done, total, running, time.monotonic() - t_suite)
            # sharing a GPU, a suite may wait for every other suite's timed cases: its limit is
            # then the whole GPU queue's (the time they would take one by one)
            limit = req.timeout or (sum(prof.timeout(n) for n in shards[gpu_index or 0]) if lock else None)
            ctx = RunContext(profile=prof, device=device, strict=req.strict, gpu_index=gpu_index, gpu_lock=lock,
                             select=req.select, timeout_s=limit, run_id=manifest["run_id"],
                             commit=rundir.commit_label(git), gpu_name=_gpu_name(device, gpu_index),
                             workers=workers[name], compile_locks=str(locks), warming=warming,
                             launch_log=str(run_dir / "kernels.jsonl") if device == "cuda" else None)
            results[name] = run_suite(SUITES[name], ctx, run_dir, progress, stop.is_set, server)
            listener.suite_finished(name, where, results[name])

    n_gpus = req.n_gpus
    if share_gpu:      # every suite at once; each case holds its GPU's lock (gpu_share)
        jobs = [([n], None if n_gpus == 1 else i, gpu_share.lock_path(run_dir, i))
                for i, q in enumerate(shards) for n in q]
    elif n_gpus == 1:
        jobs = [(shards[0], None, None)]
    else:              # one thread per GPU, each running its suites one after another
        jobs = [(q, i, None) for i, q in enumerate(shards)]
    if len(jobs) == 1 and not jobs[0][2]:
        work(*jobs[0])
        return []
    # sharing: hold each GPU's lock until all its suite processes have started (gpu_share)
    starting = {lock: gpu_share.acquire(lock, exclusive=False, queued=False)
                for lock in dict.fromkeys(j[2] for j in jobs if j[2])}
    threads = [threading.Thread(target=work, args=j, daemon=True) for j in jobs]
    for th in threads:
        th.start()
    t0 = time.monotonic()
    while any(th.is_alive() for th in threads):
        for lock in list(starting):
            mine = [(th, workers[j[0][0]]) for th, j in zip(threads, jobs) if j[2] == lock]
            ended = sum(w for th, w in mine if not th.is_alive())
            if gpu_share.started(lock) + ended >= sum(w for _, w in mine) or time.monotonic() - t0 > 300:
                gpu_share.release(starting.pop(lock))
        time.sleep(0.2)
    for fd in starting.values():
        gpu_share.release(fd)
    return threads


def _preload_reporting(plots: bool) -> threading.Thread:
    """Import what the report and the suites' summaries need once the suites are done (pandas; with
    ``plots``, a summary's, matplotlib with its Agg backend, whose first import on a fresh machine builds
    its font cache) on a thread while they run, when this process only waits: not after them, when the
    run's end waits for it. The run joins it before it ends (``_joined``): a process that left it behind
    could cut matplotlib's font cache short, and every later import would pay for it."""
    def load() -> None:
        try:
            import pandas  # noqa: F401
            if plots:
                import matplotlib
                matplotlib.use("Agg")
                import matplotlib.pyplot  # noqa: F401
        except Exception:  # noqa: BLE001  the summary that needs it reports it
            pass
    th = threading.Thread(target=load, name="preload-reporting", daemon=True)
    th.start()
    return th


def _joined(th: threading.Thread | None) -> None:
    if th is not None:
        th.join(timeout=120)


def _start_forkserver(req: RunRequest) -> forkserver.Server | None:
    """The process the suites' processes are forked from (``forkserver``), started now for the device a
    run here most likely uses, so that its imports overlap the run's own; None where there are no suites
    or it cannot be started (each suite process is then started on its own)."""
    if not req.suites or not sys.platform.startswith("linux"):    # forks after torch's import: Linux only
        return None
    device = forkserver.devices_present()
    try:
        return forkserver.Server(interpret.child_env(device, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"), device)
    except OSError:
        return None


def _start_warming(req: RunRequest) -> prewarm.Prewarm | None:
    """The warming's first process, started now, importing torch and Triton while this one does
    (``_prewarm`` tells it the list later), where the run may warm; None where it may not, or where the
    process or its scratch folder cannot be made (the suites then compile what they need)."""
    if not prewarm.may_warm(req.select, req.level):
        return None
    try:
        return prewarm.Prewarm()
    except OSError:
        return None


def _prewarm(req: RunRequest, prof: profiles.Profile, device: str, t_start: float,
             early: prewarm.Prewarm | None) -> tuple[prewarm.Prewarm | None, dict]:
    """On a GPU, the profile's launch list compiled on the machine's cores (less one, this process's)
    from now, by ``early``'s processes (started when the run was); not for a ``-k`` selection, which
    needs a few of its kernels at most, nor where an earlier run compiled the list into this Triton
    cache (``prewarm.warm_marker``). Returns the warming (None: none) and what the manifest says of it."""
    kernels = prewarm.list_for(prof.name, prof.level) if device == "cuda" else None
    if kernels is None:
        why = None
    elif req.select:
        why = "-k selects the cases: they compile what they need"
    elif prewarm.warm_marker(kernels).exists():
        why = "an earlier run compiled the list into this cache"
    elif early is None:
        why = ("its process was not started with the run (no NVIDIA device node, /dev/nvidiactl or /dev/dxg, "
               "or no room for the process)")
    else:
        why = None
    if kernels is None or why:
        if early is not None:
            early.close()
        return None, prewarm.Prewarm.skipped(kernels, why) if why else {}
    early.go(kernels, len(os.sched_getaffinity(0)) - 1)
    # from the run's start (before the env check); the summary adds the rest when the suites are done
    return early, {"list": prewarm.shown(kernels), "started_s": round(early.t0 - t_start, 2)}


def _gpu_name(device: str, gpu_index: int | None) -> str | None:
    if device != "cuda":
        return None
    import torch
    return torch.cuda.get_device_name(gpu_index or 0)


MAX_WORKERS = 8        # processes per suite: beyond this, a suite's longest cases bound it anyway


def plan_workers(shards: list[list[str]], prof: profiles.Profile, device: str, share_gpu: bool | None,
                 asked: int | None) -> dict[str, int]:
    """Pytest processes per suite (``asked``, or from the cores). Triton compiles on the CPU, so a
    cold GPU run is bound by its cores, not its GPU: on a GPU the cores (less one for this process)
    are split among the suites sharing each GPU by the profile's expected time (at least one each),
    and a suite's cases are taken in turn by its processes; their timed cases still run alone on
    the GPU (``gpu_share``). On a CPU (suites one after another) each suite gets every core. On a GPU
    told ``--one-at-a-time`` one process each: nothing would keep a timed case alone."""
    names = [n for q in shards for n in q]
    if device == "cuda" and share_gpu is False:
        if asked and asked > 1:
            raise UsageError(f"--workers {asked} on a GPU needs --share-gpu: its processes' timed cases take the GPU's "
                             f"lock to run alone, which --one-at-a-time does without")
        return {n: 1 for n in names}
    if asked is not None:
        return {n: asked for n in names}
    cores = len(os.sched_getaffinity(0))
    if device != "cuda":
        return {n: max(1, min(MAX_WORKERS, cores)) for n in names}
    out = {}
    budget = max(1, (cores - 1) // len(shards))
    for q in shards:
        # one each, then core by core to the suite that would take longest (expected time / processes)
        expect = {n: prof.suites.expected_s.get(n) or prof.timeout(n) for n in q}
        w = {n: 1 for n in q}
        for _ in range(budget - len(q)):
            open_ = [n for n in q if w[n] < MAX_WORKERS]
            if not open_:
                break
            n = max(open_, key=lambda n: expect[n] / w[n])
            w[n] += 1
        out.update(w)
    return out


def shard(names: list[str], prof: profiles.Profile, n_gpus: int) -> list[list[str]]:
    """Suites per GPU: longest first (the profile's timeouts as the estimate) to the least loaded GPU;
    each queue keeps the suites' listed order."""
    load, queues = [0] * n_gpus, [[] for _ in range(n_gpus)]
    for name in sorted(names, key=lambda n: -prof.timeout(n)):
        i = load.index(min(load))
        load[i] += prof.timeout(name)
        queues[i].append(name)
    return [[n for n in names if n in q] for q in queues]
