"""The CLI as users run it: exit codes, run folders, bad input, interruption."""
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

from nsa_validate.paths import REPO_ROOT as REPO

RUN_FILES = ["manifest.json", "env.json", "routing.json", "results.json", "report.md", "summary.txt", "junit.xml",
             "metrics.csv"]


def one_process(args) -> list[str]:
    """``args`` with ``--workers 1`` where they run suites and say nothing of it: `make test` already
    runs a pytest process per core, so a run under test takes one process per suite unless the test
    is about a suite's processes (``test_a_suite_run_as_several_processes…``)."""
    args = list(args)
    runs = bool(args) and args[0] in ("suite", "oneshot") and not {"-h", "--help"} & set(args)
    return args + ["--workers", "1"] if runs and "--workers" not in args else args


def cli(*args, timeout=900):
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "nsa_validate", *one_process(args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def cli_in_process(*args) -> subprocess.CompletedProcess:
    """``cli(*args)`` without a new interpreter (~0.5 s each): the CLI's own ``main()`` called here with
    ``args`` as its command line, its exit code, stdout and stderr caught as ``cli`` returns them. For
    the commands that read run folders and write files (report, compare, baseline save, merge, profile
    suggest) over many hostile inputs; each behaviour keeps a real ``cli`` run as well."""
    import contextlib
    import io

    from nsa_validate import cli as nv
    from nsa_validate import console
    out, err = io.StringIO(), io.StringIO()
    argv, stream = sys.argv, console.err.file.stream        # rich's stderr keeps the stream it started with
    sys.argv, console.err.file.stream = ["nsa-validate", *args], err
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            nv.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, console.err.file.stream = argv, stream
    return subprocess.CompletedProcess(["nsa-validate", *args], code, out.getvalue(), err.getvalue())


def run_dirs(root: Path):
    return sorted(p for p in root.glob("*/*") if p.is_dir())


def test_list_json():
    r = cli("list", "--json")
    assert r.returncode == 0
    names = {s["name"] for s in json.loads(r.stdout)}
    assert names == {"sanity", "triton", "fa2", "decode", "layer", "counters"}


def test_version_and_short_help():
    import nsa_validate
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"nsa-validate {nsa_validate.__version__}"
    for args in (("-h",), ("suite", "-h"), ("baseline", "-h"), ("profile", "suggest", "-h")):
        r = cli(*args)
        assert r.returncode == 0 and "Usage:" in r.stdout, (args, r.stdout[-300:], r.stderr[-300:])


@pytest.mark.parametrize("args", [["--help"], ["list"], ["suite", "--help"], ["compare", "--help"]], ids=" ".join)
def test_light_commands_load_neither_torch_nor_pandas(args):
    """--help, list and the like answer in under a second: torch (and pandas, matplotlib) are only
    imported by commands that use them. The second is the command's own CPU time (interpreter start included),
    what it takes on an idle machine: under `make test` the other processes keep the cores busy, and the wall
    time of `compare --help` reached 1.00 s there (0.5 s idle). A help text loads no pydantic either (typer
    would import it to coerce the root's unset flags: ``cli.ROOT_FLAGS_UNSET``)."""
    import resource
    heavy = ("torch", "pandas", "matplotlib", "triton", *(("pydantic",) if "--help" in args else ()))
    code = ("import sys; sys.argv = ['nsa-validate', *%r]\n"
            "from nsa_validate.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in %r if m in sys.modules), file=sys.stderr)" % (args, heavy))
    def children_cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime
    t0, c0 = time.perf_counter(), children_cpu()
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "[]", f"{args} imported {r.stderr.strip().splitlines()[-1]}"
    assert cpu < 1.0, f"nsa-validate {' '.join(args)} took {cpu:.2f} s of CPU ({wall:.2f} s wall; interpreter start included)"


COMPLETE = "import sys; sys.argv[0] = 'nsa-validate'; from nsa_validate.cli import main; main()"


def test_shell_completion_offers_suites_and_profiles():
    env = dict(os.environ, _NSA_VALIDATE_COMPLETE="complete_bash", COMP_CWORD="4",
               COMP_WORDS="nsa-validate suite sanity --profile sm")
    r = subprocess.run([sys.executable, "-c", COMPLETE], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert {"sm80", "sm90", "sm100"} <= set(r.stdout.split()), r.stdout + r.stderr
    env.update(COMP_CWORD="2", COMP_WORDS="nsa-validate suite de")
    r = subprocess.run([sys.executable, "-c", COMPLETE], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert "decode" in r.stdout.split(), r.stdout + r.stderr


def test_k_selects_cases_and_timeout_limits_each_suite(tmp_path):
    r = cli("suite", "sanity", "-k", "short_sequences and 7", "--out", str(tmp_path / "a"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    run = next((tmp_path / "a").glob("*/*"))
    ids = [c["id"] for c in json.loads((run / "results.json").read_text())["suites"]["sanity"]["cases"]]
    assert ids and all(i.startswith("short_sequences_finite[7-") for i in ids), ids
    assert json.loads((run / "manifest.json").read_text())["select"] == "short_sequences and 7"
    # a case of seconds (the Triton forward under the interpreter, on the CPU whatever the machine): its
    # suite is stopped at 1 s however quickly its process starts
    r = cli("suite", "triton", "--profile", "cpu", "--level", "quick", "-k", "test_forward",
            "--timeout", "1", "--out", str(tmp_path / "b"), "--json")
    assert r.returncode == 1 and "timed out after 1s" in r.stderr, r.stderr[-2000:]


def test_runs_land_under_the_current_directory(tmp_path):
    env = dict(os.environ, NO_COLOR="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "nsa_validate", *one_process(["suite", "sanity", "-k", "short_sequences and 7"])],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(run_dirs(tmp_path / "artifacts")) == 1


def test_env_json_on_stdout_tables_on_stderr():
    r = cli("env", "--json")
    assert r.returncode in (0, 3)
    data = json.loads(r.stdout)
    assert data["verdict"] in ("ok", "degraded", "broken") and "check" in r.stderr
    ce = data["facts"]["collect_env"]                     # torch.utils.collect_env's own report
    assert "error" not in ce and ce["torch_version"] == data["facts"]["torch"] and ce["os"]


@pytest.mark.parametrize("args,needle", [
    (["suite", "nosuch"], "'nosuch' is not one of 'sanity'"),
    (["suite", "sanity", "--profile", "sm999"], "profile 'sm999' not found"),
    (["suite", "sanity", "--out", "/proc/nsa"], "system location"),
    (["suite", "sanity", "--out", ""], "--out is empty"),
    (["report", "/nonexistent/run"], "no results.json"),
    (["oneshot", "--frobnicate"], "No such option"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 3


def test_malformed_profile_and_unwritable_out(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsuites: {sanity: {batch: many}}\n")
    r = cli("suite", "sanity", "--profile", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "suites.sanity.batch" in r.stderr and "Traceback" not in r.stderr
    afile = tmp_path / "file"
    afile.write_text("")
    r = cli("suite", "sanity", "--out", str(afile / "sub"))
    assert r.returncode == 2 and "not writable" in r.stderr and "Traceback" not in r.stderr
    r = cli("report", str(tmp_path))
    assert r.returncode == 2 and "no results.json" in r.stderr


def test_report_rerenders_identically(tmp_path):
    r = cli("suite", "sanity", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    (d,) = run_dirs(tmp_path)
    before = (d / "report.md").read_text()
    r = cli("report", str(d))
    assert r.returncode == 0 and (d / "report.md").read_text() == before


def test_strict_fails_on_a_skipped_case(tmp_path):
    """A profile with no decode sizes: the suite's cases skip with the profile field named; the run
    passes, and --strict fails on that skip."""
    prof = _small_profile(tmp_path)
    p = yaml.safe_load(prof.read_text())
    p["suites"]["decode"].update(contexts=[], batches=[])
    prof.write_text(yaml.safe_dump(p))
    r = cli("suite", "decode", "--profile", str(prof), "--out", str(tmp_path), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["suites"]["decode"]["status"] == "skip", r.stderr[-2000:]
    # the hardware-counter case too names the field, before it looks for ncu (on a GPU with ncu it used
    # to fail on the empty sizes)
    (d,) = run_dirs(tmp_path)
    cases = {c["id"]: c for c in json.loads((d / "results.json").read_text())["suites"]["decode"]["cases"]}
    assert "suites.decode.contexts" in cases["dram_reads"]["reason"], cases["dram_reads"]
    r = cli("suite", "decode", "--profile", str(prof), "--out", str(tmp_path), "--strict", "--json")
    blocking = " ".join(json.loads(r.stdout)["verdict"]["blocking"])
    assert r.returncode == 1 and "suites.decode.contexts" in blocking, blocking


def test_sigint_leaves_folder_marked_interrupted(tmp_path):
    env = dict(os.environ, NO_COLOR="1")
    # a runner started in the background by a shell without job control inherits SIGINT ignored
    # (POSIX); Ctrl-C at a terminal is what this test stands for, so the child gets the default
    # one suite after another (on a GPU they would run at once): sanity has not started when counters is stopped
    p = subprocess.Popen([sys.executable, "-m", "nsa_validate",
                          *one_process(["suite", "counters", "sanity", "--one-at-a-time", "--out", str(tmp_path)])],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob("*/*/suites/counters.records.jsonl")):
        time.sleep(0.2)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr[-2000:]
    (d,) = run_dirs(tmp_path)
    man = json.loads((d / "manifest.json").read_text())
    res = json.loads((d / "results.json").read_text())
    assert man["status"] == "interrupted" and res["verdict"]["status"] == "fail"
    assert (d / "report.md").is_file() and "Traceback" not in stderr
    # the suite in flight keeps the cases it finished, and says it was interrupted
    counters = res["suites"]["counters"]
    assert counters["reason"] == "interrupted" and counters["cases"][-1]["id"] == "suite-process"
    assert res["suites"]["sanity"]["cases"][0]["id"] == "not-run"


def _small_profile(tmp_path) -> Path:
    """This machine's shipped profile with the triton and decode suites cut to one small shape (the
    full suites run in their own tests; on a CPU the interpreter is slow)."""
    import torch

    from nsa_validate.config.profiles import auto_name, resolved
    name = auto_name(torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    prof = resolved(REPO / "profiles" / f"{name}.yaml")    # a GPU profile extends base/gpu
    prof.pop("levels", None)                      # the cuts below hold at every level
    prof["suites"]["triton"].update(dtypes=prof["suites"]["triton"]["dtypes"][:1], heads_per_group=[2],
                                    head_dims=[prof["suites"]["triton"]["head_dims"][0]],
                                    seq_lens=prof["suites"]["triton"]["seq_lens"][:1],
                                    long_seq_lens=[], prefill_paper_len=None, bench_seq_lens=[])
    # decode: one small bench row (the profile's speed expectations are for its full sizes)
    prof["suites"]["decode"].update(contexts=prof["suites"]["decode"]["contexts"][:1], batches=[1])
    prof["expect"].update(decode_roofline_min=None, decode_speedup_min=None)
    # reads by effect: the counters on the tiny layer only, none in decode (the suites run in full
    # under pytest too)
    prof["suites"]["counters"]["effect_layers"] = ["tiny"]
    # the Table 4 row the report test reads: its smallest context (every one runs in suites/test_counters.py;
    # on a CPU 65536 tokens of the paper layer took ~10 s of each oneshot run)
    prof["suites"]["counters"]["paper_contexts"] = [8192]
    prof["suites"]["decode"]["effect_contexts"] = []
    # layer: one small shape (suites/test_layer.py runs the profile's under pytest)
    prof["suites"]["layer"].update(shapes=prof["suites"]["layer"]["shapes"][:1], stages=False)
    prof["expect"].update(layer_fwd_speedup_min=None, layer_fwdbwd_speedup_min=None)
    path = tmp_path / f"{name}-small.yaml"
    path.write_text(yaml.safe_dump(prof))
    return path


def _triton_expected() -> str:
    """pass where the kernels can run here; skip (with the reason) where they cannot, e.g. an
    interpreter older than the kernels need."""
    import torch

    from kernels import routes
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return "pass" if routes.triton_unavailable(device=dev, dtype=torch.float32) is None else "skip"


def _fa2_expected() -> str:
    """pass where some FA-2 backend runs here (the others' cases skip); skip where none can."""
    import torch

    from kernels import fa2
    return "pass" if any(fa2.unavailable(b, dtype=torch.bfloat16) is None for b in fa2.BACKENDS) else "skip"


def out_level(r) -> str:
    return json.loads(r.stdout)["level"]


# the cases the oneshot test selects in every suite: what its assertions read (the sanity and triton parity
# cases, Table 4, the layer and decode benches); every case runs in full where pytest runs suites/
ONESHOT_CASES = "forward or prefill_matches_oracle or paper_table4 or bench"


def test_two_oneshot_runs_pass_and_write_two_folders(tmp_path):
    prof = _small_profile(tmp_path)
    for i in range(2):
        # the second run gates on the first inline (CPU timings are noise: a wide gate here)
        gate = ["--baseline", str(run_dirs(tmp_path / "runs")[0]), "--max-regression", "1000"] if i else []
        r = cli("oneshot", "--out", str(tmp_path / "runs"), "--profile", str(prof), "--level", "quick", "--json",
                "-k", ONESHOT_CASES, *gate)
        assert r.returncode == 0, r.stderr[-3000:]
        assert out_level(r) == "quick" and "· level quick ·" in r.stderr
        out = json.loads(r.stdout)
        for name in ("sanity", "counters", "layer"):
            assert out["suites"][name]["status"] == "pass", name
        assert out["suites"]["triton"]["status"] == _triton_expected(), out["suites"]["triton"]
        assert out["suites"]["fa2"]["status"] == _fa2_expected(), out["suites"]["fa2"]
        assert out["suites"]["decode"]["status"] == _triton_expected(), out["suites"]["decode"]
        if _fa2_expected() == "pass":
            assert "VERDICT: PASS:" in r.stderr
        else:       # a CPU machine: fa2 executed no check, and the verdict says so instead of PASS
            assert "VERDICT: PARTIAL:" in r.stderr and "fa2 not exercised" in r.stderr
            assert out["verdict"]["status"] == "partial"
    dirs = run_dirs(tmp_path / "runs")
    assert len(dirs) == 2
    for d in dirs:
        for f in RUN_FILES:
            assert (d / f).is_file(), f
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["status"] == "complete"
        # the command's own start (Python, the CLI's imports) is a phase of its own, before the run's
        assert 0 < manifest["phases_s"]["start"] < 60, manifest["phases_s"]
        assert 0 < manifest["phases_s"]["profile"] <= manifest["phases_s"]["env"], manifest["phases_s"]
        # PyTorch's own report, left to finish beside the suites, is in the folder's env.json and results.json
        ce = json.loads((d / "env.json").read_text())["facts"]["collect_env"]
        assert "error" not in ce and ce["seconds"] >= 0, ce
        assert json.loads((d / "results.json").read_text())["env"]["facts"]["collect_env"] == ce
        # each suite's slowest process's start-up (its start to its cases' collection), on Linux
        starts = {n: s["startup_s"] for n, s in json.loads((d / "results.json").read_text())["suites"].items()}
        assert all(v is not None and 0 < v < 120 for v in starts.values()) or not sys.platform.startswith("linux"), starts
    assert "## Differences vs baseline" in (dirs[1] / "report.md").read_text()
    assert json.loads((dirs[1] / "results.json").read_text())["comparison"]["status"] == "pass"
    import pandas as pd
    df = pd.read_csv(dirs[0] / "metrics.csv")
    assert set(df.suite) >= {"sanity", "counters", "layer"} and (df.level == "quick").all()
    layer = df[(df.suite == "layer") & df.case.str.startswith("bench")]
    assert layer.params.map(lambda p: set(json.loads(p))).map(lambda k: "shape" in k).all(), layer.params.head()
    md = (dirs[0] / "report.md").read_text()
    assert "paper Table 4" in md and "| 8192 |" in md
    assert md.index("## Whole layer") < md.index("## Parity against the fp32 oracle")    # near the top
    assert ("decode step: ms" in md) == (_triton_expected() == "pass")


def test_a_suite_that_ran_no_check_is_not_a_pass(tmp_path):
    """`suite fa2` where no FA-2 backend runs: not PASS; exit 0 (and 1 under --strict: the --strict run of
    ``test_fa2_skips_name_what_is_missing_and_strict_fails``)."""
    if _fa2_expected() == "pass":
        pytest.skip("an FA-2 backend runs here: the fa2 suite is exercised")
    r = cli("suite", "fa2", "--out", str(tmp_path), "--json")
    assert r.returncode == 0 and "VERDICT: PARTIAL: fa2 not exercised" in r.stderr, r.stderr[-2000:]
    assert "PASS" not in r.stderr and json.loads(r.stdout)["verdict"]["status"] == "partial"


def test_shadowed_kernels_is_broken_env_and_oneshot_stops_with_3(tmp_path):
    """A foreign `kernels` package first on sys.path (as the PyPI 'kernels' distribution would be)."""
    fake = tmp_path / "site"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "__init__.py").write_text("# not this repo's kernels\n")
    env = dict(os.environ, NO_COLOR="1", PYTHONPATH=f"{fake}{os.pathsep}{REPO}")
    run = lambda *a: subprocess.run([sys.executable, "-m", "nsa_validate", *one_process(a)], cwd=fake, env=env,
                                    capture_output=True, text=True, timeout=300)
    r = run("env", "--json")
    assert r.returncode == 3
    (f,) = [x for x in json.loads(r.stdout)["findings"] if x["check"] == "import kernels"]
    assert f["status"] == "broken" and str(fake / "kernels") in f["detail"]
    out = tmp_path / "runs"
    r = run("oneshot", "--out", str(out), "--json")
    assert r.returncode == 3 and "environment broken" in r.stderr and "Traceback" not in r.stderr
    (d,) = run_dirs(out)
    assert json.loads((d / "manifest.json").read_text())["status"] == "env-broken"
    assert (d / "report.md").read_text().startswith("# nsa-validate: FAIL")


def test_fa2_skips_name_what_is_missing_and_strict_fails(tmp_path):
    """Where an FA-2 backend cannot run, its cases skip with the reason, and --strict exits 1; where
    none runs, --strict names the suite as not exercised."""
    import torch

    from kernels import fa2
    r = cli("suite", "fa2", "--strict", "--out", str(tmp_path), "--json")
    missing = {b: fa2.unavailable(b, dtype=torch.bfloat16) for b in fa2.BACKENDS}
    res = json.loads((Path(json.loads(r.stdout)["run_dir"]) / "results.json").read_text())
    skipped = [c for c in res["suites"]["fa2"]["cases"] if c["status"] == "skip"]
    if any(missing.values()):
        assert r.returncode == 1, r.stderr[-2000:]
        if _fa2_expected() != "pass":
            assert "fa2: not exercised in --strict" in r.stderr, r.stderr[-2000:]
        for b, why in missing.items():
            if why:
                assert any(c["reason"].startswith(f"{b}: {why}") for c in skipped), (b, why)
    else:
        assert r.returncode == 0 and not skipped, r.stderr[-2000:]


def test_terminal_progress_shows_the_running_case_and_an_eta(tmp_path):
    """On a terminal each suite's bar names the case running now and the time left by the profile's
    ``suites.expected_s``; a suite the profile has no figure for shows no ETA."""
    prof = _small_profile(tmp_path)
    p = yaml.safe_load(prof.read_text())
    p["suites"]["expected_s"] = {"sanity": 600}
    # cases long enough (the fp32 oracle over 4000 tokens: ~1 s each) for the bar to show one running;
    # at the default size every case takes milliseconds and whether a redraw catches one is luck. Two
    # such cases (the bar redraws ten times a second); the others run in suites/test_sanity.py
    p["suites"]["sanity"].update(seq_len=4000, decode_from=3990)
    prof.write_text(yaml.safe_dump(p))
    env = dict(os.environ, TTY_COMPATIBLE="1", NO_COLOR="1", COLUMNS="200")
    r = subprocess.run([sys.executable, "-m", "nsa_validate",
                        *one_process(["suite", "sanity", "--profile", str(prof), "--out", str(tmp_path / "runs"),
                                      "-k", "prefill_matches_oracle or selection_agrees"])],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"~5\d\d s left", r.stderr), r.stderr[-2000:]
    assert re.search(r"~\d+ s left +(prefill_matches_oracle|branch_isolated|decode_matches_oracle_rows|selection_agrees)", r.stderr)


def test_eta_text():
    from nsa_validate.console import eta as _eta
    assert _eta(None, 5.0) == "" and _eta(60, 20.4) == "~40 s left"
    assert _eta(60, 75) == "15 s past the profile's ~60 s"
    assert _eta(60, 10, processes=2) == "~20 s left"      # two processes share the cases
