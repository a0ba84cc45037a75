"""A suite that runs fewer cases than it planned, none at all included, is an error of its own, whatever
the flags: a module that exits while it is imported, or a process that ends mid-run, leaves a suite
error naming its log, never a "skip"."""
import shutil
import sys

import pytest

from nsa_validate.config import profiles
from nsa_validate.suite.context import RunContext
from nsa_validate.paths import REPO_ROOT
from nsa_validate.config.registry import SanityCfg, Suite
from nsa_validate.run.runner import run_suite

PLANTED = {
    "exits-at-import": "import sys\nsys.exit(0)\n",
    "ends-the-process-at-import": "import os\nos._exit(0)\n",
    "exits-mid-run": "import os\n\ndef test_a():\n    pass\n\ndef test_b():\n    os._exit(0)\n\ndef test_c():\n    pass\n",
    "collects-nothing": "X = 1\n",
    "healthy": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
}


@pytest.mark.parametrize("name", PLANTED)
def test_a_suite_that_runs_less_than_it_planned_is_an_error(name, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO_ROOT / "suites" / "conftest.py", src / "conftest.py")      # the suites' plugin
    (src / "test_planted.py").write_text(PLANTED[name])
    run_dir = tmp_path / "run"
    for sub in ("suites", "logs"):
        (run_dir / sub).mkdir(parents=True)
    prof, device = profiles.resolve("cpu", "standard")
    suite = Suite("planted", str(src / "test_planted.py"), "a planted suite", SanityCfg, timeout_s=120)
    r = run_suite(suite, RunContext(profile=prof, device=device, timeout_s=120), run_dir)
    if name == "healthy":
        assert r.status == "pass" and len(r.cases) == 2, r
        return
    assert r.status == "error", r
    err = [c for c in r.cases if c.status == "error"]
    assert err and "logs/planted.log" in err[-1].reason, err


def test_a_suite_process_leaves_with_pytests_status_and_its_report_but_no_shutdown(tmp_path):
    """A suite process ends as soon as pytest has reported (the plugin's ``pytest_unconfigure``): with
    pytest's exit status and its summary in the log, every case recorded, and without Python's shutdown
    (which, with torch and a CUDA context, the run would wait for): a module's atexit handler never runs."""
    src, run_dir, mark = tmp_path / "src", tmp_path / "run", tmp_path / "shut-down"
    src.mkdir()
    shutil.copy(REPO_ROOT / "suites" / "conftest.py", src / "conftest.py")
    (src / "test_planted.py").write_text(
        f"import atexit, pathlib\natexit.register(lambda: pathlib.Path({str(mark)!r}).write_text('x'))\n\n"
        "def test_a():\n    pass\n\ndef test_b():\n    assert False\n")
    for sub in ("suites", "logs"):
        (run_dir / sub).mkdir(parents=True)
    prof, device = profiles.resolve("cpu", "standard")
    suite = Suite("planted", str(src / "test_planted.py"), "a planted suite", SanityCfg, timeout_s=120)
    r = run_suite(suite, RunContext(profile=prof, device=device, timeout_s=120), run_dir)
    assert r.returncode == 1 and [c.status for c in r.cases] == ["pass", "fail"], r
    assert "1 failed, 1 passed" in (run_dir / "logs" / "planted.log").read_text()
    assert not mark.exists()
    # its start-up, Python's start to the cases' collection, as the process itself counted it
    assert r.startup_s is not None and 0 < r.startup_s < r.duration_s or not sys.platform.startswith("linux"), r


def test_a_suites_start_up_is_its_slowest_process(tmp_path):
    """``SuiteResult.startup_s``: the largest ``ready_s`` of its processes' collection lines; none said, None."""
    from nsa_validate.run.runner import suite_result
    (tmp_path / "suites").mkdir()
    rec = tmp_path / "suites" / "s.records.jsonl"
    assert suite_result("s", tmp_path).startup_s is None
    rec.write_text('{"collected": 3, "ready_s": 4.2}\n{"running": "a"}\n{"collected": 3, "ready_s": 5.01}\n'
                   '{"collected": 3, "ready_s": null}\n{"collec')
    assert suite_result("s", tmp_path).startup_s == 5.01
    rec.write_text('{"collected": 3}\n')
    assert suite_result("s", tmp_path).startup_s is None


def test_a_suite_process_that_ends_otherwise_still_says_why_in_its_log(tmp_path):
    """Only a run that went as runs go ends early: a usage error raised after the session started (here two
    processes of one suite that collected different cases) keeps pytest's message in the log."""
    src, run_dir = tmp_path / "src", tmp_path / "run"
    src.mkdir()
    shutil.copy(REPO_ROOT / "suites" / "conftest.py", src / "conftest.py")
    (src / "conftest.py").write_text((src / "conftest.py").read_text() + '\npytest_plugins = ["nsa_validate.suite.claim"]\n')
    (src / "test_planted.py").write_text("import os, pytest\n\n@pytest.mark.parametrize('p', [os.getpid()])\n"
                                         "def test_a(p):\n    pass\n")
    for sub in ("suites", "logs"):
        (run_dir / sub).mkdir(parents=True)
    prof, device = profiles.resolve("cpu", "standard")
    suite = Suite("planted", str(src / "test_planted.py"), "a planted suite", SanityCfg, timeout_s=120)
    r = run_suite(suite, RunContext(profile=prof, device=device, timeout_s=120, workers=2), run_dir)
    assert r.status == "error" and r.returncode == 4, r
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("planted*.log"))
    assert "collected other cases than the first" in logs, logs[-2000:]
