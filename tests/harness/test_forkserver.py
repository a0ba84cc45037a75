"""Suite processes forked from a server that imported torch, Triton and pytest (``run/forkserver.py``)."""
import json
import os
import signal
import subprocess
import sys

import pytest

from nsa_validate.env import interpret
from nsa_validate.run import forkserver

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the run forks its suites on Linux only")


def test_a_forked_process_runs_pytest_in_its_own_group_environment_and_log(tmp_path):
    (tmp_path / "test_probe.py").write_text(
        "import os, pathlib\n\n"
        "def test_env():\n"
        "    pathlib.Path(os.environ['PROBE_OUT']).write_text(f\"{os.environ['PROBE']} {os.getpgid(0)} {os.getpid()}\")\n\n"
        "def test_fails_when_asked():\n"
        "    assert os.environ['PROBE'] != 'fail'\n")
    server = forkserver.Server(interpret.child_env("cpu"), "cpu")
    try:
        results = {}
        for word in ("pass", "fail"):
            env = dict(interpret.child_env("cpu"), PROBE=word, PROBE_OUT=str(tmp_path / f"{word}.out"),
                       PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
            log = tmp_path / f"{word}.log"
            p = server.spawn([str(tmp_path / "test_probe.py"), "-q", "-p", "no:cacheprovider", "--rootdir",
                              str(tmp_path)], env, log)
            assert p is not None, "the server did not fork"
            results[word] = (p.wait(timeout=120), log.read_text())
            probe, group, pid = (tmp_path / f"{word}.out").read_text().split()
            assert probe == word and group == pid == str(p.pid), "not its own process group, or not the environment given"
        assert results["pass"][0] == 0 and "2 passed" in results["pass"][1], results["pass"]
        assert results["fail"][0] == 1 and "1 failed" in results["fail"][1], results["fail"]
        # a child that hangs is stopped as the runner stops one: its process group killed
        (tmp_path / "test_hang.py").write_text("import time\n\ndef test_hang():\n    time.sleep(600)\n")
        p = server.spawn([str(tmp_path / "test_hang.py"), "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
                         dict(env, PROBE="hang"), tmp_path / "hang.log")
        assert p.poll() is None, (tmp_path / "hang.log").read_text()
        os.killpg(p.pid, signal.SIGKILL)
        assert p.wait(timeout=60) == -signal.SIGKILL
    finally:
        server.close()
    assert server.proc.poll() is not None
    assert server.spawn(["-q"], {}, tmp_path / "late.log") is None, "a closed server must not be asked to fork"


def test_a_suite_run_forks_its_processes_from_the_server(tmp_path):
    """A `suite` run's process (on this machine's own profile, the device the server was started for) is a
    child of the run's server, not of the CLI, and the suite passes as it would started on its own."""
    from tests.harness.test_cli import cli, run_dirs
    r = cli("suite", "sanity", "--level", "quick", "-k", "prefill_matches", "--out", str(tmp_path))
    assert r.returncode == 0 and "VERDICT: PASS" in r.stderr, r.stderr[-2000:]
    (d,) = run_dirs(tmp_path)
    parent = json.loads((d / "suites" / "sanity.context.json").read_text())["parent_pid"]
    cli_pid = json.loads((d / "manifest.json").read_text())["pid"]
    assert parent and parent != cli_pid, "the suite's process was started by the CLI, not forked by its server"


def test_killing_a_child_the_server_reaped_before_saying_so_is_not_an_error():
    """A forked child can end, and be reaped by the server, before its exit code reaches the run: ``poll``
    still says it runs while its process group is gone. ``runner.kill`` (a suite's processes at its timeout
    or a signal) then waits for the code instead of failing the run with ESRCH (seen in CI: a `--timeout 1`
    run's one-second suite ended as "error: No such process")."""
    from nsa_validate.run import runner
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    code = p.wait()                                   # reaped: its group is gone
    with pytest.raises(ProcessLookupError):
        os.killpg(p.pid, 0)

    class NotYetTold:                                 # a Forked whose exit the server has not reported yet
        pid = p.pid
        waited = False

        def poll(self):
            return None

        def wait(self):
            self.waited = True
            return code
    child = NotYetTold()
    runner.kill(child)
    assert child.waited
