"""Results schema, verdict, JUnit and report rendering from results.json alone."""
import pytest
import json
import xml.etree.ElementTree as ET

from nsa_validate.report import junit, markdown
from nsa_validate.report.schema import SCHEMA_VERSION, CaseRecord, SuiteResult, load_results, verdict, write_json


def _suites():
    return {"sanity": SuiteResult("sanity", "pass", 1.0, [CaseRecord("a[fp32]", "sanity", "pass",
                                  metrics={"out": {"max_abs": 1e-7, "base_err": 0.0, "ratio": None, "bound": 2e-5,
                                                   "rel_rms": 1e-7, "finite": True, "ok": True}},
                                  backends={"prefill/sel": ["torch"]})]),
            "fa2": SuiteResult("fa2", "skip", 0.1, [CaseRecord("varlen[bf16]", "fa2", "skip", "no CUDA device")])}


def test_a_suite_that_ran_no_check_makes_the_verdict_partial_not_pass():
    s = _suites()
    v = verdict(s, strict=False)
    assert v["status"] == "partial" and v["not_exercised"] == {"fa2": "no CUDA device"}
    assert v["headline"] == "PARTIAL: sanity passed; fa2 not exercised"
    v = verdict(s, strict=True)
    assert v["status"] == "fail" and "no CUDA device" in v["blocking"][0]
    assert "fa2: not exercised in --strict (no CUDA device)" in v["blocking"]
    # an allow-list entry naming the suite itself excuses it; the verdict still says partial
    assert verdict(s, strict=True, allowed_skips={"fa2": "no GPU on CI"})["status"] == "partial"
    del s["fa2"]
    assert verdict(s, strict=True)["status"] == "pass"


def test_placeholder_cases_are_not_counted_and_exercise_nothing():
    s = {"decode": SuiteResult("decode", "skip", 0, [
        CaseRecord("bench[not-in-profile]", "decode", "skip", "profile sets no sizes", placeholder=True)])}
    v = verdict(s, strict=False)
    assert v["totals"] == {"pass": 0, "fail": 0, "skip": 0, "error": 0}
    assert v["status"] == "partial" and "profile sets no sizes" in v["not_exercised"]["decode"]
    s["decode"].cases.append(CaseRecord("parity[S64]", "decode", "pass"))
    v = verdict(s, strict=False)
    assert v["status"] == "pass" and v["totals"]["pass"] == 1 and v["totals"]["skip"] == 0


def test_fail_and_error_block():
    s = _suites()
    s["x"] = SuiteResult("x", "error", 0, [CaseRecord("suite-process", "x", "error", "killed by SIGSEGV")])
    assert verdict(s, strict=False)["status"] == "fail"


def _results(tmp_path):
    s = _suites()
    res = {"schema_version": SCHEMA_VERSION,
           "manifest": {"started": "2026-01-01T00:00:00+00:00", "status": "complete", "commit": "abc", "dirty": True,
                        "command": ["nsa-validate", "oneshot"], "profile": "cpu"},
           "env": {"verdict": "degraded", "facts": {"torch": "2.13.0+cpu"},
                   "findings": [{"check": "flash-attn", "status": "degraded", "detail": "not installed", "fix": "pip install flash-attn"}]},
           "suites": {n: x.to_dict() for n, x in s.items()}, "verdict": verdict(s, strict=False)}
    write_json(tmp_path / "results.json", res)
    return load_results(tmp_path / "results.json")


def test_report_renders_from_results_only(tmp_path):
    md = markdown.render(_results(tmp_path))
    assert md.startswith("# nsa-validate: PARTIAL: sanity passed; fa2 not exercised")
    assert "- **fa2 not exercised**: no CUDA device" in md
    assert "| sanity | pass | 1 | 0 | 0 | 0 |" in md
    assert "no CUDA device" in md and "pip install flash-attn" in md
    assert "prefill/sel=torch" in md and "abc (dirty)" in md


def test_routing_files_each_kernel_under_the_backend_that_ran_it(tmp_path):
    from nsa_validate.config import profiles
    from nsa_validate.run.finish import routing_record
    cases = [CaseRecord("a", "decode", "pass", backends={"decode/cmp": ["triton"]},
                        kernels={"decode/cmp": ["_partial_kernel"]}),
             CaseRecord("b", "decode", "pass", backends={"decode/cmp": ["torch"]},
                        kernels={"decode/cmp": ["elementwise_kernel"]})]
    rt = routing_record(profiles.load("cpu"), {"decode": SuiteResult("decode", "pass", 1.0, cases)})
    assert rt["observed_kernels"]["decode/cmp"] == ["_partial_kernel", "elementwise_kernel"]
    assert rt["observed_kernels_by_backend"]["decode/cmp"] == {"torch": ["elementwise_kernel"],
                                                               "triton": ["_partial_kernel"]}
    res = _results(tmp_path)
    res["routing"] = rt
    row = next(r for r in markdown.render(res).splitlines() if r.startswith("| decode/cmp"))
    assert "**torch**: elementwise_kernel<br>**triton**: _partial_kernel" in row


def test_first_screen_and_summary_text(tmp_path):
    res = _results(tmp_path)
    md = markdown.render(res)
    first = md.split("\n")[:4]
    assert first[0].startswith("# nsa-validate: PARTIAL") and "passed" in first[2] and "level" in first[2]
    assert md.index("## Environment") < md.index("<details>")            # the header folds away
    txt = markdown.summary_text(res)
    assert txt.startswith("nsa-validate: PARTIAL") and "not exercised: fa2: no CUDA device" in txt
    assert "|" not in txt and "<" not in txt                                 # plain text, no markup


def test_junit_has_every_case(tmp_path):
    res = _results(tmp_path)
    junit.write(res, tmp_path / "j.xml")
    root = ET.parse(tmp_path / "j.xml").getroot()
    cases = [c for c in root.findall(".//testcase") if c.get("classname") != "nsa_validate.verdict"]
    assert len(cases) == 2 and root.find(".//skipped").get("message") == "no CUDA device"
    ts = root.find("testsuite")
    assert "timestamp" in ts.attrib and "hostname" in ts.attrib
    props = {p.get("name"): p.get("value") for p in ts.find("properties")}
    assert {"gpu", "commit", "profile", "level", "tool_version"} <= set(props)


@pytest.mark.parametrize("blocking", [[], ["run env-broken"], ["fa2: not exercised in --strict (no CUDA device)"],
                                      ["run interrupted", "regression vs baseline: decode/bench: 1 -> 2"]])
def test_junit_fails_exactly_when_the_verdict_does(tmp_path, blocking):
    """Every blocking verdict entry no failing testcase stands for fails a testcase of the verdict's own
    testsuite (an environment failure, an interruption, strict skips, regressions); a run that passed
    or is partial has one passing verdict testcase."""
    res = _results(tmp_path)
    res["verdict"]["blocking"] = blocking
    res["verdict"]["status"] = "fail" if blocking else "partial"
    junit.write(res, tmp_path / "j.xml")
    root = ET.parse(tmp_path / "j.xml").getroot()
    failed = [tc.get("name") for tc in root.iter("testcase") if tc.find("failure") is not None]
    assert failed == blocking
    v = next(ts for ts in root.iter("testsuite") if ts.get("name") == "verdict")
    assert int(v.get("failures")) == len(blocking) and int(v.get("tests")) == max(1, len(blocking))


def test_nan_metrics_keep_json_valid(tmp_path):
    write_json(tmp_path / "x.json", {"a": float("nan"), "b": [float("inf")]})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": None, "b": ["inf"]}   # NaN: null


def test_where_the_time_went_starts_with_the_commands_own_start():
    """The run's phases as the report says them: the command's start (Python and the CLI's imports, before
    the run began), the environment check and the suites; a run folder without the start says the rest."""
    from nsa_validate.report.markdown import _time_spent
    res = {"manifest": {"phases_s": {"start": 7.9, "env": 3.25, "suites": 56.35}},
           "suites": {"decode": {"duration_s": 53.4, "startup_s": 4.71, "phases_s": {"compile": 20.0, "run": 30.0}}}}
    text = "\n".join(_time_spent(res))
    assert "| suite | wall (s) | processes | start-up (s) | compile (s) |" in text and "| decode | 53.4 | 1 | 4.71 | 20 |" in text, text
    assert ("The command's start 7.9 s, the profile's resolution and the environment check 3.25 s, "
            "suites 56.35 s (wall).") in text
    del res["manifest"]["phases_s"]["start"]
    text = "\n".join(_time_spent(res))
    assert "The profile's resolution and the environment check 3.25 s, suites 56.35 s (wall)." in text
    res["manifest"]["phases_s"]["profile"] = 2.5
    text = "\n".join(_time_spent(res))
    assert ("The profile's resolution and the environment check 3.25 s (the profile's, torch's import and the "
            "GPU's start among it, 2.5 s), suites 56.35 s (wall).") in text


def test_where_the_time_went_names_the_timed_cases_that_held_the_gpu_alone():
    from nsa_validate.report.markdown import _time_spent
    held = {"suites/test_layer.py::test_bench[B1-S65536]": 4.43, "suites/test_layer.py::test_needle": 0.73,
            "suites/test_decode.py::test_bench[B16-S65536]": 4.22, "suites/test_fa2.py::test_bench[cmp-S4096]": 0.1}
    res = {"manifest": {"phases_s": {"env": 3.0, "suites": 50.0}, "gpu_alone_s": held},
           "suites": {"decode": {"duration_s": 40.0, "phases_s": {"run": 30.0}}}}
    text = "\n".join(_time_spent(res))
    assert ("Timed cases holding a GPU alone: 9.48 s summed (layer bench[B1-S65536] 4.43 s, decode "
            "bench[B16-S65536] 4.22 s, layer needle 0.73 s, …).") in text, text
    del res["manifest"]["gpu_alone_s"]
    assert "holding a GPU alone" not in "\n".join(_time_spent(res))


def test_a_process_knows_how_long_ago_it_started():
    """``startup.process_age``: the seconds since the process started, Python's own start included."""
    import subprocess
    import sys
    code = "import time; time.sleep(1.2); from nsa_validate import startup; print(startup.process_age())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.2 <= age < 30, age
