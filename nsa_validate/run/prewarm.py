"""Compile a run's Triton kernels on all the machine's cores from the run's first moment.

A cold GPU run is bound by Triton's compiler, which is CPU work: each suite process compiles the
kernels its cases meet one after another, and one case may meet a dozen. A list of the launches a
run of the same profile and level compiled (``profiles/kernels/<profile>-<level>.jsonl``, a run's
``kernels.jsonl`` copied there; ``nsa_validate.suite.launches``) lets processes of their own
compile them all, those that must start soonest first (``order``), while the run checks the
environment and then side by side with the suites. They take the run's compile locks
(``compile_once``) as the suites do, so no kernel is compiled twice: a suite that needs a kernel a
warming process is compiling waits for it, then finds it in the cache; one the list lacks, the suite
compiles itself. Nothing a case checks depends on the list.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nsa_validate import orphans
from nsa_validate.run import forkserver
from nsa_validate.paths import PROFILE_DIR, REPO_ROOT, kernel_sources

LIST_DIR = PROFILE_DIR / "kernels"


def list_for(profile: str, level: str) -> Path | None:
    """The launch list shipped for this profile and level, if there is one."""
    path = LIST_DIR / f"{profile}-{level}.jsonl"
    return path if path.is_file() else None


def _triton_cache() -> Path:
    """Triton's kernel cache folder (``TRITON_CACHE_DIR``, else its default), as this Triton names it."""
    try:
        from triton import knobs
        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        pass
    try:
        from triton.runtime.cache import default_cache_dir
        return Path(default_cache_dir())
    except (ImportError, AttributeError):
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def warm_marker(kernels: Path) -> Path:
    """A file in Triton's cache saying that this list was compiled into it, for these kernel sources,
    this Triton and this GPU: a run that finds it skips the warming (each of its processes would only
    load the list's kernels again, ~0.9 s a launch on an H200 pod: CPU the suites need). Gone with the
    cache, or once a kernel's source changes."""
    import hashlib
    import torch
    import triton
    h = hashlib.sha256(kernels.read_bytes())
    for src in kernel_sources():
        h.update(src.read_bytes())
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    h.update(f"{triton.__version__}|{torch.__version__}|{gpu}".encode())
    return _triton_cache() / "nsa-validate" / f"prewarmed-{h.hexdigest()[:24]}"


def may_warm(req_select: str | None, level: str) -> bool:
    """Whether a run may warm, judged before torch is imported (``Prewarm`` starts then): no ``-k``,
    an NVIDIA device node (Linux's ``/dev/nvidiactl``, WSL's ``/dev/dxg``: a machine without one warms
    nothing), and a list shipped for the level. The run decides for good once it knows its profile and
    device (``go`` or ``close``)."""
    return (not req_select and forkserver.devices_present() == "cuda"
            and any(LIST_DIR.glob(f"*-{level}.jsonl")))


SCRATCH = "nsa-validate-warm-"          # the scratch folders' prefix, then the run's pid
NICE = 10                               # the warming processes' niceness, added to the run's


def _sweep() -> None:
    """Remove the scratch folders of runs that are gone (a run killed outright cannot remove its own):
    those in the temp folder whose pid is no live process (Linux: where /proc cannot tell, none)."""
    if not Path("/proc/self").exists():
        return
    for d in Path(tempfile.gettempdir()).glob(f"{SCRATCH}*"):
        pid = d.name[len(SCRATCH):].partition("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


class Prewarm:
    """A run's warming processes. Made at the run's first instant, it starts the one process that will
    fork them, which imports torch and Triton (on a cold pod, seconds of reading them from disk) while
    the run imports them too and resolves its profile, then waits. ``go(kernels, processes)`` hands it a
    launch list: it forks and they compile. ``summary(run_dir)`` when the suites are done (it stops what
    is still running: the suites compiled the rest themselves) keeps their logs and lines in the run
    folder; ``close()`` (always, also where ``go`` never came) stops them and removes their scratch
    folder (their lines, logs and the compile locks, ``locks``, which the suites take too)."""

    def __init__(self, env: dict | None = None):
        self.kernels: Path | None = None
        self.entries: list[dict] = []
        self.n = 0
        self.t0: float | None = None       # ``go``'s moment: the warming processes stamp their lines on this clock
        self.made = time.monotonic()       # the run's start, near enough: ``imported_s`` counts from it
        self.ended: float | None = None
        self.last_end: float | None = None     # when the last compile ended (``summary``), on the monotonic clock
        _sweep()
        self.scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH}{os.getpid()}-"))
        self.work, self.logs, self.locks = self.scratch / "work", self.scratch / "logs", self.scratch / "locks"
        self.alive = self.scratch / "alive"     # held shared by the warming processes (``gpu_share.wait_warming``)
        try:
            for d in (self.work, self.logs, self.locks):
                d.mkdir()
            self._spawn(env)
        except OSError:                    # no room for the folder's files or another process: nothing left
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise

    def _spawn(self, env: dict | None) -> None:
        from nsa_validate.env import interpret
        from nsa_validate.suite import gpu_share
        alive = gpu_share.warming_lock(str(self.alive))   # held before the process exists: no case passes early
        # its session holds every warming process, so that stopping it stops them all
        try:
            with open(self.logs / "prewarm.0.log", "w") as log:
                self.procs = [subprocess.Popen([sys.executable, "-c", _SERVER, str(self.work), str(self.locks),
                                                str(self.logs)], cwd=REPO_ROOT,
                                               env=env if env is not None else interpret.child_env("cuda"),
                                               stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True, preexec_fn=orphans.die_with_parent(),
                                               pass_fds=(alive,))]
        finally:
            os.close(alive)                # theirs now: the lock lives as long as the last of them

    def go(self, kernels: Path, processes: int) -> None:
        """Compile ``kernels`` (a launch list) in ``processes`` processes, from now."""
        from nsa_validate.suite import launches
        self.kernels, self.entries = kernels, launches.read(kernels)
        self.n, self.t0 = len(self.entries), time.monotonic()
        try:
            self.procs[0].stdin.write(json.dumps({"kernels": str(kernels),
                                                  "processes": max(1, min(processes, self.n))}).encode() + b"\n")
            self.procs[0].stdin.close()
        except OSError:                    # it died before it could be told (its log says why): nothing compiled
            pass

    def poll(self) -> bool:
        """True once every warming process has ended."""
        if self.ended is None and all(p.poll() is not None for p in self.procs):
            self.ended = time.monotonic()
        return self.ended is not None

    def _stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            with contextlib.suppress(OSError):
                if p.stdin:
                    p.stdin.close()
        if self.ended is None:
            self.ended = time.monotonic()

    def close(self) -> None:
        """Stop every warming process and remove the scratch folder; again, nothing."""
        self._stop()
        shutil.rmtree(self.scratch, ignore_errors=True)

    @staticmethod
    def skipped(kernels: Path, why: str) -> dict:
        return {"list": shown(kernels), "skipped": why}

    def summary(self, run_dir: Path) -> dict:
        """What was compiled: the list, its kernels, how many compiled (or were found compiled),
        failed (the first failure's message) or were not reached, the processes' wall and summed
        seconds, and the launches the suites compiled that the list lacks (``unlisted``); after ``go``.
        Stops the processes still running; their logs go to ``run_dir/logs``, their lines to
        ``run_dir/prewarm``; then ``close``."""
        if not self.poll():
            self._stop()
        files = sorted(self.work.glob("done.*.jsonl"))       # one a process
        done = []
        for f in files:
            for line in f.read_text(errors="replace").splitlines():
                try:
                    done.append(json.loads(line))
                except ValueError:
                    pass                       # a line cut short by a stopped process
        with contextlib.suppress(OSError):     # the record of it only (a full disk loses it, not the run)
            (run_dir / "prewarm").mkdir(exist_ok=True)
            for f in files:
                shutil.copyfile(f, run_dir / "prewarm" / f.name)
            for f in self.logs.glob("prewarm.*.log"):
                shutil.copyfile(f, run_dir / "logs" / f.name)
        failed = [d for d in done if not d.get("ok")]
        if len(done) == self.n:            # all of it in the cache now: later runs skip the warming
            marker = warm_marker(self.kernels)
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            except OSError:                # a cache we may not write (or a full disk): the next run warms again
                pass
        # until its last compile ended (the processes are only polled when the suites are done)
        last = max((d["end"] for d in done if "end" in d), default=None)
        self.last_end = last if last is not None and len(done) == self.n else self.ended
        imported = _stamp(self.work / "imported")
        self.close()
        return {"list": shown(self.kernels), "kernels": self.n, "processes": len(files),
                "imported_s": round(imported - self.made, 2) if imported is not None else None,
                "compiled": len(done) - len(failed), "failed": len(failed),
                "first_failure": f"{failed[0]['fn']}: {failed[0]['error']}" if failed else None,
                "not_reached": self.n - len(done),
                "wall_s": round(self.last_end - self.t0, 2), "cpu_s": round(sum(d.get("s", 0) for d in done), 2),
                "unlisted": unlisted(self.entries, run_dir / "kernels.jsonl")}


def _stamp(path: Path) -> float | None:
    """The monotonic time a warming process wrote into ``path``; None where it wrote none."""
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def shown(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def unlisted(entries: list[dict], compiled: Path) -> int:
    """Launches the run's suites compiled (its ``kernels.jsonl``) that no line of the list's ``entries``
    compiles (``launches.compile_key``: lines that differ only in integers Triton does not specialise on
    are one compile): what a stale list costs, the list's owner's cue to copy the run's file over it."""
    from nsa_validate.suite import launches
    listed = {launches.compile_key(e) for e in entries}
    return sum(launches.compile_key(e) not in listed for e in launches.read(compiled))


def order(entries: list[dict]) -> list[dict]:
    """The order the warming processes take the list's launches in: by the latest moment each could
    start compiling and still be ready when the recording run first needed it (its ``at_s`` less its
    ``compile_s``). A long compile needed late goes before a short one needed a little earlier (in
    first-need order it started late, and the case waiting for it ended late)."""
    return sorted(entries, key=lambda e: e.get("at_s", 0) - e.get("compile_s", 0))


def _warm_all(entries: list[dict], counter: str, locks: str, results: str) -> None:
    """One warming process: claim the next of ``entries`` (the list, in ``order``), compile it, write a
    line; until none is left."""
    from nsa_validate.suite import compile_once, launches
    from nsa_validate.suite.claim import claim
    compile_once.install(locks)
    launches.compile_only()
    with open(results, "a", buffering=1) as out:
        while (i := claim(counter)) < len(entries):
            e, t = entries[i], time.perf_counter()
            try:
                launches.warm(e)
                ok, error = True, None
            except Exception as ex:        # noqa: BLE001  a line the code has outgrown: the suite compiles it
                ok, error = False, f"{type(ex).__name__}: {str(ex).splitlines()[0][:300] if str(ex) else ''}"
            out.write(json.dumps({"fn": e["fn"], "ok": ok, "s": round(time.perf_counter() - t, 3),
                                  "end": round(time.monotonic(), 3), "error": error}) + "\n")


def _serve(work: str, locks: str, logs: str) -> None:
    """The warming processes: this one imports torch and Triton while the run decides whether to warm,
    then reads its order on stdin (a JSON line: the list and how many processes; none, end of input:
    the run does not warm), imports the list's kernel modules and forks the others, so that they start
    compiling at once rather than each importing it all again (on a pod's cold disk ~10 s a process, 15
    processes at once beside the suites': docs/decisions.md). Every process takes launches off the list
    (``_warm_all``) until none is left. Nothing here starts CUDA, which a forked process could not
    use: the children start it themselves (the driver only: they make no context,
    ``launches.compile_only``); were it started, this process warms alone."""
    import importlib
    # below the suites' CPU priority (the forked ones inherit it): the suites' cases, and a case holding the
    # GPU alone while these still compile (one that times nothing or GPU-bound work only: ``gpu_share``), come first
    with contextlib.suppress(OSError):
        os.nice(NICE)
    # torch.cuda.is_available() asks NVML rather than CUDA, should an import call it (CUDA's start before a fork)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for module in ("torch", "triton"):
        try:
            importlib.import_module(module)
        except Exception as e:             # noqa: BLE001  the kernels' import below reports it again
            print(f"prewarm: importing {module}: {type(e).__name__}: {e}", file=sys.stderr)
    # when the imports ended, against ``go``'s moment: whether the run's profile or this process's imports
    # held the compiles back (the same monotonic clock, system-wide)
    with contextlib.suppress(OSError):
        Path(work, "imported").write_text(repr(time.monotonic()))
    line = sys.stdin.readline()
    if not line.strip():
        return
    order_ = json.loads(line)
    from nsa_validate.suite import launches
    entries = order(launches.read(order_["kernels"]))  # read once: the forked processes take it with them
    for module in sorted({e["fn"].partition(":")[0] for e in entries}):
        try:
            importlib.import_module(module)
        except Exception as e:             # noqa: BLE001  its lines fail alone when warmed (``_warm_all``)
            print(f"prewarm: importing {module}: {type(e).__name__}: {e}", file=sys.stderr)
    # Triton's own C module (``cuda_utils``, gcc's second or two on a cold cache) built once, here, rather than
    # by every forked process at its first compile; building and loading it starts no CUDA
    with contextlib.suppress(Exception):
        import triton
        triton.runtime.driver.active.utils
    n = int(order_["processes"])
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and n > 1:
        print("prewarm: CUDA was started by an import: one warming process, no forks", file=sys.stderr)
        n = 1
    sys.stdout.flush()
    sys.stderr.flush()
    children, pre = [], orphans.die_with_parent()        # made here: it names this process as the parent
    for i in range(1, n):
        try:
            pid = os.fork()
        except OSError as e:               # no room for another process: those forked so far do the work
            print(f"prewarm: {i} warming processes: fork failed ({e})", file=sys.stderr)
            break
        if pid == 0:
            _child(i, pre, entries, work, locks, logs)
        children.append(pid)
    try:
        _warm_all(entries, f"{work}/counter", locks, f"{work}/done.0.jsonl")
    except Exception:                      # noqa: BLE001  into its log; the forked ones go on (they die with it)
        import traceback
        traceback.print_exc()
    for pid in children:
        os.waitpid(pid, 0)


def _child(i: int, pre, entries: list[dict], work: str, locks: str, logs: str) -> None:
    """Forked warming process ``i``: its own log, killed with the process that forked it (``pre``:
    ``orphans.die_with_parent``'s, made before the fork); never returns (``os._exit``: the parent's
    exit handlers are the parent's)."""
    code = 1
    try:
        if pre is not None:
            pre()
        fd = os.open(f"{logs}/prewarm.{i}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        _warm_all(entries, f"{work}/counter", locks, f"{work}/done.{i}.jsonl")
        code = 0
    except BaseException:                  # noqa: BLE001  into its log, then gone like the others
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# the warming processes' first (``python -c``: ``-m`` would import this module twice, through its package first).
# A Ctrl-C is the run's to handle: it stops these processes itself (``summary``); the forked ones inherit the ignore
_SERVER = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
           "from nsa_validate.run.prewarm import _serve; _serve(*sys.argv[1:4])")
