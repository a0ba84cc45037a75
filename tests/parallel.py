"""`make test`: pytest over tests/ and suites/ as N processes at once on a CPU machine, N = its cores
(at most MAX_PROCESSES); one process on a GPU machine, whose suites time the GPU and must have it alone.

The processes take the selected cases one at a time from a shared counter (conftest.py's
``--claim-from``), so they end together whatever each case costs. The first streams its output here;
the others write theirs to a file, printed when they end. Then the ten slowest cases of all the
processes (from their JUnit files) and one exit status: the first failing process's, else 0 (5 only
when nothing was collected). Arguments are passed to every pytest process (`make test ARGS="-k ..."`).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

MAX_PROCESSES = 4
SLOWEST = 10
NO_TESTS = 5             # pytest's exit status when a process collected nothing


def gpu() -> bool:
    import torch
    return torch.cuda.is_available()


def process_count() -> int:
    if gpu():
        return 1
    return max(1, min(MAX_PROCESSES, len(os.sched_getaffinity(0))))


def slowest(junit_files: list[Path], k: int = SLOWEST) -> list[tuple[float, str]]:
    """The k longest cases (setup + call + teardown, seconds) over the processes' JUnit files."""
    cases = []
    for f in junit_files:
        if f.is_file():
            for tc in ET.parse(f).iter("testcase"):
                cases.append((float(tc.get("time") or 0), f"{tc.get('classname')}::{tc.get('name')}"))
    return sorted(cases, reverse=True)[:k]


def main(args: list[str]) -> int:
    n = process_count()
    # a CPU machine runs the suites' whole CPU sweep (`make oneshot` there runs its standard level)
    level = [] if gpu() else ["--nsa-level=full"]
    base = [sys.executable, "-m", "pytest", "-q", *level, *args]
    if n == 1:
        return subprocess.call([*base, f"--durations={SLOWEST}"])
    work = Path(tempfile.mkdtemp(prefix="nsa-test-"))
    # one torch thread a process: N processes on N cores, not N × N threads
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs, logs = [], []
    for i in range(n):
        cmd = [*base, f"--claim-from={work / 'claimed'}", f"--junitxml={work / f'process{i}.xml'}",
               f"--basetemp={work / f'tmp{i}'}"]
        log = None if i == 0 else open(work / f"process{i}.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None, env=env))
        logs.append(log)
    print(f"make test: {n} pytest processes at once, taking the cases one at a time (each one's progress "
          f"counts all the cases, so it ends near {100 // n}%)", flush=True)
    codes = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        codes.append(p.wait())
        if log is not None:
            log.close()
            print(f"\n---- process {i}/{n} (exit {codes[-1]}) ----", flush=True)
            sys.stdout.write((work / f"process{i}.log").read_text(errors="replace"))
    print(f"\n==== {SLOWEST} slowest cases, all processes ====")
    for t, name in slowest([work / f"process{i}.xml" for i in range(n)]):
        print(f"{t:9.2f}s {name}")
    failed = [c for c in codes if c not in (0, NO_TESTS)]
    code = failed[0] if failed else (NO_TESTS if all(c == NO_TESTS for c in codes) else 0)
    if code == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"make test: exit {code} (processes {codes}); their files: {work}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
