"""`merge` at fleet scale: hundreds of run folders, some failed, running, half-written or missing,
merged into one report in seconds and bounded memory; nodes grouped by GPU model and verdict; a slow
node named as an outlier on its model's decode step time.

The folders are generated from one results.json built as the suites write it (``test_compare``'s
shape: a decode suite whose bench cases carry ``timing.Timing.summary()`` metrics and whose summary
declares the key figures), padded with bench cases to ~100 KB (a CPU quick run of two suites writes
~60 KB), then copied with varied node names, GPU models and figures."""
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli import REPO, cli
from test_compare import _timing

from nsa_validate.errors import UsageError
from nsa_validate.report import fleet
from nsa_validate.report.schema import SCHEMA_VERSION, CaseRecord, SuiteResult, verdict
from nsa_validate.run import fleet_scan, rundir

MODELS = {"NVIDIA H100 80GB HBM3": 0.142, "NVIDIA H200": 0.120, "NVIDIA B200": 0.080}   # decode step ms
N = 500
SLOW, SLOW_MS = "node-45", 0.180            # an H200 node 1.5x its model's median
FAILED = ["node-30", "node-31", "node-32"]
RUNNING = {"node-20": "gone", "node-21": "elsewhere"}
HALF = {"node-10": "truncated results.json", "node-11": "manifest.json unreadable",
        "node-12": "error: disk full", "node-13": "no manifest yet"}
TWICE = "node-7"                            # two runs of one node
ABSENT = ["node-499", "node-500"]           # expected, never ran


def model_of(i: int) -> str:
    return list(MODELS)[0 if i % 10 < 5 else 1 if i % 10 < 9 else 2]


def template(padding: int = 60) -> dict:
    """A passing run's results: sanity and decode suites, the decode bench figures, and ``padding``
    more bench cases (two 50-sample timings each): ~100 KB as JSON."""
    bench = [CaseRecord(f"bench[B{b}-S{1 << s}]", "decode", "pass",
                        metrics={"graph": _timing(0.1, 0.01, b * s), "eager": _timing(0.2, 0.01, b * s + 1),
                                 "row": {"step_ms": 0.1, "B": b, "S": 1 << s}})
             for b, s in [(1 << (k % 5), 10 + k // 5) for k in range(padding)]]
    suites = {"sanity": SuiteResult("sanity", "pass", 1.0, [CaseRecord("finite", "sanity", "pass")]),
              "decode": SuiteResult("decode", "pass", 10.0, [CaseRecord("parity[S65536]", "decode", "pass"), *bench])}
    return {"schema_version": SCHEMA_VERSION,
            "manifest": {"started": "2026-11-21T00:00:00+00:00", "status": "complete", "commit": "abc1234",
                         "dirty": False, "command": ["nsa-validate", "oneshot"], "profile": "sm90",
                         "level": "standard"},
            "env": {"verdict": "ok", "facts": {"gpu": {}, "torch": "2.11.0", "triton": "3.6.0"}},
            "suites": {n: s.to_dict() for n, s in suites.items()}, "verdict": verdict(suites, strict=False)}


def node_results(tpl: dict, node: str, gpu: str, step_ms: float, state: str = "pass") -> dict:
    """``tpl`` as run on ``node``: its GPU, its decode figures, and a failed parity case for state "fail"
    (shallow copies: the padded cases are shared, only written)."""
    res = {**tpl, "manifest": {**tpl["manifest"], "node": node, "host": f"host-of-{node}"},
           "env": {**tpl["env"], "facts": {**tpl["env"]["facts"], "gpu": {"name": gpu, "sm": "sm90"}}}}
    dec = res["suites"]["decode"]
    speed = MODELS[gpu] / step_ms
    res["suites"] = {**res["suites"], "decode": {**dec, "extra": {"summary": {
        "decode step (B, S)": f"{step_ms:.4f} ms (16, 65536), cache of 2048 rows; full cache {step_ms * 3:.4f} ms",
        "decode % copy bw": f"{54.1 * speed:.1f}", "decode x dense": f"{7.75 * speed:.2f}"}}}}
    if state == "fail":
        cases = [{**dec["cases"][0], "status": "fail", "reason": "o_sel: max-abs 3.1e-2 > bound"}, *dec["cases"][1:]]
        res["suites"]["decode"].update(status="fail", cases=cases)
        v = tpl["verdict"]
        res["verdict"] = {**v, "status": "fail", "blocking": ["decode/parity[S65536]: fail"],
                          "totals": {**v["totals"], "pass": v["totals"]["pass"] - 1, "fail": 1},
                          "headline": "FAIL: sanity passed; decode failed"}
    elif state == "partial":
        res["verdict"] = {**tpl["verdict"], "status": "partial",
                          "not_exercised": {"fa2": "flash_attn: flash-attn is not installed"}}
    return res


def write_run(root: Path, i: int, node: str, res: dict | None) -> Path:
    """A run folder ``<root>/abc1234/<stamp>-<node>`` with its manifest (and ``res`` as results.json)."""
    d = root / "abc1234" / f"20261121T{i // 3600:02d}{i // 60 % 60:02d}{i % 60:02d}Z-{node}"
    (d / "logs").mkdir(parents=True)
    if res is not None:
        (d / "results.json").write_text(json.dumps(res))
        (d / "manifest.json").write_text(json.dumps(res["manifest"]))
    return d


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def plant_unfinished(root: Path, tpl: dict) -> None:
    """The running and half-written folders of ``RUNNING`` and ``HALF``."""
    man = {**tpl["manifest"], "status": "running", "ended": None}
    d = write_run(root, 20, "node-20", None)
    (d / "manifest.json").write_text(json.dumps({**man, "node": "node-20", "pid": _dead_pid(),
                                                 "host": socket.gethostname()}))
    (d / "env.json").write_text(json.dumps({"facts": {"gpu": {"name": "NVIDIA H200", "sm": "sm90"}}}))
    d = write_run(root, 21, "node-21", None)
    (d / "manifest.json").write_text(json.dumps({**man, "node": "node-21", "pid": 4242, "host": "elsewhere"}))
    d = write_run(root, 10, "node-10", None)
    (d / "manifest.json").write_text(json.dumps({**tpl["manifest"], "node": "node-10"}))
    (d / "results.json").write_text(json.dumps(node_results(tpl, "node-10", "NVIDIA H200", 0.12))[:5000])
    d = write_run(root, 11, "node-11", None)
    (d / "manifest.json").write_text('{"node": "node-11", "stat')
    d = write_run(root, 12, "node-12", None)
    (d / "manifest.json").write_text(json.dumps({**man, "node": "node-12", "status": "error: disk full"}))
    write_run(root, 13, "node-13", None)                      # created, died before its manifest


def make_fleet(root: Path, n: int = N, bad: bool = True) -> list[str]:
    """``n`` run folders under ``root`` (nodes node-0 … node-(n-2), node-7 twice); with ``bad`` the
    failed, running, half-written and slow nodes above. Returns the nodes' names."""
    tpl, rng = template(), random.Random(0)
    names = [f"node-{i}" for i in range(n - 1)]
    for i, node in enumerate(names):
        if bad and (node in RUNNING or node in HALF):
            continue
        gpu = model_of(i)
        step = SLOW_MS if bad and node == SLOW else MODELS[gpu] * (1 + rng.uniform(-0.004, 0.004))
        write_run(root, i, node, node_results(tpl, node, gpu, step, "fail" if bad and node in FAILED else "pass"))
    write_run(root, n, TWICE, node_results(tpl, TWICE, model_of(7), MODELS[model_of(7)]))
    if bad:
        plant_unfinished(root, tpl)
    return names


@pytest.fixture(scope="module")
def big_fleet(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("fleet") / "runs"
    return root, make_fleet(root)


def _merge(*args, out: Path):
    """``merge ARGS --out OUT --json`` as users run it: the result, its wall time, fleet.json's content."""
    t0 = time.perf_counter()
    r = cli("merge", *map(str, args), "--out", str(out), "--json")
    wall = time.perf_counter() - t0
    assert "Traceback" not in r.stderr, r.stderr
    return r, wall, json.loads(Path(json.loads(r.stdout)["json"]).read_text())


def test_500_run_folders_merge_in_under_10_s_naming_every_node_that_did_not_pass(big_fleet, tmp_path):
    root, names = big_fleet
    expect = names + ABSENT
    # the names in two forms: comma-separated chunks, and the option repeated
    args = [a for k in range(0, len(expect), 100) for a in ("--expect", ",".join(expect[k:k + 100]))]
    r, wall, data = _merge(root, *args, out=tmp_path)
    assert r.returncode == 1, r.stderr[-2000:]
    assert wall < 10, f"merge of {N} run folders took {wall:.1f} s"
    line = f"fleet FAIL: 3 failed, 2 running, 4 half-written, 2 missing of {N} runs"
    assert data["line"] == line and line in r.stderr
    assert data["counts"] == {"runs": N, "pass": N - 9, "partial": 0, "fail": 3, "running": 2, "half-written": 4,
                              "missing": 2}
    why = {b["node"]: (b["state"], b["why"]) for b in data["not_passing"]}
    assert {n for n, (s, _) in why.items() if s == "missing"} == set(ABSENT)
    assert {n for n, (s, _) in why.items() if s == "fail"} == set(FAILED)
    assert all(why[n][1] == "decode/parity[S65536]: fail" for n in FAILED)
    assert why["node-20"][0] == "running" and "is gone" in why["node-20"][1] and "repair" in why["node-20"][1]
    assert why["node-21"][0] == "running" and "cannot be told" in why["node-21"][1]
    assert {n: s for n, (s, _) in why.items() if n in HALF} == dict.fromkeys(HALF, "half-written")
    assert "not JSON" in why["node-10"][1] and "manifest.json unreadable" in why["node-11"][1]
    assert "'error: disk full'" in why["node-12"][1] and "no manifest.json" in why["node-13"][1]
    assert sum(r["node"] == TWICE for r in data["runs"]) == 2
    # grouped by GPU model and verdict; fleet.json keeps every name
    groups = {(g["GPU"], g["state"]): g for g in data["groups"]}
    assert groups[("NVIDIA H200", "running")]["names"] == ["node-20"]            # GPU read from env.json
    assert groups[("NVIDIA H100 80GB HBM3", "fail")]["names"] == FAILED
    assert all(len(g["names"]) == g["nodes"] for g in data["groups"])
    assert sum(g["runs"] for g in data["groups"]) == N and sum(g["nodes"] for g in data["groups"]) == N - 1 + 2
    assert groups[(model_of(7), "pass")]["runs_of"] == {TWICE: 2}
    # the slow node, and only it, is an outlier on the decode step; slower, on its own model
    step = {s["GPU"]: s for s in data["figures"] if s["figure"] == "decode step (B, S)"}
    assert [(o["node"], o["direction"]) for o in step["NVIDIA H200"]["outliers"]] == [(SLOW, "slower")]
    assert step["NVIDIA H100 80GB HBM3"]["outliers"] == [] and step["NVIDIA B200"]["outliers"] == []
    bw = {s["GPU"]: s for s in data["figures"] if s["figure"] == "decode % copy bw"}
    assert [(o["node"], o["direction"]) for o in bw["NVIDIA H200"]["outliers"]] == [(SLOW, "lower")]
    md = Path(json.loads(r.stdout)["report"]).read_text()
    assert md.startswith("# nsa-validate fleet report: FAIL") and line in md
    assert "## Nodes by GPU model and verdict" in md and "fleet.json lists all" in md
    assert f"{SLOW} 0.18 (slower" in md and f"{TWICE} (×2)" in md
    assert all(n in md for n in [*ABSENT, *HALF, *RUNNING, *FAILED])


# the merge's peak resident memory: VmHWM is the process's own (getrusage's maxrss would include the
# memory of the pytest process it was forked from)
PEAK_RSS = """import sys
sys.argv = ["nsa-validate", "merge", *sys.argv[1:]]
from nsa_validate.cli import main
try:
    main()
except SystemExit:
    pass
hwm = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
print(int(hwm.split()[1]), file=sys.stderr)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak from Linux's /proc")
def test_merge_of_500_folders_keeps_memory_bounded(big_fleet, tmp_path):
    """Each results.json is reduced to its row before the next is read: 400 more folders add a few MB to
    the process's peak (measured: +5 MB), where keeping every parsed file (~0.3 MB each here) adds ~160 MB."""
    root, _ = big_fleet
    folders = sorted(p for p in (root / "abc1234").iterdir())
    peak = {}
    for n in (100, N):
        r = subprocess.run([sys.executable, "-c", PEAK_RSS, *map(str, folders[:n]), "--out", str(tmp_path)],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
        peak[n] = int(r.stderr.strip().splitlines()[-1]) * 1024
    grew = (peak[N] - peak[100]) / 2**20
    assert grew < 25, f"merging {N} folders instead of 100 raised the peak by {grew:.0f} MiB"


def test_a_clean_fleet_exits_0_and_a_partial_run_passes_as_it_does_alone(tmp_path):
    names = make_fleet(tmp_path / "runs", n=12, bad=False)
    r, _, data = _merge(tmp_path / "runs", "--expect", ",".join(names), "--expect-count", "12", out=tmp_path / "a")
    assert r.returncode == 0, r.stderr[-2000:]
    assert data["verdict"] == "pass" and data["line"] == "fleet PASS: 12 passed of 12 runs"
    assert data["not_passing"] == [] and data["counts"]["missing"] == 0
    write_run(tmp_path / "runs", 99, "node-99", node_results(template(0), "node-99", "NVIDIA H200", 0.12, "partial"))
    r, _, data = _merge(tmp_path / "runs", out=tmp_path / "b")
    assert r.returncode == 0 and data["verdict"] == "partial", r.stderr[-2000:]
    assert data["not_passing"][0]["why"] == "fa2 not exercised (flash_attn: flash-attn is not installed)"


def test_expect_count_names_the_shortfall_when_nodes_are_not_known(tmp_path):
    make_fleet(tmp_path / "runs", n=5, bad=False)
    r, _, data = _merge(tmp_path / "runs", "--expect-count", "8", out=tmp_path)
    assert r.returncode == 1
    assert data["line"] == "fleet FAIL: 3 missing of 5 runs (3 of 8 expected runs missing, nodes not known)"
    assert "3 of 8 expected runs missing (nodes not known)" in Path(json.loads(r.stdout)["report"]).read_text()


def test_a_path_that_does_not_exist_is_exit_2_unless_nodes_are_expected(tmp_path):
    make_fleet(tmp_path / "runs", n=3, bad=False)
    r = cli("merge", str(tmp_path / "runs"), str(tmp_path / "nope"), "--out", str(tmp_path))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r, _, data = _merge(tmp_path / "nope", "--expect", "a,b", "--expect", "b", out=tmp_path)
    assert r.returncode == 1 and data["expected"]["missing_nodes"] == ["a", "b"] and data["counts"]["runs"] == 0
    assert any("does not exist" in n for n in data["notes"])


@pytest.mark.parametrize("args,needle", [(["EMPTY"], "no run folder"), (["EMPTY", "--expect", " , "], "names no node"),
                                         (["EMPTY", "--expect-count", "0"], "--expect-count"),
                                         (["FILE"], "is a file")], ids=["nothing-found", "blank-expect",
                                                                        "zero-count", "a-plain-file"])
def test_merge_usage_errors_are_one_line_exit_2(tmp_path, args, needle):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "f.txt").write_text("x")
    args = [{"EMPTY": str(tmp_path / "empty"), "FILE": str(tmp_path / "f.txt")}.get(a, a) for a in args]
    r = cli("merge", *args, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr, r.stderr


def test_the_walk_counts_each_run_once_and_never_enters_one(tmp_path):
    """A run folder's own subfolders, hidden folders (a file server's .snapshot) and a link back up the
    tree add no run; a run's results.json named as PATH stands for its folder."""
    root = tmp_path / "runs"
    make_fleet(root, n=3, bad=False)
    run = sorted((root / "abc1234").iterdir())[0]
    (run / "suites" / "nested").mkdir(parents=True)
    (run / "suites" / "nested" / "results.json").write_text("{}")
    (root / ".snapshot").mkdir()
    os.symlink(root / "abc1234", root / ".snapshot" / "copy")
    os.symlink(root, root / "abc1234" / "loop")
    folders, notes = fleet_scan.find([root, run / "results.json", run], tolerate_missing=False)
    assert len(folders) == 3 and notes == []


@pytest.mark.parametrize("pid,host,says", [("dead", "here", "is gone; `nsa-validate repair"),
                                           ("mine", "here", "may still be running"),
                                           (4242, "elsewhere", "cannot be told from this machine")],
                         ids=["process-gone", "process-alive", "another-host"])
def test_a_running_folder_says_whether_its_process_is_gone(tmp_path, pid, host, says):
    d = write_run(tmp_path, 1, "n1", None)
    (d / "manifest.json").write_text(json.dumps({
        "status": "running", "node": "n1", "pid": {"dead": _dead_pid(), "mine": os.getpid()}.get(pid, pid),
        "host": socket.gethostname() if host == "here" else host}))
    r = fleet_scan.read(d)
    assert r["state"] == "running" and r["node"] == "n1" and says in r["reason"], r["reason"]


def test_a_folder_that_cannot_be_listed_is_noted_not_fatal(tmp_path, monkeypatch):
    """(As root every folder can be read: the refusal is simulated.)"""
    make_fleet(tmp_path / "runs" / "a", n=3, bad=False)
    make_fleet(tmp_path / "runs" / "b", n=2, bad=False)
    real = os.scandir

    def scandir(path):
        if Path(path).name == "b":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(fleet_scan.os, "scandir", scandir)
    folders, notes = fleet_scan.find([tmp_path / "runs"], tolerate_missing=False)
    assert len(folders) == 3
    assert notes == [f"cannot read folder '{tmp_path / 'runs' / 'b'}' (Permission denied): runs in it are not counted"]


@pytest.mark.parametrize("values,n_out,direction", [
    ([1.0, 1.0, 1.0, 1.0, 1.2], ["e"], "slower"),             # MAD 0: a 20% difference
    ([1.0, 1.0, 1.0, 1.0, 1.005], [], None),                  # MAD 0: within the 1% floor
    ([1.0, 1.01, 0.99, 1.02, 0.98, 0.5], ["f"], "faster"),
    ([1.0, 3.0], [], None),                                   # fewer than 3 runs: not tested
], ids=["mad-0-beyond-floor", "mad-0-within-floor", "spread-faster", "two-runs-untested"])
def test_outlier_rule(values, n_out, direction):
    rows = [{"node": n, "run": n, "GPU": "g", "figures": {"step ms": f"{x} ms"}} for n, x in zip("abcdef", values)]
    (stat,) = fleet.figure_stats(rows)
    assert [o["node"] for o in stat["outliers"]] == n_out
    assert all(o["direction"] == direction for o in stat["outliers"])
    assert stat["outlier_test"] == (len(values) >= fleet.MIN_VALUES)


def test_figure_values_are_read_from_the_text_they_start_with():
    assert fleet.number("0.1420 ms (16, 65536), cache of 2048 rows") == pytest.approx(0.142)
    assert fleet.number("54.1") == pytest.approx(54.1) and fleet.number(7) == 7.0
    assert fleet.number("fa2_min_len=4096") is None and fleet.number("") is None and fleet.number("nan") is None


def test_node_names_the_run_folder_and_falls_back_to_the_host(tmp_path):
    d = rundir.create(tmp_path, {"short": "abc1234", "dirty": False}, "gpu/7 rack:b")
    assert d.parent.name == "abc1234" and d.name.endswith("-gpu_7_rack_b") and (d / "logs").is_dir()
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
    assert rundir.create(tmp_path, {"short": "abc1234", "dirty": False}).name.split("-", 1)[1] in (host, f"{host}-2")
    with pytest.raises(UsageError, match="--node is empty"):
        rundir.node_name("  ")
    assert fleet.node_of({"node": "n1", "host": "h"}, d) == "n1" and fleet.node_of({"host": "h"}, d) == "h"
    assert fleet.node_of(None, d) == "gpu_7_rack_b"


def test_a_real_run_with_node_is_merged_under_that_name(tmp_path):
    r = cli("suite", "sanity", "--profile", "cpu", "--level", "quick", "-k", "short_sequences", "--node", "n-1",
            "--out", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stderr[-2000:]
    (run,) = (tmp_path / "runs").glob("*/*-n-1")
    assert json.loads((run / "manifest.json").read_text())["node"] == "n-1"
    r, _, data = _merge(tmp_path / "runs", "--expect", "n-1", out=tmp_path / "o")
    assert r.returncode == 0 and [x["node"] for x in data["runs"]] == ["n-1"], r.stderr[-2000:]
