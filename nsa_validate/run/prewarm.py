"""Compile a run's Triton kernels on all the machine's cores while its suites start.

A cold GPU run is bound by Triton's compiler, which is CPU work: each suite process compiles the
kernels its cases meet one after another, and one case may meet a dozen. A list of the launches a
run of the same profile and level compiled (``profiles/kernels/<profile>-<level>.jsonl``, a run's
``kernels.jsonl`` copied there; ``nsa_validate.suite.launches``) lets processes of their own
compile them all, those that must start soonest first (``order``), side by side with the suites. They
take the run's compile locks (``compile_once``) as the suites do, so no kernel is compiled twice:
a suite that needs a kernel a warming process is compiling waits for it, then finds it in the
cache; one the list lacks, the suite compiles itself. Nothing a case checks depends on the list.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nsa_validate import orphans
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


class Prewarm:
    """``processes`` warming processes over ``kernels`` (a launch list); ``summary()`` when the
    suites are done (it stops what is still running: the suites compiled the rest themselves)."""

    def __init__(self, kernels: Path, run_dir: Path, locks: Path, processes: int, env: dict | None = None):
        from nsa_validate.suite import launches
        self.kernels, self.entries, self.run_dir = kernels, launches.read(kernels), run_dir
        self.n = len(self.entries)
        self.work = run_dir / "prewarm"
        self.work.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()         # the warming processes stamp their lines on it (one clock on Linux)
        self.ended: float | None = None
        # one process, which forks the others once it has imported what they need (``_serve``); its
        # session holds them all, so that stopping it stops them
        cmd = [sys.executable, "-c", _SERVER, str(kernels), str(self.work), str(locks), str(run_dir / "logs"),
               str(max(1, min(processes, self.n)))]
        with open(run_dir / "logs" / "prewarm.0.log", "w") as log:
            self.procs = [subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, preexec_fn=orphans.die_with_parent())]

    def poll(self) -> bool:
        """True once every warming process has ended."""
        if self.ended is None and all(p.poll() is not None for p in self.procs):
            self.ended = time.monotonic()
        return self.ended is not None

    @staticmethod
    def skipped(kernels: Path, why: str) -> dict:
        return {"list": _shown(kernels), "skipped": why}

    def summary(self) -> dict:
        """What was compiled: the list, its kernels, how many compiled (or were found compiled),
        failed (the first failure's message) or were not reached, the processes' wall and summed
        seconds, and the launches the suites compiled that the list lacks (``unlisted``). Stops the
        processes still running."""
        if not self.poll():
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            self.ended = time.monotonic()
        done = []
        for f in sorted(self.work.glob("done.*.jsonl")):
            for line in f.read_text(errors="replace").splitlines():
                try:
                    done.append(json.loads(line))
                except ValueError:
                    pass                       # a line cut short by a stopped process
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
        wall = last - self.t0 if last is not None and len(done) == self.n else self.ended - self.t0
        return {"list": _shown(self.kernels), "kernels": self.n, "processes": len(list(self.work.glob("done.*.jsonl"))),
                "compiled": len(done) - len(failed), "failed": len(failed),
                "first_failure": f"{failed[0]['fn']}: {failed[0]['error']}" if failed else None,
                "not_reached": self.n - len(done),
                "wall_s": round(wall, 2), "cpu_s": round(sum(d.get("s", 0) for d in done), 2),
                "unlisted": unlisted(self.entries, self.run_dir / "kernels.jsonl")}


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def unlisted(entries: list[dict], compiled: Path) -> int:
    """Launches the run's suites compiled (its ``kernels.jsonl``) that the list's ``entries`` lack:
    what a stale list costs, the list's owner's cue to copy the run's file over it."""
    from nsa_validate.suite import launches
    listed = {launches.key(e) for e in entries}
    return sum(launches.key(e) not in listed for e in launches.read(compiled))


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


def _serve(kernels: str, work: str, locks: str, logs: str, processes: str) -> None:
    """The warming processes: this one imports the list's kernel modules (torch, triton and the
    kernels) once, then forks the others, so that they start compiling at once rather than each
    importing them again (on a pod's cold disk ~10 s a process, 15 processes at once beside the
    suites': docs/decisions.md). Every process takes launches off the list (``_warm_all``) until
    none is left. Nothing here starts CUDA, which a forked process could not use: the children
    start it themselves, at their first compile; were it started, this process warms alone."""
    import importlib
    from nsa_validate.suite import launches
    # torch.cuda.is_available() asks NVML rather than CUDA, should an import call it (CUDA's start before a fork)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    entries = order(launches.read(kernels))          # read once: the forked processes take it with them
    for module in sorted({e["fn"].partition(":")[0] for e in entries}):
        try:
            importlib.import_module(module)
        except Exception as e:             # noqa: BLE001  its lines fail alone when warmed (``_warm_all``)
            print(f"prewarm: importing {module}: {type(e).__name__}: {e}", file=sys.stderr)
    n = int(processes)
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
           "from nsa_validate.run.prewarm import _serve; _serve(*sys.argv[1:6])")
