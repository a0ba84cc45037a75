"""pytest plugin behind every suite: the run context, the ``record`` fixture, case records.

Loaded by ``suites/conftest.py``. Each finished case is appended as one JSON line to the file
given by ``--nsa-records`` as soon as it finishes, so a suite process that dies half-way still
leaves the records of the cases it finished (the runner turns the death into an ``error``).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from contextlib import contextmanager, nullcontext

import pytest

from nsa_core import routing
from nsa_core.routing import DispatchLog
from nsa_validate import startup
from nsa_validate.measure import evidence, limits, phases, tolerance
from nsa_validate.suite import context
from nsa_validate.suite.context import RunContext
from nsa_validate.report.extra import SuiteExtra


class Recorder:
    """Per-case metrics, and the evidence of which backend executed."""

    def __init__(self) -> None:
        self.metrics: dict = {}
        self.backends: dict = {}
        self.kernels: dict = {}
        self.routes: dict = {}
        self._klog: evidence.KernelLog | None = None
        self._failures: list[str] = []

    @contextmanager
    def capture(self):
        """What ran inside the block: the dispatch log (yielded) and, on a GPU, the CUDA kernels
        the device executed, which ``expect_ran`` then also asserts by name."""
        with routing.capture() as log, evidence.observe(context.current().device) as klog:
            yield log
        self._klog = klog
        for (phase, branch), ds in log.decisions.items():
            key = f"{phase}/{branch}"
            self.routes[key] = sorted(set(self.routes.get(key, [])) | ds)
        # every path the dispatch log saw run, not only those the case asserts: the kernels seen in a
        # path's range are then filed under the backend that ran there (routing.json)
        for phase, branch, backend in log.counts:
            self._ran(f"{phase}/{branch}", [backend])
        for key, names in klog.by_range.items():
            self._saw(key, names)

    def _ran(self, key: str, backends) -> None:
        self.backends[key] = sorted(set(self.backends.get(key, [])) | set(backends))

    def _saw(self, key: str, names) -> None:
        """Add kernel names to what this case observed for ``key`` (a case may observe several blocks)."""
        self.kernels[key] = sorted(set(self.kernels.get(key, [])) | {evidence.short(n) for n in names})

    def expect_ran(self, log: DispatchLog, phase: str, branch: str, backend: str) -> None:
        """Record what ran; fail the case if ``backend`` did not execute ``phase/branch``."""
        for br, bes in log.backends(phase).items():
            self._ran(f"{phase}/{br}", bes)
        assert log.ran(phase, branch, backend) > 0, (
            f"path under test did not run: {phase}/{branch} on {backend}; ran: {log.backends(phase) or 'nothing'}")
        family = evidence.family(phase, branch, backend)
        if family and self._klog is not None and self._klog.active:
            key = f"{phase}/{branch}"
            self.expect_kernels(self._klog, key, family, in_range=key in self._klog.by_range)

    def expect_kernels(self, log: evidence.KernelLog, key: str, expect: str, in_range: bool = False) -> None:
        """On a GPU: record the CUDA kernels observed for ``key`` and fail the case unless one of
        them is of the ``expect`` family (``evidence.EXPECT``). With ``in_range`` those are the
        kernels of the branch's range; without (Triton launches, which the profiler attributes to
        no range) only the block's kernels of that family: the block's other kernels (a layer's
        projections around a step, say) are not this path's. On a CPU nothing is observed."""
        if not log.active:
            return
        names = log.by_range.get(key, {}) if in_range else log.names
        own = log.matching(expect, key if in_range else None)
        self._saw(key, names if in_range else own)
        assert own, (
            f"the GPU ran no {expect} kernel for {key} (expected /{evidence.EXPECT[expect]}/); it ran: "
            f"{', '.join(sorted(evidence.short(n) for n in names)) or 'no kernel'}")

    def timing(self, name: str, t, *, nbytes: float | None = None, flops: float | None = None) -> dict:
        """Record a ``timing.Timing`` with the least work it did (bytes it must move, FLOPs it must
        do); fail the case at once if the hardware cannot do that in that time (``limits``)."""
        summary = t.summary()
        summary.update(limits.achieved(summary, nbytes, flops))
        self.metrics[name] = summary
        ctx = context.current()
        ceil = limits.ceilings(ctx.device if t.timer != "cpu" else "cpu", ctx.expect.peak_tflops)
        bad = limits.implausible(summary, nbytes, flops, ceil)
        assert not bad, f"implausible measurement (timing bug?): {name}: {'; '.join(bad)}"
        return summary

    def check(self, name: str, out, ref32, ref_lp, *, dtype, factor: float = 2.0,
              no_rel_rms_bar_because: str | None = None) -> dict:
        """Compare with the fp32 oracle (tolerance rule); failures are raised by ``assert_ok``.
        ``no_rel_rms_bar_because``: judge by max-abs alone, and record why."""
        m = tolerance.compare(out, ref32, ref_lp, dtype=dtype, factor=factor,
                              apply_rel_rms_bar=no_rel_rms_bar_because is None)
        if no_rel_rms_bar_because:
            m["rel_rms_bar_not_applied"] = no_rel_rms_bar_because
        self.metrics[name] = {k: v for k, v in m.items() if k != "factor"}
        if not m["ok"]:
            self._failures.append(f"{name}: {tolerance.explain(m)}")
        return m

    def assert_ok(self) -> None:
        assert not self._failures, "; ".join(self._failures)


def no_sizes(suite: str, field: str) -> str:
    """The skip reason of a case the profile gives no sizes for, naming the field."""
    return f"profile '{context.current().profile.name}' sets no sizes for this case (suites.{suite}.{field})"


def profile_cases(params: list, suite: str, field: str, n_args: int) -> list:
    """The parametrized cases, or one skipped case naming the profile field that left them out
    (a size the profile does not set is reported, never silently missing)."""
    if params:
        return params
    why = no_sizes(suite, field)
    return [pytest.param(*([None] * n_args), id="not-in-profile",
                         marks=[pytest.mark.skip(reason=why), pytest.mark.nsa_placeholder])]


_RECORDERS: dict[str, Recorder] = {}
_STATE: dict[str, dict] = {}


def pytest_addoption(parser) -> None:
    g = parser.getgroup("nsa-validate")
    g.addoption("--nsa-context", default=None, help="RunContext JSON written by nsa-validate")
    g.addoption("--nsa-records", default=None, help="append case records (JSON lines) here")
    g.addoption("--nsa-worker", type=int, default=0,
                help="this process's number among the suite's processes (with --claim-from): its extra file")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "nsa_placeholder: a stand-in case (e.g. no sizes in the profile), never counted")
    config.addinivalue_line("markers", "nsa_exclusive(beside_warming=False): times the GPU, reads its counters or "
                                       "needs much of its memory: runs alone on it when suites share a GPU, and "
                                       "after the run's warming unless it times nothing or waits for it itself "
                                       "(the quiet fixture; nsa_validate.suite.gpu_share)")
    path = config.getoption("--nsa-context")
    level = config.getoption("--nsa-level", default=None)
    if level and not path:                # a plain pytest at a chosen level (the CLI's context names its own)
        context.set_current(context.default(level))
    if path:
        ctx = RunContext.load(path)
        context.set_current(ctx)
        # only as the runner starts us (its child, leading our own process group): a person
        # re-running the logged command must not have their shell's group killed
        if ctx.parent_pid and os.getppid() == ctx.parent_pid and os.getpgrp() == os.getpid():
            _watch_parent(ctx.parent_pid)
        if ctx.gpu_lock:
            from nsa_validate.suite import gpu_share
            _STARTUP.append(gpu_share.announce(ctx.gpu_lock))
        if ctx.compile_locks:           # the run's other processes compile a kernel once for all
            from nsa_validate.suite import compile_once
            compile_once.install(ctx.compile_locks)
        if ctx.launch_log:              # what this process compiled: a later run's prewarm list
            from nsa_validate.suite import launches
            launches.record(ctx.launch_log, Path(ctx.out_dir).name)
        phases.install(ctx.device)      # where each case's time goes: compile (the wait included), oracle, bench, run


_STARTUP: list[int] = []        # the GPU lock held shared from start-up to the first case


def _watch_parent(pid: int) -> None:
    """Kill this suite's process group once the nsa-validate process that started it is gone
    (SIGKILL or SIGHUP of the parent: nothing else would stop a suite holding the GPU until its
    timeout). The runner also asks Linux for this (PR_SET_PDEATHSIG); this covers the rest."""
    import os
    import signal
    import threading
    import time

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(0.5)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    threading.Thread(target=watch, name="nsa-parent-watch", daemon=True).start()


def _skipped(item) -> bool:
    """A case skipped before it starts (a placeholder included): it touches no GPU."""
    return bool(item.get_closest_marker("skip") or item.get_closest_marker("nsa_placeholder") or any(
        m.args and m.args[0] is True for m in item.iter_markers("skipif")))


def _gpu_lock(item) -> str | None:
    """The GPU lock this case takes part in; None: alone on the GPU, or a case skipped before it
    starts (a placeholder waiting for an exclusive hold only delays its suite)."""
    return None if _skipped(item) else context.current().gpu_lock


def _exclusive(item) -> bool:
    return item.get_closest_marker("nsa_exclusive") is not None


@contextmanager
def _hold(item, exclusive: bool, phase: str = "", release_memory: bool = False):
    """The case's GPU lock for the block (nothing when ``_gpu_lock`` says none; yields
    ``gpu_share.hold`` or None); the suite's start-up hold ends at its first hold.
    ``release_memory``: the memory the case cached goes back to the GPU before the lock does: other
    suites' cases need it, and a timed case squeezed for memory measures the allocator's retries (a
    64k layer forward: 1.2x dense instead of 2.3x while five other suite processes kept 65 GiB cached)."""
    path = _gpu_lock(item)
    if not path:
        yield None
        return
    from nsa_validate.suite import gpu_share
    while _STARTUP:
        gpu_share.release(_STARTUP.pop())
    with gpu_share.hold(path, exclusive=exclusive, what=item.nodeid + (f" ({phase})" if phase else "")) as h:
        yield h
        if release_memory:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With other suites on this GPU, a parity case (setup to teardown) holds the GPU's lock shared."""
    if _exclusive(item):
        yield
        return
    with _hold(item, exclusive=False, release_memory=True):
        yield


# An ``nsa_exclusive`` case holds the lock per phase: its fixtures (inputs, and the compile warm-ups a
# timed case asks for) run beside other suites' parity cases; only its body runs alone on the GPU. Its
# setup also starts the kernel watcher once in the process (``evidence.ready``), which the body uses.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    if not _exclusive(item):
        yield
        return
    with _hold(item, exclusive=False, phase="setup"):
        if not _skipped(item):
            evidence.ready(context.current().device)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if not _exclusive(item):
        yield
        return
    from nsa_validate.suite import gpu_share
    warming = None if _skipped(item) else context.current().warming
    if warming and not item.get_closest_marker("nsa_exclusive").kwargs.get("beside_warming"):
        gpu_share.wait_warming(warming)       # holding nothing: the parity cases go on meanwhile
        warming = None
    with _hold(item, exclusive=True) as h:
        # the warming this case may time beside (``quiet``): none where it had ended when the GPU was taken
        _QUIET[item.nodeid] = (h, warming if warming and gpu_share.warming_running(warming) else None)
        try:
            yield
        finally:
            _QUIET.pop(item.nodeid, None)


_QUIET: dict[str, tuple] = {}           # the running exclusive case: its GPU hold, the warming it may wait for


@pytest.fixture
def quiet(request):
    """For a case marked ``nsa_exclusive(beside_warming=True)`` whose first timings are GPU-bound (many times
    more GPU work a call than host work: a compiling CPU does not slow them) and whose later ones are not:
    ``quiet()`` before those (``wait_quiet``)."""
    return lambda: wait_quiet(request.node.nodeid)


def wait_quiet(nodeid: str) -> bool:
    """Wait for the run's warming processes to end, the running exclusive case's GPU let go meanwhile
    (the parity cases use it), then take the GPU alone again; at once where none is running. Returns
    whether the warming was running when the case took the GPU (its timings until this first call were
    made beside it); False on later calls. A stretch held before a wait is logged as the case's "(before
    the quiet CPU)"."""
    from nsa_validate.suite import gpu_share
    h, warming = _QUIET.get(nodeid, (None, None))
    if not warming:
        return False
    if gpu_share.warming_running(warming):
        if h is None:
            gpu_share.wait_warming(warming)
        else:
            h.let_go_while(lambda: gpu_share.wait_warming(warming), f"{nodeid} (before the quiet CPU)")
    _QUIET[nodeid] = (h, None)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    if not _exclusive(item):
        yield
        return
    with _hold(item, exclusive=False, phase="teardown", release_memory=True):
        yield


@pytest.fixture(scope="session")
def ctx() -> RunContext:
    return context.current()


@pytest.fixture(scope="session")
def extra(ctx, request) -> SuiteExtra:
    """The suite's tables and notes; one file per process of the suite, put together by the runner."""
    k = request.config.getoption("--nsa-worker")
    return SuiteExtra(ctx.out_dir, "extra.json" if not k else f"extra.{k}.json", position=lambda: _POSITION[0])


@pytest.fixture
def record(request) -> Recorder:
    r = Recorder()
    _RECORDERS[request.node.nodeid] = r
    return r


def _emit(config, line: dict) -> None:
    path = config.getoption("--nsa-records")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")


_PLACEHOLDERS: set[str] = set()


def _plain(v):
    """A parameter as JSON can hold it: numbers, strings, lists; a dataclass as its fields."""
    import dataclasses
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {k: _plain(x) for k, x in dataclasses.asdict(v).items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)


_PARAMS: dict[str, dict] = {}
_INDEX: dict[str, int] = {}        # a case's place in the collection, the same in each of a suite's processes
_POSITION = [0]                    # the running case's place: where its rows go in the suite's tables
_STARTED = [0.0]                   # when the running case started (setup included)


def pytest_collection_modifyitems(session, config, items) -> None:
    """A suite run as several processes beside other suites on its GPU takes its exclusive cases first
    (their order among themselves kept): their setups (a bench's inputs, compiles, its user loop's
    process) then run while the other processes take the parity cases, and their bodies take the GPU
    as soon as the setups are done (``gpu_share``'s turnstile), instead of after every parity case
    (H200, six warm quick runs: the decode bench's setup, 2.6-3.8 s, began after its process's parity
    cases and ended 0.1-1.0 s after every other parity case)."""
    ctx = context.current()
    if ctx.gpu_lock and ctx.workers > 1:
        items.sort(key=lambda it: not _exclusive(it) or _skipped(it))


def pytest_collection_finish(session) -> None:
    _PLACEHOLDERS.update(i.nodeid for i in session.items if i.get_closest_marker("nsa_placeholder"))
    _INDEX.update((it.nodeid, k) for k, it in enumerate(session.items))
    for i in session.items:
        cs = getattr(i, "callspec", None)
        if cs is not None and i.nodeid not in _PLACEHOLDERS:
            _PARAMS[i.nodeid] = {k: _plain(v) for k, v in cs.params.items()}
    # with the process's age now: its start-up (Python, torch, the suite's imports, the collection), for the report
    _emit(session.config, {"collected": len(session.items), "ready_s": startup.process_age()})


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    text = report.longreprtext or ""
    lines = [ln[2:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    return (" ".join(lines) if lines else (text.strip().splitlines() or [""])[-1])[:1000]


def pytest_runtest_logstart(nodeid, location) -> None:
    """Say which case runs now (a terminal shows it beside the suite's bar)."""
    _POSITION[0] = _INDEX.get(nodeid, 0)
    phases.take()
    _STARTED[0] = time.perf_counter()
    _emit(_SESSION[0].config, {"running": nodeid.split("::")[-1].removeprefix("test_")})


def pytest_runtest_logreport(report) -> None:
    st = _STATE.setdefault(report.nodeid, {"status": "pass", "reason": "", "t0": time.time()})
    if report.when == "setup" and not report.passed:
        st["status"] = "skip" if report.skipped else "error"
        st["reason"] = _reason(report)
    elif report.when == "call":
        st["duration"] = report.duration
        if report.failed:
            st["status"], st["reason"] = "fail", _reason(report)
        elif report.skipped:
            st["status"], st["reason"] = "skip", _reason(report)
    elif report.when == "teardown" and report.failed and st["status"] == "pass":
        st["status"], st["reason"] = "error", _reason(report)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location) -> None:
    st = _STATE.pop(nodeid, None)
    if st is None:
        return
    rec = _RECORDERS.pop(nodeid, Recorder())
    spent = phases.take()
    if phases.installed():             # a suite run by the CLI: the rest of the case is "run"
        spent["run"] = round(max(0.0, time.perf_counter() - _STARTED[0] - sum(spent.values())), 3)
    else:
        spent = {}
    name = nodeid.split("::")[-1].removeprefix("test_")
    suite = nodeid.split("::")[0].rsplit("/", 1)[-1].removeprefix("test_").removesuffix(".py")
    _emit(_SESSION[0].config, {"id": name, "suite": suite, "status": st["status"], "reason": st["reason"],
                       "params": _PARAMS.get(nodeid, {}),
                       "metrics": rec.metrics, "backends": rec.backends, "kernels": rec.kernels,
                       "routes": rec.routes, "phases": spent,
                       "duration_s": round(st.get("duration", 0.0), 4), "placeholder": nodeid in _PLACEHOLDERS})


_SESSION: list = []                # this process's session: its config, and its exit status as pytest ends
NORMAL_EXITS = (0, 1, 5)           # pytest: all passed, some failed, nothing collected


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session) -> None:
    _SESSION[:] = [session]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """A suite process given a run context (the runner's) ends here, once pytest has reported a run
    that went as runs go (all passed, some failed, nothing collected), without Python's shutdown: its
    records, tables and launch log are written case by case, and tearing torch, the CUDA context and
    the profiler down in Python is what the suite would wait for (the run ends with its last suite).
    The driver frees the GPU as the process ends, as on a kill. What pytest reports in its own cleanup
    is not (an exception raised in a ``__del__`` after the last case, a warning it would print then).
    Any other ending (a usage error, an interruption, an internal error) goes through pytest's own,
    which prints its message after this."""
    status = int(_SESSION[0].exitstatus) if _SESSION else None
    if not config.getoption("--nsa-context", default=None) or status not in NORMAL_EXITS:
        return
    import sys
    for f in (config.get_terminal_writer(), sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            f.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(status)
