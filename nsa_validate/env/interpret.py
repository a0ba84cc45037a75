"""The one place that decides whether Triton kernels run under Triton's interpreter: on a CPU
(no GPU to compile for) they do, on a GPU never.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so the switch is set in a process's
environment before any kernel module imports: in the environment of the suite and probe processes
the harness starts (``child_env``), and in a plain ``pytest`` by the root conftest
(``set_for_this_process``). Whether the interpreter can run the kernels is a separate question,
answered by trying (``kernels.interpreter.probe``).
"""
from __future__ import annotations

import os

from nsa_validate.paths import REPO_ROOT

VAR = "TRITON_INTERPRET"


def wanted(device: str) -> bool:
    """Whether kernels on ``device`` ("cuda" | "cpu") run under the interpreter."""
    return device == "cpu"


def child_env(device: str, **more: str) -> dict:
    """The environment of a child process running this project's code on ``device``: this
    repository first on its path, unbuffered output, and the interpreter switch where ``wanted``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **more)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if wanted(device):
        env[VAR] = "1"
    return env


def set_for_this_process() -> None:
    """Before any kernel is imported: the switch for this process, from whether it sees a GPU
    (a value already set is kept: an explicit ``TRITON_INTERPRET=0`` on a CPU is the user's)."""
    import torch
    if wanted("cuda" if torch.cuda.is_available() else "cpu"):
        os.environ.setdefault(VAR, "1")
