"""Suite processes forked from one process that has imported torch, Triton and pytest already.

A suite process spends its first seconds importing torch, Triton and pytest (~3 s of a core on an H200
pod or on the 2-core machine), and a GPU run starts fifteen of them at once. A run's ``Server``, started
at its first instant, imports them once while the run resolves its profile, and forks each suite process
from there (``spawn``): the child takes its own process group, environment, working folder and log, then runs
pytest on the command line it was given, as ``python -m pytest`` would. Nothing in the server starts CUDA
(a child starts it, as a fresh process would). The server dies with the run, and a child with the
server, as every child process does (``orphans``).

Run as ``python -m nsa_validate.run.forkserver``: one JSON request a line on stdin (``id``, ``args``,
``env``, ``cwd``, ``log``), one JSON line a reply on stdout: ``{"ready": true}`` once imported, ``{"id",
"pid"}`` for each fork, ``{"exit": pid, "code": exit code}`` when a child ends (a negative code: the
signal that killed it).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from nsa_validate import orphans
from nsa_validate.paths import REPO_ROOT

KILLED = -signal.SIGKILL        # a child's code where the server went before telling it


def devices_present() -> str:
    """The device a run here will most likely use, judged before torch is imported: "cuda" where an
    NVIDIA device node exists (Linux's ``/dev/nvidiactl``, WSL's ``/dev/dxg``), else "cpu"."""
    return "cuda" if any(Path(d).exists() for d in ("/dev/nvidiactl", "/dev/dxg")) else "cpu"


class Forked:
    """A child of the server, as the runner uses a ``subprocess.Popen``: ``pid`` (it leads its own
    process group, in the server's session, which is not the terminal's), ``poll``, ``wait`` and
    ``returncode``."""

    def __init__(self, server: "Server", pid: int) -> None:
        self.server, self.pid = server, pid

    @property
    def returncode(self) -> int | None:
        return self.server.code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.changed:
            if not self.server.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired("pytest", timeout)
        return self.returncode


class Server:
    """The forking process, started with ``env`` (the suites' environment on ``device`` but for what differs
    between suites). ``spawn`` returns None where it cannot serve (it is gone, or never got ready): the
    caller starts the process itself."""

    def __init__(self, env: dict, device: str) -> None:
        self.device = device
        self.changed = threading.Condition()
        self.pids: dict[int, int] = {}          # request id -> pid
        self.codes: dict[int, int] = {}         # pid -> exit code
        self.ended = False                      # the server's stdout closed: it is gone
        self.next_id = 0
        self.lock = threading.Lock()            # one request at a time on its stdin
        self.proc = subprocess.Popen([sys.executable, "-m", "nsa_validate.run.forkserver"], cwd=REPO_ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=orphans.die_with_parent())
        threading.Thread(target=self._read, name="forkserver", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.changed:
                if "exit" in msg:
                    self.codes[msg["exit"]] = msg["code"]
                elif "pid" in msg:
                    self.pids[msg["id"]] = msg["pid"]
                self.changed.notify_all()
        with self.changed:                      # gone: its children died with it
            self.ended = True
            self.changed.notify_all()

    def code(self, pid: int) -> int | None:
        with self.changed:
            return self.codes.get(pid, KILLED if self.ended else None)

    def spawn(self, args: list[str], env: dict, log: Path, timeout: float = 120.0) -> Forked | None:
        """Fork a process running ``pytest args`` in ``env``, appending its output to ``log``; None where
        the server cannot (gone, or not ready within ``timeout`` seconds)."""
        with self.lock:
            if self.ended:
                return None
            rid, self.next_id = self.next_id, self.next_id + 1
            req = {"id": rid, "args": args, "env": env, "cwd": str(REPO_ROOT), "log": str(log)}
            try:
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
            except OSError:
                return None
        with self.changed:
            self.changed.wait_for(lambda: rid in self.pids or self.ended, timeout)
            pid = self.pids.get(rid)
        return Forked(self, pid) if pid is not None else None

    def close(self) -> None:
        """End the server (its children die with it: call once they are done)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _say(msg: dict) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())      # one write, under PIPE_BUF: never interleaved


def _reap(signum, frame) -> None:
    """SIGCHLD: tell the run each child that ended (on the main thread: no thread to fork beside)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(req: dict, die_with_server) -> None:
    """In the forked child: its session, log, folder and environment, then pytest. Never returns."""
    code = 70
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setpgid(0, 0)                # its own process group (the server sets it too: see ``serve``)
        if die_with_server is not None:
            die_with_server()
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import torch
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():   # read by torch at its import, in the server
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import pytest
        sys.argv = ["pytest", *req["args"]]
        code = pytest.main(req["args"])
    except BaseException:                                   # noqa: BLE001  the log says why
        import traceback
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(int(code) if isinstance(code, int) else 1)


def serve() -> None:
    """The server's loop (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)           # the run decides when its suites stop
    import pytest  # noqa: F401  what every suite process imports first
    import torch  # noqa: F401
    import triton  # noqa: F401
    if torch.cuda.is_initialized():     # forked children could not use it: the run starts its own
        os._exit(3)
    signal.signal(signal.SIGCHLD, _reap)
    _say({"ready": True})
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        die_with_server = orphans.die_with_parent()
        pid = os.fork()
        if pid == 0:
            _child(req, die_with_server)
        try:                            # set here as well, so that the group exists when the run hears of it
            os.setpgid(pid, pid)        # (the run stops a suite by killing its process group)
        except OSError:                 # the child did it first, or has ended already
            pass
        _say({"id": req["id"], "pid": pid})
    os._exit(0)                         # the run closed its end: no teardown of torch to wait for


if __name__ == "__main__":
    serve()
