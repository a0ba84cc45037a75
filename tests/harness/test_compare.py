"""The CI gate: `compare`, `baseline save`, `--strict` with an allow-list, `merge`, `--gpus` sharding.

Run folders here are synthetic results.json files with the shape the suites write (a decode bench
case carrying ``timing.Timing.summary()`` metrics), so each rule is tested on exact numbers."""
import json
import random
from pathlib import Path

import pytest
import yaml

from nsa_validate.measure import timing
from nsa_validate.report.schema import SCHEMA_VERSION, CaseRecord, SuiteResult, verdict, write_json
from tests.harness.test_cli import cli

H100 = {"name": "NVIDIA H100 80GB HBM3", "sm": "sm90"}
H200 = {"name": "NVIDIA H200", "sm": "sm90"}


def _timing(median_ms: float, spread: float, seed: int) -> dict:
    """A Timing summary of 50 samples around median_ms, ±spread (relative)."""
    rng = random.Random(seed)
    samples = [median_ms * (1 + rng.uniform(-spread, spread)) for _ in range(50)]
    return timing.Timing("cuda_graph", samples, 3, True).summary()


def make_run(root: Path, name: str, step_ms: float = 0.142, spread: float = 0.01, gpu=H100, seed: int = 0,
             parity: str = "pass", profile: str = "sm90", layer_fwd_ms: float | None = None,
             level: str | None = "standard") -> Path:
    d = root / name
    d.mkdir(parents=True)
    suites = {
        "decode": SuiteResult("decode", "pass", 10.0, [
            CaseRecord("parity[S65536]", "decode", parity, "" if parity == "pass" else "o_sel: max-abs 3.1e-2 > bound"),
            CaseRecord("bench[B16-S65536]", "decode", "pass",
                       metrics={"graph": _timing(step_ms, spread, seed), "eager": _timing(0.22, spread, seed + 1),
                                "row": {"step_ms": step_ms}}),
            ],
            # what the suite's summary (decode_table.summarise) declares
            extra={"summary": {"decode step (B, S)": f"{step_ms:.4f} ms (16, 65536)", "decode % copy bw": "54.1",
                               "decode x dense": "7.75"}}),
        "fa2": SuiteResult("fa2", "skip", 0.1, [CaseRecord("window_branch[flash_attn-bf16]", "fa2", "skip",
                                                           "flash_attn: flash-attn is not installed")]),
    }
    if layer_fwd_ms is not None:       # the layer suite's bench case, as suites/test_layer.py records it
        suites["layer"] = SuiteResult("layer", "pass", 60.0, [
            CaseRecord("bench[B1-S65536-dk128-dv128]", "layer", "pass",
                       metrics={"nsa_fwd": _timing(layer_fwd_ms, spread, seed + 2),
                                "nsa_fwdbwd": _timing(956.0, spread, seed + 3),
                                "dense_flash_attn_fwd": _timing(184.0, spread, seed + 4)})])
    res = {"schema_version": SCHEMA_VERSION,
           "manifest": {"started": "2026-11-21T00:00:00+00:00", "status": "complete", "commit": "abc1234",
                        "dirty": False, "command": ["nsa-validate", "oneshot"], "profile": profile,
                        **({"level": level} if level else {})},
           "env": {"verdict": "ok", "facts": {"gpu": gpu, "torch": "2.11.0", "triton": "3.6.0"}},
           "suites": {n: s.to_dict() for n, s in suites.items()}, "verdict": verdict(suites, strict=False)}
    write_json(d / "results.json", res)
    return d


def test_identical_runs_pass(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    r = cli("compare", str(b), "--baseline", str(a), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "pass"


def test_20pct_slower_decode_step_is_a_regression(tmp_path):
    a, b = make_run(tmp_path, "a", 0.142), make_run(tmp_path, "b", 0.142 * 1.2, seed=7)
    r = cli("compare", str(b), "--baseline", str(a), "--json")
    assert r.returncode == 1, r.stderr
    regs = json.loads(r.stdout)["regressions"]
    assert len(regs) == 1 and regs[0].startswith("decode/bench[B16-S65536]/graph"), regs
    assert 15 < float(regs[0].rsplit("(+", 1)[1].rstrip("%)")) < 25, regs


def test_20pct_slower_layer_forward_is_a_regression(tmp_path):
    a = make_run(tmp_path, "a", layer_fwd_ms=753.0)
    b = make_run(tmp_path, "b", layer_fwd_ms=753.0 * 1.2, seed=7)
    r = cli("compare", str(b), "--baseline", str(a), "--json")
    assert r.returncode == 1, r.stderr
    regs = json.loads(r.stdout)["regressions"]
    assert len(regs) == 1 and regs[0].startswith("layer/bench[B1-S65536-dk128-dv128]/nsa_fwd"), regs


def test_slowdown_inside_the_recorded_noise_passes(tmp_path):
    """+12% on the median is past the 10% gate, but the samples spread ±25%: the bands overlap."""
    a, b = make_run(tmp_path, "a", 0.142, spread=0.25), make_run(tmp_path, "b", 0.142 * 1.12, spread=0.25, seed=3)
    r = cli("compare", str(b), "--baseline", str(a), "--json")
    assert r.returncode == 0, r.stderr
    rows = {x["metric"]: x for x in json.loads(r.stdout)["rows"]}
    assert rows["decode/bench[B16-S65536]/graph"]["verdict"] == "within noise"


def test_a_check_that_now_fails_is_a_regression(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b", parity="fail")
    r = cli("compare", str(b), "--baseline", str(a), "--json")
    assert r.returncode == 1 and "decode/parity[S65536]: pass -> fail" in json.loads(r.stdout)["regressions"]


def test_baseline_file_roundtrip_and_another_gpu_is_refused(tmp_path):
    a = make_run(tmp_path, "a")
    f = tmp_path / "bl" / "h100.json"
    r = cli("baseline", "save", str(a), "--name", "h100", "--out", str(f), "--json")
    assert r.returncode == 0, r.stderr
    saved = json.loads(f.read_text())
    assert saved["gpu"] == H100["name"] and saved["sm"] == "sm90" and saved["profile"] == "sm90"
    assert cli("compare", str(make_run(tmp_path, "b", seed=1)), "--baseline", str(f)).returncode == 0
    r = cli("baseline", "save", str(a), "--name", "h100", "--out", str(f))      # again: the old one is kept
    assert r.returncode == 0 and len(list(f.parent.glob("h100.json.bak-*"))) == 1
    r = cli("compare", str(make_run(tmp_path, "c", gpu=H200)), "--baseline", str(f))
    assert r.returncode == 2 and "another machine" in r.stderr and "Traceback" not in r.stderr


def test_runs_of_another_level_are_not_compared(tmp_path):
    """quick and standard run different cases: a comparison would call the missing ones regressions."""
    base = make_run(tmp_path, "std", level="standard")
    r = cli("compare", str(make_run(tmp_path, "quick", level="quick")), "--baseline", str(base))
    assert r.returncode == 2 and "level 'standard'" in r.stderr and "--level standard" in r.stderr, r.stderr
    # a run from before levels existed ran the whole sweep: it is a `full` run
    old = make_run(tmp_path, "old", level=None)
    assert cli("compare", str(make_run(tmp_path, "full", level="full")), "--baseline", str(old)).returncode == 0
    assert cli("compare", str(make_run(tmp_path, "std2", level="standard")), "--baseline", str(old)).returncode == 2


@pytest.mark.parametrize("bad", ["missing-dir", "not-a-baseline"])
def test_bad_baseline_is_a_usage_error(tmp_path, bad):
    a = make_run(tmp_path, "a")
    target = tmp_path / bad
    if bad == "not-a-baseline":
        target.write_text("{}")
    r = cli("compare", str(a), "--baseline", str(target))
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr


def test_strict_allow_list():
    s = {"fa2": SuiteResult("fa2", "skip", 0, [CaseRecord("window_branch[flash_attn-bf16]", "fa2", "skip", "no FA")]),
         "decode": SuiteResult("decode", "skip", 0, [CaseRecord("bench[B16-S131072]", "decode", "skip", "OOM guard")])}
    v = verdict(s, strict=True, allowed_skips={"fa2/window_branch[flash_attn-*]": "no flash-attn wheel for this CUDA"})
    assert v["status"] == "fail" and v["blocking"] == [       # whole suites first, then cases
        "fa2: not exercised in --strict (no FA)", "decode: not exercised in --strict (OOM guard)",
        "decode/bench[B16-S131072]: skipped in --strict (OOM guard)"]
    assert v["allowed_skips"][0]["allowed_because"] == "no flash-attn wheel for this CUDA"
    v = verdict(s, strict=True, allowed_skips={"fa2": "x", "decode/bench[*]": "y"})
    assert v["status"] == "fail" and v["blocking"] == ["decode: not exercised in --strict (OOM guard)"]
    v = verdict(s, strict=True, allowed_skips={"fa2": "x", "decode": "y"})
    assert v["status"] == "partial" and not v["blocking"]


def test_allow_list_file_needs_a_reason_per_entry(tmp_path):
    f = tmp_path / "allow.yaml"
    f.write_text(yaml.safe_dump({"fa2": ""}))
    r = cli("suite", "sanity", "--strict", "--allow-skips", str(f), "--out", str(tmp_path))
    assert r.returncode == 2 and "has no reason" in r.stderr
    f.write_text(yaml.safe_dump({"nosuch/x": "because"}))
    r = cli("suite", "sanity", "--strict", "--allow-skips", str(f), "--out", str(tmp_path))
    assert r.returncode == 2 and "names no suite" in r.stderr


def test_merge_two_gpus_renders_one_report(tmp_path):
    a, b = make_run(tmp_path, "a", gpu=H100), make_run(tmp_path, "b", gpu=H200, step_ms=0.12)
    r = cli("merge", str(a), str(b), "--out", str(tmp_path / "out"), "--json")
    assert r.returncode == 0, r.stderr
    md = Path(json.loads(r.stdout)["report"]).read_text()
    assert md.count("NVIDIA H100 80GB HBM3") >= 2 and md.count("NVIDIA H200") >= 2
    assert md.count("# nsa-validate fleet report") == 1 and "decode x dense" in md and "0.1200 ms (16, 65536)" in md
    r = cli("merge", str(a), str(tmp_path / "nope"))
    assert r.returncode == 2 and "no results.json" in r.stderr


def test_gpus_flag_is_checked():
    r = cli("oneshot", "--gpus", "two")
    assert r.returncode == 2 and "--gpus takes a number" in r.stderr
    r = cli("oneshot", "--gpus", "64")
    assert r.returncode == 2 and "visible CUDA GPU" in r.stderr


def test_shards_balance_by_the_profile_timeouts():
    from nsa_validate.run.execute import shard as _shard
    from nsa_validate.config.profiles import load
    prof = load("sm90")
    names = ["sanity", "triton", "fa2", "decode", "layer", "counters"]
    shards = _shard(names, prof, 2)
    assert sorted(n for q in shards for n in q) == sorted(names) and all(shards)
    assert _shard(names, prof, 1) == [names]


def _drop(run: Path, suite: str, case: str | None = None, to: str | None = None, timer: str | None = None):
    """Edit a synthetic run: drop a case (or set its status), or relabel every timing's timer."""
    res = json.loads((run / "results.json").read_text())
    cases = res["suites"][suite]["cases"]
    if case and to is None:
        res["suites"][suite]["cases"] = [c for c in cases if c["id"] != case]
    for c in cases:
        if c["id"] == case and to:
            c["status"], c["metrics"] = to, ({} if to == "skip" else c["metrics"])
        for m in c["metrics"].values():
            if timer and isinstance(m, dict) and "samples_ms" in m:
                m["timer"] = timer
    (run / "results.json").write_text(json.dumps(res))


def test_a_kernel_that_stops_running_is_a_regression(tmp_path):
    """pass -> skip, and the timings it no longer measures, fail the gate."""
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    _drop(b, "decode", "bench[B16-S65536]", to="skip")
    r = cli("compare", str(b), "--baseline", str(a), "--json")
    assert r.returncode == 1, r.stderr
    regs = json.loads(r.stdout)["regressions"]
    assert "decode/bench[B16-S65536]: pass -> skip" in regs
    assert any(x.startswith("decode/bench[B16-S65536]/graph:") and "not measured" in x for x in regs), regs
    assert any(x.startswith("decode/bench[B16-S65536]/eager:") for x in regs), regs


def test_a_case_gone_from_a_suite_that_ran_is_a_regression(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    _drop(b, "decode", "parity[S65536]")
    out = json.loads(cli("compare", str(b), "--baseline", str(a), "--json").stdout)
    assert "decode/parity[S65536]: pass -> missing" in out["regressions"]


def test_a_retired_case_in_an_older_baseline_is_not_a_regression(tmp_path):
    """Baselines saved before the decode suite's table case became its summary still gate the rest."""
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    res = json.loads((a / "results.json").read_text())
    res["suites"]["decode"]["cases"].append({"id": "roofline_table", "suite": "decode", "status": "pass"})
    (a / "results.json").write_text(json.dumps(res))
    r = cli("compare", str(b), "--baseline", str(a), "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["regressions"] == [], out
    row = next(x for x in out["rows"] if x["metric"] == "decode/roofline_table")
    assert row["verdict"] == "retired" and row["run"] == "retired" and "bench case" in row["change"]
    _drop(b, "decode", "parity[S65536]")                  # a case that is not retired still gates
    assert cli("compare", str(b), "--baseline", str(a)).returncode == 1


def test_suites_the_run_did_not_select_are_not_compared(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    res = json.loads((b / "results.json").read_text())
    del res["suites"]["fa2"]
    res["manifest"]["suites"] = ["decode"]                     # `suite decode` against a oneshot baseline
    (b / "results.json").write_text(json.dumps(res))
    r = cli("compare", str(b), "--baseline", str(a), "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["not_compared"] == ["fa2"] and not out["regressions"]
    assert "not compared (not selected in this run): fa2" in r.stderr


def test_cpu_timer_timings_are_never_gated(tmp_path):
    a, b = make_run(tmp_path, "a", 0.1), make_run(tmp_path, "b", 24.0, seed=5)
    for run in (a, b):
        _drop(run, "decode", timer="cpu")
    out = json.loads(cli("compare", str(b), "--baseline", str(a), "--json").stdout)
    assert out["status"] == "pass"
    rows = {r["metric"]: r for r in out["rows"]}
    assert rows["decode/bench[B16-S65536]/graph"]["verdict"] == "not gated (CPU timer)"
    assert rows["decode/bench[B16-S65536]/graph"]["run"].endswith("]") and " ms [p20-p80 " in rows["decode/bench[B16-S65536]/graph"]["run"]


def test_a_different_stack_is_a_warning(tmp_path):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    res = json.loads((b / "results.json").read_text())
    res["env"]["facts"]["triton"] = "3.7.0"
    (b / "results.json").write_text(json.dumps(res))
    out = json.loads(cli("compare", str(b), "--baseline", str(a), "--json").stdout)
    assert out["warnings"] == ["triton differs from the baseline's: 3.6.0 (baseline) vs 3.7.0 (this run)"]


@pytest.mark.parametrize("pct", ["nan", "-5", "0", "inf"])
def test_max_regression_must_be_a_finite_positive_number(tmp_path, pct):
    a = make_run(tmp_path, "a")
    r = cli("compare", str(a), "--baseline", str(a), "--max-regression", pct)
    assert r.returncode == 2 and "--max-regression must be a finite number > 0" in r.stderr, r.stderr
