"""examples/slurm/ on a real Slurm: the validate array and the dependent merge job, submitted with
submit.sh to whatever cluster `sinfo` answers for (.ci/slurm-up brings up a one-node one on localhost),
and the health check draining a node. No mocked scheduler: skipped, with the reason, where Slurm is not
installed or does not answer.

The runs use the CPU profile and one sanity case (`-k`), so a task takes about a minute on a CPU. The
validate tasks take a whole node each (--exclusive): on a one-node cluster they run one after another,
and so do those of tests running at once."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nsa_validate.paths import REPO_ROOT as REPO

SLURM = REPO / "examples" / "slurm"
TOOLS = ("sbatch", "scontrol", "sinfo", "squeue", "scancel", "slurmctld", "slurmd")
SELECT = "short_sequences and 7"            # one sanity case: a run passes in about a minute on a CPU
# with a case of seconds (the Triton forward under the interpreter): a run limited to 1 s a suite fails there,
# however quickly its processes start
SLOW_SELECT = f"({SELECT}) or test_forward"
WAIT_S = 600                                # for the merge job: two runs, one after the other, on a busy CPU
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED"}


def _why_no_slurm() -> str | None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"Slurm is not installed here (no {', '.join(missing)}; .ci/slurm-up brings up a one-node cluster)"
    try:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "Slurm is installed but slurmctld does not answer (sinfo timed out)"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return f"Slurm is installed but slurmctld does not answer (sinfo: {last})"
    up = [line for line in r.stdout.split() if line in ("idle", "mix", "alloc", "comp")]
    if not up:
        return f"Slurm answers but no node is up to run jobs (sinfo: {' '.join(r.stdout.split())})"
    return None


pytestmark = pytest.mark.skipif(bool(_why := _why_no_slurm()), reason=_why or "")


def nsa_validate() -> str:
    """The nsa-validate of this interpreter (make test runs inside .venv): what every job runs."""
    exe = Path(sys.executable).parent / "nsa-validate"
    return str(exe) if exe.is_file() else f"{sys.executable} -m nsa_validate"


def job_env(out: Path, **more) -> dict:
    env = dict(os.environ, NSA_OUT=str(out), NSA_VALIDATE=nsa_validate(), NSA_PROFILE="cpu", NSA_LEVEL="quick",
               NSA_GPUS="",                     # no GPU here: `--gpus all` would be a usage error (exit 2)
               NSA_SELECT=SELECT, NSA_ARGS="--workers 1", NO_COLOR="1", OMP_NUM_THREADS="1")
    return {**env, **more}


def submit(out: Path, count: int, env: dict) -> tuple[str, str]:
    r = subprocess.run([str(SLURM / "submit.sh"), str(count)], env=env, cwd=out, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    validate = re.search(r"^validate: job (\d+)", r.stdout, re.M)
    merge = re.search(r"^merge: job (\d+)", r.stdout, re.M)
    assert validate and merge, r.stdout
    return validate.group(1), merge.group(1)


def job_record(job: str) -> dict[str, str]:
    """`scontrol show job -o JOB`'s first record as {field: value}."""
    r = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    line = r.stdout.splitlines()[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"(?:^| )([A-Za-z_/:]+)=(.*?)(?= [A-Za-z_/:]+=|$)", line)}


def wait_for(job: str, timeout: float = WAIT_S) -> dict[str, str]:
    """The job's record once it has ended (fails the test after ``timeout`` seconds)."""
    end = time.monotonic() + timeout
    while True:
        rec = job_record(job)
        if rec["JobState"] in DONE:
            return rec
        assert time.monotonic() < end, (f"job {job} still {rec['JobState']} ({rec.get('Reason')}) after {timeout:.0f} s;"
                                        f" squeue:\n{subprocess.run(['squeue'], capture_output=True, text=True).stdout}")
        time.sleep(3)


def exit_code(rec: dict[str, str]) -> int:
    code, signal = rec["ExitCode"].split(":")
    return int(code) if signal == "0" else 128 + int(signal)


@pytest.fixture
def jobs():
    """Job ids the test submitted: cancelled at the end if still queued or running (a failed test)."""
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=30)


def read_merge(out: Path, validate: str, merge: str, rec: dict[str, str]) -> tuple[dict, str, str]:
    """fleet.json and fleet.md of the merge job, and its log."""
    log = (out / "slurm-logs" / f"merge-{merge}.out").read_text()
    reports = sorted((out / f"slurm-{validate}" / "fleet").glob("*/fleet.json"))
    assert len(reports) == 1, (reports, rec, log)
    return json.loads(reports[0].read_text()), (reports[0].parent / "fleet.md").read_text(), log


def test_an_array_of_two_passes_and_the_merge_job_exits_0(tmp_path, jobs):
    out = tmp_path / "shared"
    validate, merge = submit(tmp_path, 2, job_env(out))
    jobs += [validate, merge]
    rec = wait_for(merge)
    fleet, md, log = read_merge(out, validate, merge, rec)
    tasks = [f"{validate}_{i}" for i in range(2)]
    node = job_record(tasks[0])["NodeList"]
    names = [f"{job_record(t)['NodeList']}-{i}" for i, t in enumerate(tasks)]     # as validate.sbatch names them
    assert node and node != "(null)"
    # the merge job expected both tasks by name (from scontrol), and found a run of each
    assert fleet["expected"]["nodes"] == names and fleet["expected"]["missing_nodes"] == [], (fleet["expected"], log)
    assert sorted(r["node"] for r in fleet["runs"]) == names, log
    assert all(Path(r["run"]).is_relative_to(out / f"slurm-{validate}") for r in fleet["runs"])
    for r in fleet["runs"]:                     # the node's name in each run folder
        assert re.fullmatch(rf"\d{{8}}T\d{{6}}Z-{re.escape(r['node'])}", Path(r["run"]).name), r["run"]
        assert json.loads((Path(r["run"]) / "manifest.json").read_text())["select"] == SELECT
    # one sanity case ran and passed; the other suites selected nothing: PARTIAL, which passes
    assert {r["state"] for r in fleet["runs"]} == {"partial"}, fleet["runs"]
    assert fleet["verdict"] == "partial" and fleet["counts"]["runs"] == 2 and fleet["counts"]["missing"] == 0
    assert md.startswith("# ") and "PARTIAL" in md.splitlines()[0] and all(n in md for n in names), md
    assert fleet["line"] in log and "fleet.md" in log
    # the merge job's exit code is the merge's: 0, every run passed
    assert rec["JobState"] == "COMPLETED" and exit_code(rec) == 0, (rec["ExitCode"], log)
    for t in tasks:                             # and each validate task's is its oneshot's
        assert exit_code(job_record(t)) == 0, (out / "slurm-logs" / f"validate-{t}.out").read_text()[-3000:]


def test_a_failed_and_a_missing_run_make_the_merge_job_exit_1(tmp_path, jobs):
    """Task 0's oneshot fails (its suites stopped after 1 s: --timeout 1, a case of seconds selected); task 1's node has no
    nsa-validate (exit 127, no run folder). The merge job names both and exits 1."""
    wrapper = tmp_path / "nsa-validate-on-node"
    wrapper.write_text("#!/bin/sh\n"            # the merge job (no task id) runs the real one
                       'case "$SLURM_ARRAY_TASK_ID" in\n'
                       f'  0) exec {nsa_validate()} "$@" --timeout 1 -k "{SLOW_SELECT}" ;;\n'
                       '  1) exec /nonexistent/nsa-validate "$@" ;;\n'
                       'esac\n'
                       f'exec {nsa_validate()} "$@"\n')
    wrapper.chmod(0o755)
    out = tmp_path / "shared"
    validate, merge = submit(tmp_path, 2, job_env(out, NSA_VALIDATE=str(wrapper)))
    jobs += [validate, merge]
    rec = wait_for(merge)
    fleet, md, log = read_merge(out, validate, merge, rec)
    t0, t1 = (job_record(f"{validate}_{i}") for i in range(2))
    failed, missing = f"{t0['NodeList']}-0", f"{t1['NodeList']}-1"
    assert exit_code(t0) == 1 and exit_code(t1) == 127, (t0["ExitCode"], t1["ExitCode"])
    assert fleet["verdict"] == "fail" and rec["JobState"] == "FAILED" and exit_code(rec) == 1, (rec["ExitCode"], log)
    assert [(r["node"], r["state"]) for r in fleet["runs"]] == [(failed, "fail")], fleet["runs"]
    assert fleet["expected"]["missing_nodes"] == [missing] and fleet["counts"]["missing"] == 1, fleet["expected"]
    assert timed_out(Path(fleet["runs"][0]["run"]))
    assert md.splitlines()[0].endswith("FAIL") and failed in md and missing in md, md


def timed_out(run_dir: Path) -> bool:
    """Every suite of the run was stopped by --timeout 1 (its process an error case saying so)."""
    res = json.loads((run_dir / "results.json").read_text())
    reasons = [c.get("reason") or "" for s in res["suites"].values() for c in s["cases"] if c["status"] == "error"]
    return res["verdict"]["status"] == "fail" and bool(reasons) and all("timed out after 1s" in r for r in reasons)


def node_reason(node: str) -> tuple[str, str]:
    r = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t|%E"], capture_output=True, text=True, timeout=30)
    state, _, reason = r.stdout.strip().partition("|")
    return state, reason


def test_the_health_check_drains_a_failing_node_with_its_first_blocking_line(tmp_path):
    """healthcheck.sh run on the node as root (as a cron job or a Prolog would): a failing oneshot
    drains the node, its reason `nsa-validate: <the verdict's first blocking line>`; resumed after."""
    if os.geteuid() != 0:
        pytest.skip("draining a node takes Slurm admin rights: this test runs as root")
    node = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True,
                          timeout=30).stdout.split()[0]
    env = dict(job_env(tmp_path / "runs"), NSA_DRAIN_NODE=node)
    args = ["oneshot", "--out", str(tmp_path / "runs"), "--profile", "cpu", "--level", "quick", "-k", SLOW_SELECT,
            "--workers", "1", "--timeout", "1"]
    try:
        r = subprocess.run([str(SLURM / "healthcheck.sh"), *args], env=env, capture_output=True, text=True,
                           timeout=300)
        state, reason = node_reason(node)
    finally:
        _, why = node_reason(node)
        if why.startswith("nsa-validate:"):     # only a drain of this test's is undone
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, timeout=30)
    assert r.returncode == 1, r.stderr[-3000:]
    run_dir = Path(json.loads(r.stdout)["run_dir"])
    assert timed_out(run_dir)
    first = json.loads((run_dir / "results.json").read_text())["verdict"]["blocking"][0]
    want = f"nsa-validate: {first}"
    want = want if len(want) <= 200 else want[:197] + "..."        # healthcheck.sh's REASON_MAX
    assert state.startswith("dr") and reason == want, (state, reason, r.stderr[-500:])
    assert f"drained {node}: nsa-validate: " in r.stderr
    assert not node_reason(node)[0].startswith("dr")
