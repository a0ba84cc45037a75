"""Child processes die with the process that started them: on Linux a child asks the kernel for
SIGKILL when its parent dies (PR_SET_PDEATHSIG), so a SIGKILLed ``nsa-validate`` leaves no suite,
environment probe or bench process running on (holding a GPU, or printing into a closed pipe)."""
from __future__ import annotations

import os
import signal
import sys

try:                          # loaded before any fork: a preexec_fn must not import
    import ctypes
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


def die_with_parent():
    """A ``preexec_fn`` for ``subprocess``: SIGKILL the child when this process dies; if this process
    is already gone when the child starts, the child exits at once. None off Linux (nothing to do).
    (The kernel watches the thread that started the child: the run's threads that start suites wait
    for their processes to end.)"""
    if _PRCTL is None:
        return None
    parent, prctl = os.getpid(), _PRCTL

    def pre() -> None:
        prctl(1, signal.SIGKILL)                   # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
    return pre
