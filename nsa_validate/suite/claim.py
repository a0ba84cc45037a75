"""Cases claimed one at a time by several pytest processes that collected the same cases.

``--claim-from FILE``: each process takes the next unclaimed case from FILE's counter when it
finishes one, so the processes end together. ``make test`` on a CPU machine runs one such process
per core (``tests/parallel.py``); the CLI runs a suite as several when the machine's cores allow
(``run/runner.py``). Loaded by the root ``conftest.py``, so every test and suite process has it.
"""
from __future__ import annotations

import fcntl
import hashlib

import pytest


def pytest_addoption(parser):
    parser.addoption("--claim-from", default=None, metavar="FILE",
                     help="run the cases one at a time as claimed from FILE, a counter shared with the other "
                          "pytest processes given it (they must collect the same cases): `make test` and the CLI's "
                          "suite processes run several such processes")


def claim(path: str) -> int:
    """The next case's index: FILE's counter, taken and advanced under an exclusive lock."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = int(f.read() or 0)
        f.seek(0)
        f.truncate()
        f.write(str(n + 1))
        return n


def _same_cases(path: str, items) -> None:
    """Every process sharing ``path`` collected the same cases in the same order (else an index is
    another case in each): the first records a digest of the node ids, the others compare."""
    digest = hashlib.sha256("\n".join(it.nodeid for it in items).encode()).hexdigest()
    with open(path + ".cases", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        first = f.read()
        if not first:
            f.write(digest)
        elif first != digest:
            raise pytest.UsageError(f"--claim-from {path}: this process collected other cases than the first")


def pytest_runtestloop(session):
    """pytest's own loop (``_pytest.main.pytest_runtestloop``), over the cases claimed from --claim-from:
    each process takes the next unclaimed case when it finishes one, so the processes end together."""
    path = session.config.getoption("--claim-from")
    if not path:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} error(s) during collection")
    if session.config.option.collectonly:
        return True
    items = session.items
    _same_cases(path, items)
    # One module's cases (a suite): a case tears down to the next in collection order, whichever process runs
    # it, and the next is claimed once this one is done: a long case (a bench waiting to hold the GPU alone)
    # keeps none from the other processes. Several modules' (make test): the next case is claimed first, as
    # its own module and class decide what this one tears down. (A process's last case in one module keeps
    # the module's and session's fixtures up; pytest tears them down at the session's end.)
    one_module = len({id(it.parent) for it in items}) == 1 and isinstance(items[0].parent, pytest.Module)
    i = claim(path)
    while i < len(items):
        if one_module:
            items[i].config.hook.pytest_runtest_protocol(item=items[i], nextitem=items[i + 1] if i + 1 < len(items) else None)
            j = claim(path)
        else:
            j = claim(path)
            items[i].config.hook.pytest_runtest_protocol(item=items[i], nextitem=items[j] if j < len(items) else None)
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
        i = j
    return True
