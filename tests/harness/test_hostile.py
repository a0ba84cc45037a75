"""Hostile input and faults, as a new user meets them: bad input is one line and exit 2; nothing the
user had (runs, profiles, baselines) is lost; an interrupted or killed run leaves a valid folder
marked for what happened. Signals and orphans use real processes; a full disk is simulated."""
import errno
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_cli import REPO, cli, cli_in_process, one_process
from test_compare import make_run

from nsa_validate.run import rundir
from nsa_validate.errors import UsageError
from nsa_validate.paths import REPO_ROOT

PROFILE_SM90 = REPO / "profiles" / "sm90.yaml"
ZERO = {"pass": 0, "fail": 0, "skip": 0, "error": 0}


def one_line_exit_2(r, needle: str = "") -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0], lines[0]


def merged_as_half_written(r, needle: str = "") -> None:
    """``merge RUN --json`` of a run whose results.json is malformed: the run is in the fleet report as
    half-written, saying what is wrong, and the fleet fails (exit 1), with no traceback."""
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "1 half-written of 1 runs" in r.stderr, r.stderr
    (run,) = json.loads(Path(json.loads(r.stdout)["json"]).read_text())["runs"]
    assert run["state"] == "half-written" and "results.json unreadable" in run["reason"] and needle in run["reason"]


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def tree(p: Path) -> dict:
    return {str(f.relative_to(p)): digest(f) for f in sorted(p.rglob("*")) if f.is_file()}


# -- 1. baseline save never writes into runs ---------------------------------------------
ART = REPO_ROOT / "artifacts"    # the default --out of cli(), run from the repo
@pytest.mark.parametrize("target", ["results", "run", "inside-run", "artifacts", "not-a-baseline", "folder"])
def test_baseline_out_never_touches_a_run(tmp_path, target):
    run = make_run(tmp_path, "run")
    (tmp_path / "other.txt").write_text("keep me")
    (tmp_path / "dir").mkdir()
    out = {"results": run / "results.json", "run": run, "inside-run": run / "sub" / "b.json",
           "artifacts": ART / "b.json", "not-a-baseline": tmp_path / "other.txt",
           "folder": tmp_path / "dir"}[target]
    before, art_before = tree(tmp_path), ART.exists() and tree(ART)
    r = cli("baseline", "save", str(run), "--name", "x", "--out", str(out))
    one_line_exit_2(r)
    assert tree(tmp_path) == before
    assert (ART.exists() and tree(ART)) == art_before
    assert cli("report", str(run)).returncode == 0


# -- 2. concurrent writers keep every earlier file -----------------------------------------
def test_concurrent_baseline_saves_lose_nothing(tmp_path):
    runs = [make_run(tmp_path, f"r{i}", seed=i) for i in range(4)]
    f = tmp_path / "bl" / "b.json"
    assert cli("baseline", "save", str(runs[0]), "--name", "b", "--out", str(f)).returncode == 0
    env = dict(os.environ, NO_COLOR="1")
    procs = [subprocess.Popen([sys.executable, "-m", "nsa_validate", "baseline", "save", str(r), "--name", "b",
                               "--out", str(f)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in runs[1:]]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    kept = [json.loads(x.read_text())["source"] for x in f.parent.glob("b.json.bak-*")]
    now = json.loads(f.read_text())["source"]
    assert sorted(kept + [now]) == sorted(str(r) for r in runs)      # four saves: the last + three backups
    assert not list(f.parent.glob("*.tmp")) and not list(f.parent.glob(".b.json.*.tmp"))


def _suggest_run(tmp_path: Path, prof: Path, name: str, suggest: dict) -> Path:
    run = tmp_path / f"run-{name}"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({
        "schema_version": 1, "manifest": {"profile": prof.stem, "profile_source": str(prof),
                                          "started": "2026-11-22T00:00:00+00:00"},
        "env": {"facts": {}}, "verdict": {"status": "pass", "totals": ZERO, "blocking": []},
        "suites": {"fa2": {"status": "pass", "cases": [], "counts": ZERO, "duration_s": 1.0,
                           "extra": {"suggest": suggest}}}}))
    return run


def test_concurrent_profile_apply_keeps_the_original(tmp_path):
    prof = tmp_path / "p" / "sm90.yaml"
    prof.parent.mkdir()
    prof.write_text(PROFILE_SM90.read_text())
    original = digest(prof)
    runs = [_suggest_run(tmp_path, prof, str(i), {"fa2_min_len_cmp": 1000 * (i + 1)}) for i in range(3)]
    env = dict(os.environ, NO_COLOR="1")
    procs = [subprocess.Popen([sys.executable, "-m", "nsa_validate", "profile", "suggest", str(r), "--apply"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in runs]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    backups = list(prof.parent.glob("sm90.yaml.bak-*"))
    assert len(backups) == 3 and original in {digest(b) for b in backups}
    yaml.safe_load(prof.read_text())                                   # still a valid profile


# -- 3. profile suggest rewrites the file the run used, and only values ----------------------
def test_suggest_apply_uses_the_runs_own_profile_file(tmp_path):
    shipped = REPO / "profiles" / "cpu.yaml"
    shipped_before = digest(shipped)
    custom = tmp_path / "cpu.yaml"                    # a custom profile that shares a shipped name
    custom.write_text(shipped.read_text())
    run = _suggest_run(tmp_path, custom, "c", {"fa2_min_len_cmp": 2048})
    r = cli("profile", "suggest", str(run), "--apply")
    assert r.returncode == 0, r.stderr
    assert digest(shipped) == shipped_before
    assert yaml.safe_load(custom.read_text())["routing"]["fa2_min_len_cmp"] == 2048
    assert not (REPO / "profiles" / "cpu.suggested.yaml").exists()


@pytest.mark.parametrize("value", ["1\nexpect: {peak_tflops: 1}", "null # x", -5, 3.5])
def test_a_suggested_value_cannot_inject_yaml(tmp_path, value):
    prof = tmp_path / "sm90.yaml"
    prof.write_text(PROFILE_SM90.read_text())
    before = tree(tmp_path)
    run = _suggest_run(tmp_path, prof, "i", {"fa2_min_len_cmp": value})
    r = cli("profile", "suggest", str(run), "--apply")
    one_line_exit_2(r, "fa2_min_len_cmp")
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("run-")} == before


def test_missing_profile_source_is_refused(tmp_path):
    run = _suggest_run(tmp_path, tmp_path / "gone.yaml", "g", {"fa2_min_len_cmp": 2048})
    one_line_exit_2(cli("profile", "suggest", str(run)), "not there any more")


# -- 4, 5. signals and orphans (real processes) ---------------------------------------------
def _signals_default() -> None:
    """The child takes SIGINT, SIGTERM and SIGHUP as from a terminal, whatever this process inherited: an
    ignored signal stays ignored in the run, on purpose (``test_an_ignored_sighup_stays_ignored``), and
    ignored is what they are where these tests themselves run in the background (``make test &`` from a
    script: POSIX shells start background commands with SIGINT ignored), or under nohup (SIGHUP)."""
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def _start(tmp_path: Path, *extra) -> subprocess.Popen:
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200")
    return subprocess.Popen([sys.executable, "-m", "nsa_validate", *one_process(["suite", "sanity", "--profile", "cpu",
                             "--out", str(tmp_path / "runs"), *extra])], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_signals_default if hasattr(signal, "SIGHUP") else None)


def _wait_for(pred, timeout=240.0, step=0.01):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError("timed out waiting")


def _run_dir(tmp_path: Path) -> Path | None:
    found = [p for p in (tmp_path / "runs").glob("*/*") if (p / "manifest.json").exists()]
    return found[0] if found else None


def _records(run: Path) -> list[str]:
    p = run / "suites" / "sanity.records.jsonl"
    if not p.exists():
        return []
    return [json.loads(x)["id"] for x in p.read_text().splitlines() if x.strip() and '"id"' in x]


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started, from any of its threads (the run starts its suites on one)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                        # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the suite process")
def test_sigkill_of_the_top_process_kills_the_suite_and_report_repairs(tmp_path):
    p = _start(tmp_path)
    run = _wait_for(lambda: _run_dir(tmp_path))
    _wait_for(lambda: len(_records(run)) >= 1)
    kids = _children(p.pid)
    assert kids, "no suite process found"
    p.kill()
    p.wait()
    _wait_for(lambda: not any(_alive(k) for k in kids), timeout=15)        # the suite died with its parent
    done = _records(run)
    r = cli("report", str(run), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads((run / "results.json").read_text())
    assert res["manifest"]["status"] == "interrupted (process vanished)"
    ids = {c["id"] for c in res["suites"]["sanity"]["cases"]}
    assert set(done) <= ids and res["verdict"]["status"] == "fail"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_right_after_the_folder_appears_leaves_it_interrupted(tmp_path, sig):
    p = _start(tmp_path)
    run = _wait_for(lambda: _run_dir(tmp_path), step=0.002)
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    res = json.loads((run / "results.json").read_text())
    assert res["manifest"]["status"] == "interrupted" and "Traceback" not in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
def test_two_quick_sigints_keep_the_finished_cases(tmp_path):
    p = _start(tmp_path)
    run = _wait_for(lambda: _run_dir(tmp_path))
    _wait_for(lambda: len(_records(run)) >= 2)
    p.send_signal(signal.SIGINT)
    time.sleep(0.03)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    done = _records(run)
    res = json.loads((run / "results.json").read_text())
    cases = {c["id"]: c["status"] for c in res["suites"]["sanity"]["cases"]}
    assert set(done) <= set(cases) and "not-run" not in cases
    assert res["manifest"]["status"] == "interrupted"


def test_repair_refuses_a_live_or_finished_run(tmp_path):
    run = make_run(tmp_path, "done")
    (run / "manifest.json").write_text(json.dumps({"status": "complete", "suites": []}))
    one_line_exit_2(cli("repair", str(run)), "not marked running")
    (run / "manifest.json").write_text(json.dumps({"status": "running", "pid": os.getpid(),
                                                   "host": os.uname().nodename, "suites": []}))
    one_line_exit_2(cli("repair", str(run)), "may still be running")


# -- 6. malformed files, unwritable places, a full disk ----------------------------------------
BAD_RESULTS = {"list": [], "null": None, "object": {}, "no-verdict": "verdict", "no-suites": "suites",
               "cases-not-list": "cases", "not-json": "{", "not-utf8": b"\xff\xfe{"}


def _bad_results(tmp_path: Path, kind: str) -> Path:
    run = make_run(tmp_path, f"bad-{kind}")
    res = json.loads((run / "results.json").read_text())
    v = BAD_RESULTS[kind]
    if isinstance(v, bytes):
        (run / "results.json").write_bytes(v)
        return run
    if kind in ("no-verdict", "no-suites"):
        del res[v]
    elif kind == "cases-not-list":
        res["suites"]["decode"]["cases"] = 3
    else:
        res = v
    (run / "results.json").write_text(res if isinstance(res, str) else json.dumps(res))
    return run


# the malformed files below go through every reading command: a real ``cli`` process for the kinds
# named here, the CLI's ``main()`` in this process for the others (the same code, without a new
# interpreter per command: ~0.5 s each)
END_TO_END = {"not-utf8", "deep"}


@pytest.mark.parametrize("kind", list(BAD_RESULTS))
def test_malformed_results_are_one_line(tmp_path, kind):
    run = cli if kind in END_TO_END else cli_in_process
    bad = _bad_results(tmp_path, kind)
    good = make_run(tmp_path, "good")
    for args in (["report", str(bad)], ["compare", str(bad), "--baseline", str(good)],
                 ["compare", str(good), "--baseline", str(bad)],
                 ["baseline", "save", str(bad), "--name", "x", "--out", str(tmp_path / "x.json")]):
        one_line_exit_2(run(*args))
    merged_as_half_written(run("merge", str(bad), "--out", str(tmp_path / "m"), "--json"))


def test_oneshot_with_a_malformed_baseline_stops_before_running(tmp_path):
    bad = _bad_results(tmp_path, "no-suites")
    r = cli("oneshot", "--baseline", str(bad), "--out", str(tmp_path / "runs"))
    one_line_exit_2(r)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*/*"))


@pytest.mark.parametrize("what", ["profile", "allow-skips"])
def test_non_utf8_files_are_one_line(tmp_path, what):
    f = tmp_path / ("p.yaml" if what == "profile" else "allow.yaml")
    f.write_bytes(b"name: \xff\xfe\n")
    args = ["--profile", str(f)] if what == "profile" else ["--strict", "--allow-skips", str(f)]
    one_line_exit_2(cli("suite", "sanity", *args, "--out", str(tmp_path / "o")), "UTF-8")


def test_long_path_components_are_one_line(tmp_path):
    run = make_run(tmp_path, "run")
    long = "x" * 300
    one_line_exit_2(cli("suite", "sanity", "--out", str(tmp_path / long)))
    one_line_exit_2(cli("baseline", "save", str(run), "--name", "x", "--out", str(tmp_path / f"{long}.json")),
                    "too long")
    one_line_exit_2(cli("report", str(tmp_path / long)))


def test_unwritable_places_are_one_line(tmp_path):
    run = make_run(tmp_path, "run")
    (tmp_path / "afile").write_text("")
    one_line_exit_2(cli("baseline", "save", str(run), "--name", "x", "--out", str(tmp_path / "afile" / "x.json")))
    (run / "report.md").mkdir()                                     # report.md cannot be replaced
    one_line_exit_2(cli("report", str(run)), str(run / "report.md"))
    assert json.loads((run / "results.json").read_text())["schema_version"] == 1


def test_a_full_disk_marks_the_folder_and_leaves_no_temp_files(tmp_path, monkeypatch):
    """ENOSPC while writing results.json: one line, exit 2, the folder marked 'error: disk full'."""
    from nsa_validate import cli as nv
    from nsa_validate import safefs
    from nsa_validate.run.execute import RunRequest, execute
    real = safefs.atomic_write

    def full(path, text):
        if Path(path).name == "results.json":
            tmp = Path(path).with_name("results.json.partial.tmp")
            tmp.write_text(text[:10])                     # what a full disk leaves behind
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, text)
    monkeypatch.setattr(safefs, "atomic_write", full)
    monkeypatch.setattr(sys, "argv", ["nsa-validate", "suite", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        try:
            execute(RunRequest([], "cpu", out=str(tmp_path)))
        except OSError as err:
            nv._exit_with_error(nv._os_error(err), 2)
    assert e.value.code == 2
    run = next(p for p in tmp_path.glob("*/*") if p.is_dir())
    assert json.loads((run / "manifest.json").read_text())["status"] == "error: disk full"
    assert not list(run.rglob("*.tmp"))


@pytest.mark.parametrize("free", ["in-place", "none"])
def test_a_disk_that_fills_up_is_named_marked_and_repairable(tmp_path, monkeypatch, free):
    """ENOSPC from results.json on, no new file can be made: the message names results.json; the
    manifest is marked by rewriting it in place (its blocks exist), and ``repair`` finishes the folder
    once there is space. With not a byte free from the start, nothing of the run is written: the
    empty folder is removed and the message says so."""
    import builtins

    from nsa_validate import cli as nv
    from nsa_validate import safefs
    from nsa_validate.run.execute import RunRequest, execute
    real_mkstemp, real_open = safefs.tempfile.mkstemp, builtins.open
    full = [] if free == "in-place" else [1]         # "none": not a byte from the start

    def mkstemp(*a, prefix="", **k):           # no new file once results.json is written
        if prefix.startswith(".results.json.") or full:
            full.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_mkstemp(*a, prefix=prefix, **k)

    def opener(file, mode="r", *a, **k):
        if full and free == "none" and ("w" in mode or "+" in mode or "a" in mode):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(file, mode, *a, **k)
    monkeypatch.setattr(safefs.tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(builtins, "open", opener)
    with pytest.raises(OSError) as e:
        execute(RunRequest([], "cpu", out=str(tmp_path)))
    monkeypatch.undo()
    msg = nv._os_error(e.value)            # the one line the CLI prints
    runs = [p for p in tmp_path.glob("*/*") if p.is_dir()]
    if free == "none":
        assert not runs and "manifest.json" in msg and "was removed" in msg, msg
        return
    assert "results.json" in msg, msg
    (run,) = runs
    assert json.loads((run / "manifest.json").read_text())["status"] == "error: disk full" and "is marked" in msg
    r = cli("repair", str(run))
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    res = json.loads((run / "results.json").read_text())
    assert res["manifest"]["status"] == "interrupted (error: disk full)"


# -- 7. profiles are range-checked -------------------------------------------------------------
@pytest.mark.parametrize("path,value,field", [
    ("suites.sanity.batch", 0, "suites.sanity.batch"),
    ("suites.sanity.seq_len", -3, "suites.sanity.seq_len"),
    ("suites.timeout_s.sanity", -1, "suites.timeout_s.sanity"),
    ("suites.sanity.dtypes", ["fp8"], "suites.sanity.dtypes[0]"),
    ("suites.triton.head_dims", [[0, 128]], "suites.triton.head_dims[0]"),
    ("routing.fa2_backend", "fast", "routing.fa2_backend"),
    ("routing.decode_backend", "cuda", "routing.decode_backend"),
    ("routing.sel_triton_min_len", -1, "routing.sel_triton_min_len"),
    ("suites.decode.batches", [0], "suites.decode.batches[0]"),
    ("suites.layer.shapes", [[1, 0]], "suites.layer.shapes[0]"),
])
def test_out_of_range_profile_values_are_bad_input(tmp_path, path, value, field):
    from nsa_validate.config import profiles
    data = yaml.safe_load((REPO / "profiles" / "cpu.yaml").read_text())
    node = data
    *parents, leaf = path.split(".")
    for k in parents:
        node = node[k]
    node[leaf] = value
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(UsageError, match=re.escape(f"'{field}'")):   # the file's own suites: the full sweep
        profiles.load(str(f), "full")                                 # (cpu's standard level overrides some)
    if path == "suites.sanity.batch":                  # and through the CLI, as users meet it
        one_line_exit_2(cli("suite", "sanity", "--profile", str(f), "--out", str(tmp_path / "o")), field)


# -- 8. the smaller ones ----------------------------------------------------------------------
def test_relative_out_with_dotdot_is_fine(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    # absolute, so the suite processes (which run in the repository) write where the user meant
    assert rundir.check_out("../runs") == (tmp_path / "a" / "runs").resolve()
    with pytest.raises(UsageError, match="system location"):
        rundir.check_out("/etc/nsa")
    with pytest.raises(UsageError, match="own code"):
        rundir.check_out(str(REPO / "kernels" / "runs"))


def test_allow_skips_without_strict_warns(tmp_path):
    allow = tmp_path / "allow.yaml"
    allow.write_text("fa2: no flash-attn here\n")
    r = cli("suite", "sanity", "--allow-skips", str(allow), "--profile", "sm999")
    assert "only matters with --strict" in r.stderr
    one_line_exit_2(r, "profile 'sm999' not found")


def test_errors_are_not_wrapped_and_json_gets_an_error_object(tmp_path):
    env = dict(os.environ, NO_COLOR="1")
    env.pop("COLUMNS", None)
    long = tmp_path / ("d" * 120)
    r = subprocess.run([sys.executable, "-m", "nsa_validate", "report", str(long), "--json"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    one_line_exit_2(r, str(long))
    assert json.loads(r.stdout) == {"error": r.stderr.strip().removeprefix("error: "), "exit_code": 2}


@pytest.mark.parametrize("args", [[], ["baseline"], ["profile"]])
def test_bare_commands_show_help_without_an_empty_error(args):
    r = cli(*args)
    assert r.returncode == 2 and "Usage" in (r.stdout + r.stderr)
    assert not any(x.strip() == "error:" for x in r.stderr.splitlines())


# -- found in review: nohup, a dead stderr, a run that died while writing its folder ---------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
def test_an_ignored_sighup_stays_ignored(tmp_path):
    """Under nohup (SIGHUP ignored) a logout must not stop the run."""
    env = dict(os.environ, NO_COLOR="1")
    p = subprocess.Popen([sys.executable, "-m", "nsa_validate", *one_process(["suite", "sanity", "--profile", "cpu", "--out",
                          str(tmp_path / "runs")])], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    run = _wait_for(lambda: _run_dir(tmp_path))
    p.send_signal(signal.SIGHUP)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]
    assert json.loads((run / "manifest.json").read_text())["status"] == "complete"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
def test_a_dead_stderr_does_not_lose_the_interrupted_run(tmp_path):
    """`nsa-validate ... 2>&1 | tee log` and Ctrl-C kills tee too: stderr is a broken pipe."""
    env = dict(os.environ, NO_COLOR="1")
    p = subprocess.Popen([sys.executable, "-m", "nsa_validate", *one_process(["suite", "sanity", "--profile", "cpu", "--out",
                          str(tmp_path / "runs")])], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         preexec_fn=_signals_default)
    run = _wait_for(lambda: _run_dir(tmp_path))
    _wait_for(lambda: len(_records(run)) >= 1)
    p.stderr.close()                                     # the reader is gone
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=120) == 130
    res = json.loads((run / "results.json").read_text())
    assert res["manifest"]["status"] == "interrupted" and set(_records(run)) <= {
        c["id"] for c in res["suites"]["sanity"]["cases"]}


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_repair_keeps_a_run_that_died_after_writing_its_results(tmp_path):
    """Killed between results.json and manifest.json (the last write): the run is finished; its
    manifest is restored from the results, which stay as they were."""
    run = make_run(tmp_path, "r")
    before = (run / "results.json").read_text()
    (run / "manifest.json").write_text(json.dumps({"status": "running", "pid": _dead_pid(),
                                                   "host": os.uname().nodename, "suites": ["decode"]}))
    r = cli("repair", str(run))
    assert r.returncode == 0, r.stderr
    assert (run / "results.json").read_text() == before
    assert json.loads((run / "manifest.json").read_text())["status"] == "complete"


def test_new_files_are_readable_by_others(tmp_path):
    from nsa_validate import safefs
    mask = os.umask(0o022)
    os.umask(mask)
    safefs.atomic_write(tmp_path / "f.json", "{}")
    assert (tmp_path / "f.json").stat().st_mode & 0o777 == 0o666 & ~safefs._UMASK


def test_unknown_user_home_and_short_verdicts_are_one_line(tmp_path):
    one_line_exit_2(cli("suite", "sanity", "--out", "~nosuchuser_nsa/x"), "nosuchuser_nsa")
    run = make_run(tmp_path, "r")
    res = json.loads((run / "results.json").read_text())
    res["verdict"] = {"status": "pass"}
    (run / "results.json").write_text(json.dumps(res))
    one_line_exit_2(cli("report", str(run)), "verdict.totals")
    merged_as_half_written(cli("merge", str(run), "--out", str(tmp_path / "m"), "--json"), "verdict.totals")


# -- issue 64: lost work, wrong verdicts --------------------------------------------------
@pytest.mark.parametrize("field,value", [("versions", "x"), ("suites", 5), ("dirty", "yes"), ("commit", 3)])
def test_a_malformed_baseline_file_is_refused_before_anything_runs(tmp_path, field, value):
    """Fields the comparison reads after the suites ran are checked up front: exit 2, no run folder."""
    good = make_run(tmp_path, "good")
    f = tmp_path / "b.json"
    assert cli("baseline", "save", str(good), "--name", "b", "--out", str(f)).returncode == 0
    data = json.loads(f.read_text())
    data[field] = value
    f.write_text(json.dumps(data))
    one_line_exit_2(cli("compare", str(good), "--baseline", str(f)), field)
    r = cli("oneshot", "--profile", "cpu", "--level", "quick", "--baseline", str(f), "--out", str(tmp_path / "runs"))
    one_line_exit_2(r, field)
    assert not list((tmp_path / "runs").glob("*/*"))


def test_a_failure_while_comparing_never_loses_the_run(tmp_path, monkeypatch):
    """The comparison breaking after the suites ran: results.json, the report and JUnit are still written,
    and the verdict fails naming why."""
    from nsa_validate.config import profiles
    from nsa_validate.run import compare
    from nsa_validate.run.finish import finish
    from nsa_validate.report.schema import CaseRecord, SuiteResult

    def broken(*a, **k):
        raise AttributeError("'str' object has no attribute 'get'")
    monkeypatch.setattr(compare, "compare", broken)
    prof, _ = profiles.resolve("cpu", "quick")
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    results = {"sanity": SuiteResult("sanity", "pass", 1.0, [CaseRecord("a", "sanity", "pass")])}
    res = finish(run_dir, {"run_id": "x/y", "suites": ["sanity"], "level": "quick"}, {"facts": {}}, prof, results,
                 strict=False, status="complete", baseline={"name": "b", "cases": {}, "timings": {}})
    assert res["verdict"]["status"] == "fail" and res["comparison"]["status"] == "error"
    assert any("comparison with the baseline failed" in b for b in res["verdict"]["blocking"])
    for f in ("results.json", "junit.xml", "report.md", "summary.txt"):
        assert (run_dir / f).is_file(), f


@pytest.mark.parametrize("cmd", ["suite", "merge"])
def test_out_inside_a_run_folder_is_refused(tmp_path, cmd):
    run = make_run(tmp_path, "run")
    before = tree(run)
    for out in (run, run / "sub"):
        args = (["suite", "sanity", "--profile", "cpu", "--level", "quick"] if cmd == "suite" else ["merge", str(run)])
        one_line_exit_2(cli(*args, "--out", str(out)), "inside the run folder")
    assert tree(run) == before


def test_an_error_that_went_away_is_not_a_regression(tmp_path):
    """A baseline whose suite process errored (its stand-in case) against a healthy run: not a regression."""
    base, now = make_run(tmp_path, "base"), make_run(tmp_path, "now")
    res = json.loads((base / "results.json").read_text())
    res["suites"]["decode"]["cases"].append({"id": "suite-process", "suite": "decode", "status": "error",
                                             "reason": "exited 1"})
    (base / "results.json").write_text(json.dumps(res))
    r = cli("compare", str(now), "--baseline", str(base), "--json")
    assert r.returncode == 0, r.stderr
    assert {x["metric"]: x["verdict"] for x in json.loads(r.stdout)["rows"]}["decode/suite-process"] == "gone"


@pytest.mark.parametrize("kind", ["failed", "empty"])
def test_baseline_save_refuses_a_failed_or_empty_run_without_force(tmp_path, kind):
    run = make_run(tmp_path, "run", parity="fail") if kind == "failed" else make_run(tmp_path, "run")
    if kind == "empty":
        res = json.loads((run / "results.json").read_text())
        res["verdict"]["totals"] = dict(ZERO, skip=3)
        (run / "results.json").write_text(json.dumps(res))
    f = tmp_path / "b.json"
    one_line_exit_2(cli("baseline", "save", str(run), "--name", "b", "--out", str(f)), "--force")
    assert not f.exists()
    r = cli("baseline", "save", str(run), "--name", "b", "--out", str(f), "--force")
    assert r.returncode == 0 and f.is_file() and "warning" in r.stderr, r.stderr


def test_an_invalid_k_expression_is_bad_input(tmp_path):
    r = cli("suite", "sanity", "--profile", "cpu", "--level", "quick", "-k", "and or (", "--out", str(tmp_path / "o"))
    one_line_exit_2(r, "-k")
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


_EARLY_RUN = ("--level", "quick", "-k", "short_sequences_finite and 1-fp32")


@pytest.fixture(scope="module")
def early_run_s(tmp_path_factory) -> float:
    """Seconds the run of ``test_a_sigint_while_torch_imports_is_kept`` takes uninterrupted on this machine
    (its caches as warm as they will be for the interrupted ones): a fixed delay outlasted it on a fast one."""
    t0 = time.monotonic()
    p = _start(tmp_path_factory.mktemp("whole"), *_EARLY_RUN)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    return time.monotonic() - t0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
@pytest.mark.parametrize("part", [0.2, 0.4, 0.6])
def test_a_sigint_while_torch_imports_is_kept(tmp_path, part, early_run_s):
    """SIGINT in the run's first moments, at a part of the time it takes uninterrupted here (the CLI importing
    torch, the environment check, the suite's start): the run stops with exit 130, never a PASS; a folder,
    where one was made by then, is marked interrupted."""
    p = _start(tmp_path, *_EARLY_RUN)
    time.sleep(part * early_run_s)
    assert p.poll() is None, "the run ended before the signal"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "PASS" not in err
    run = _run_dir(tmp_path)
    if run is not None:
        assert json.loads((run / "manifest.json").read_text())["status"] == "interrupted"


def _git(d: Path, *args) -> None:
    subprocess.run(["git", "-C", str(d), *args], check=True, capture_output=True,
                   env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                            GIT_COMMITTER_EMAIL="t@t"))


def test_a_copy_inside_another_repository_is_nogit(tmp_path):
    """Provenance names the project's commit only where the project is the work tree's top."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("x")
    _git(tmp_path, "add", "f")
    _git(tmp_path, "commit", "-q", "-m", "other project")
    proj = tmp_path / "copy"
    proj.mkdir()
    assert rundir.git_info(proj) == {"commit": None, "short": "nogit", "dirty": False}
    assert rundir.git_info(tmp_path)["short"] != "nogit"


def test_the_tools_own_files_do_not_make_a_clean_tree_dirty(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "cpu.yaml").write_text("name: cpu\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "clean")
    (tmp_path / "profiles" / ".cpu.yaml.lock").write_text("")
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "h200.json").write_text("{}")
    assert rundir.git_info(tmp_path)["dirty"] is False
    (tmp_path / "profiles" / "cpu.yaml").write_text("name: edited\n")
    assert rundir.git_info(tmp_path)["dirty"] is True


def test_baseline_save_writes_through_a_link_and_refuses_system_folders(tmp_path):
    run = make_run(tmp_path, "run")
    real = tmp_path / "shared" / "b.json"
    real.parent.mkdir()
    assert cli("baseline", "save", str(run), "--name", "b", "--out", str(real)).returncode == 0
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert cli("baseline", "save", str(run), "--name", "c", "--out", str(link)).returncode == 0
    assert link.is_symlink() and json.loads(real.read_text())["name"] == "c"
    one_line_exit_2(cli("baseline", "save", str(run), "--name", "b", "--out", "/etc/nsa-validate-test.json"), "system")
    assert not Path("/etc/nsa-validate-test.json").exists()


def test_a_folder_given_as_a_profile_is_named_so(tmp_path):
    one_line_exit_2(cli("suite", "sanity", "--profile", str(tmp_path), "--out", str(tmp_path / "o")), "is a folder")


def test_headlines_of_unfinished_runs_say_what_stopped_them():
    from nsa_validate.run.finish import _unfinished_headline
    from nsa_validate.report.schema import SuiteResult
    assert "environment broken" in _unfinished_headline("env-broken", {}, {})
    h = _unfinished_headline("interrupted", {"sanity": SuiteResult("sanity", "pass", cases=[]),
                                             "triton": SuiteResult("triton", "error", cases=[])}, {})
    assert h.startswith("FAIL: run interrupted") and "triton stopped" in h and "errored" not in h


def test_merge_counts_a_run_named_twice_once_and_a_cpu_key_reads_plainly(tmp_path):
    run = make_run(tmp_path, "run")
    r = cli("merge", str(run), str(tmp_path / "." / "run"), "--out", str(tmp_path / "m"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["runs"] == 1, r.stderr
    cpu = make_run(tmp_path, "cpu", gpu={"name": "none (CPU)"})
    res = json.loads((cpu / "results.json").read_text())
    res["env"]["facts"].pop("gpu")
    (cpu / "results.json").write_text(json.dumps(res))
    r = cli("compare", str(cpu), "--baseline", str(run))
    one_line_exit_2(r, "made on a CPU with profile sm90")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent(tmp_path):
    """``orphans.die_with_parent``, which the environment probe, git, ncu, the decode loop and the suites
    start their children with: the parent SIGKILLed, the child goes too (no ppid-1 leftovers)."""
    script = ("import subprocess, sys, time\n"
              "from nsa_validate import orphans\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
              " preexec_fn=orphans.die_with_parent())\n"
              "print(c.pid, flush=True)\n"
              "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    p.kill()
    p.wait(timeout=10)

    def gone() -> bool:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        return state == "Z"
    assert _wait_for(gone, timeout=10), f"child {child} outlived its parent"


@pytest.mark.parametrize("kind", ["env", "metrics", "tables", "suggest", "median", "deep", "manifest-suites"])
def test_malformed_nested_fields_are_one_line(tmp_path, kind):
    """Nested fields readers compute with are checked at load, in one place (``schema.check_results``):
    report, compare, baseline save and profile suggest give one line and exit 2, under --json a
    JSON error object too; merge reports the run as half-written and fails the fleet."""
    run = make_run(tmp_path, "run")
    f = run / "results.json"
    res = json.loads(f.read_text())
    dec = res["suites"]["decode"]
    if kind == "env":
        res["env"] = "x"
    elif kind == "metrics":
        dec["cases"][0]["metrics"] = [1, 2]
    elif kind == "tables":
        dec["extra"]["tables"] = "x"
    elif kind == "suggest":
        dec["extra"]["suggest"] = [1]
    elif kind == "median":
        dec["cases"][1]["metrics"]["graph"]["median_ms"] = "x"
    elif kind == "manifest-suites":
        res["manifest"]["suites"] = 5
    f.write_text(json.dumps(res) if kind != "deep" else "[" * 100_000 + "]" * 100_000)
    good = make_run(tmp_path, "good")
    cli_run = cli if kind in END_TO_END else cli_in_process
    for args in (["report", str(run), "--embed-plots"], ["compare", str(run), "--baseline", str(good)],
                 ["compare", str(good), "--baseline", str(run)],
                 ["baseline", "save", str(run), "--name", "x", "--out", str(tmp_path / "x.json")],
                 ["profile", "suggest", str(run)]):
        r = cli_run(*args, "--json")
        one_line_exit_2(r)
        assert json.loads(r.stdout.strip().splitlines()[-1])["exit_code"] == 2, (args, r.stdout)
    merged_as_half_written(cli_run("merge", str(run), "--out", str(tmp_path / "m"), "--json"))


@pytest.mark.parametrize("line", [b'{"id": "a", "suite": "sanity", "status": "pass", "nope": 1}', b"[1, 2]", b"42",
                                  b'{"id": "a", "suite": "sanity", "status": "weird"}', b'{"collected": "many"}',
                                  b'{"id": "\\xff\\xfe", "suite": "sanity", "status": "pass"}\xff'])
def test_repair_skips_a_malformed_record_with_a_warning(tmp_path, line):
    """A damaged records line: ``repair`` finishes the run, the line skipped and named in an error case."""
    run = tmp_path / "r"
    (run / "suites").mkdir(parents=True)
    (run / "logs").mkdir()
    good = json.dumps({"id": "b", "suite": "sanity", "status": "pass"}).encode()
    (run / "suites" / "sanity.records.jsonl").write_bytes(b'{"collected": 2}\n' + good + b"\n" + line + b"\n")
    (run / "manifest.json").write_text(json.dumps({"status": "running", "pid": _dead_pid(), "host": os.uname().nodename,
                                                   "suites": ["sanity"], "profile": "cpu"}))
    r = cli("repair", str(run))
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    cases = {c["id"]: c for c in json.loads((run / "results.json").read_text())["suites"]["sanity"]["cases"]}
    assert cases["b"]["status"] == "pass"
    if line.startswith(b'{"id": "\\xff'):          # the bytes are replaced: a record still
        return
    assert cases["suite-records"]["status"] == "error" and "malformed" in cases["suite-records"]["reason"]


def test_a_failed_write_names_the_target_and_a_failed_merge_leaves_no_folder(tmp_path, monkeypatch):
    """A read-only folder (as mkstemp reports it) names the file the user asked for, not our temporary
    one; a merge whose report cannot be written leaves no half-made folder behind."""
    from nsa_validate import cli as nv
    from nsa_validate import safefs
    run = make_run(tmp_path, "run")

    def refused(*a, **k):
        raise OSError(errno.EACCES, "Permission denied", str(tmp_path / ".fleet.md.abc.tmp"))
    monkeypatch.setattr(safefs.tempfile, "mkstemp", refused)
    with pytest.raises(OSError) as e:
        safefs.atomic_write(tmp_path / "fleet.md", "x")
    assert e.value.filename == str(tmp_path / "fleet.md")
    with pytest.raises(OSError):
        nv.merge_cmd([run], expect=None, expect_count=None, out=str(tmp_path / "m"), json_out=False)
    assert not list((tmp_path / "m").glob("fleet/*"))
