"""A suite run as several pytest processes (``--workers``): each case runs once, in one of them;
the tables come back in case order; the processes are planned from the cores."""
import json
import os
import re

import pytest

from nsa_validate.config import profiles
from nsa_validate.errors import UsageError
from nsa_validate.report.extra import SuiteExtra, combined
from nsa_validate.run.execute import MAX_WORKERS, plan_workers
from test_cli import cli, run_dirs


def test_combined_puts_rows_notes_and_plots_back_in_case_order(tmp_path):
    """Two processes took cases 0, 2, 3 and 1, 4 in turn; each wrote its own file."""
    pos = [0]
    a = SuiteExtra(str(tmp_path), "extra.json", position=lambda: pos[0])
    b = SuiteExtra(str(tmp_path), "extra.1.json", position=lambda: pos[0])
    for case, ex in ((0, a), (1, b), (2, a), (3, a), (4, b)):
        pos[0] = case
        ex.row("t", {"case": case, "first": True})
        ex.row("t", {"case": case, "first": False})       # a case's own rows keep their order
        ex.note(f"note {case}")
    b.figure("headline", "x")
    b.set("suggest", {"k": 1})
    parts = [json.loads((tmp_path / f).read_text()) for f in ("extra.json", "extra.1.json")]
    out = combined(parts)
    assert [(r["case"], r["first"]) for r in out["tables"]["t"]] == [(c, f) for c in range(5) for f in (True, False)]
    assert out["notes"] == [f"note {c}" for c in range(5)]
    assert out["summary"] == {"headline": "x"} and out["suggest"] == {"k": 1} and "order" not in out


def test_a_suite_run_as_several_processes_takes_each_case_once(tmp_path):
    r = cli("suite", "sanity", "--profile", "cpu", "--workers", "2", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    run = run_dirs(tmp_path)[0]
    assert json.loads((run / "manifest.json").read_text())["workers"] == {"sanity": 2}
    lines = [json.loads(x) for x in (run / "suites" / "sanity.records.jsonl").read_text().splitlines()]
    collected = {d["collected"] for d in lines if "collected" in d}
    ids = [d["id"] for d in lines if "id" in d]
    assert len(collected) == 1 and len(ids) == collected.pop() and len(set(ids)) == len(ids), ids
    ran = [(run / "logs" / f).read_text().count("$ ") for f in ("sanity.log", "sanity.1.log")]
    assert ran == [1, 1], "one log per process, each with its command"
    assert not list((run / "suites").glob("sanity.claim*")), "the shared counter was left in the run folder"
    assert json.loads(r.stdout)["suites"]["sanity"]["counts"]["pass"] == len(ids)


def _profile(expected: dict) -> profiles.Profile:
    prof, _ = profiles.resolve("cpu", "quick")
    prof.suites.expected_s = expected
    return prof


def test_workers_are_planned_from_the_cores_and_the_suites_expected_times(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    prof = _profile({"a": 300, "b": 100, "c": 50})
    on_gpu = plan_workers([["a", "b", "c"]], prof, "cuda", None, None)
    assert on_gpu == {"a": 8, "b": 5, "c": 2}        # 15 cores, each to the longest expected time per process
    assert max(on_gpu.values()) == MAX_WORKERS
    assert plan_workers([["a"], ["b"]], prof, "cuda", None, None) == {"a": 7, "b": 7}   # two GPUs: half each
    assert plan_workers([["a", "b"]], prof, "cpu", None, None) == {"a": 8, "b": 8}      # one after another
    assert plan_workers([["a", "b"]], prof, "cuda", None, 3) == {"a": 3, "b": 3}
    assert plan_workers([["a", "b"]], prof, "cuda", False, None) == {"a": 1, "b": 1}


def test_several_processes_on_a_gpu_one_suite_at_a_time_is_refused():
    with pytest.raises(UsageError, match="--workers 2 on a GPU needs --share-gpu"):
        plan_workers([["a"]], _profile({}), "cuda", False, 2)


CLAIMED = '''
import os, time
import pytest

@pytest.fixture(scope="module")
def shared():
    with open("setups", "a") as f:
        f.write("x")

def test_a_long_case(shared):
    end = time.monotonic() + 20
    while not os.path.exists("b-ran") and time.monotonic() < end:
        time.sleep(0.05)
    assert os.path.exists("b-ran"), "the case after this one waited for this one to end"

def test_b(shared):
    open("b-ran", "w").close()

def test_c(shared):
    pass
'''


def test_a_long_case_keeps_no_case_from_the_other_processes(tmp_path):
    """A suite's processes (one module's cases, ``--claim-from``): the case after a long one is claimed only
    when that one ends, so another process runs it meanwhile; module fixtures stay up between a process's cases."""
    import subprocess
    import sys

    from nsa_validate.paths import REPO_ROOT
    (tmp_path / "test_claimed.py").write_text(CLAIMED)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "nsa_validate.suite.claim",
           "--rootdir", str(tmp_path), "--claim-from", str(tmp_path / "counter"), "test_claimed.py"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    passed = sum(int(n) for o in outs for n in re.findall(r"(\d+) passed", o))
    assert [p.returncode for p in procs] == [0, 0] and passed == 3, outs
    assert len((tmp_path / "setups").read_text()) <= 2, "a module fixture was set up again within one process"
