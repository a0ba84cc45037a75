"""`nsa-validate profile suggest RUN [--apply]`: a suggestion next to the profile; apply keeps a backup."""
import json
import shutil

import yaml

from test_cli import REPO, cli


def _run(tmp_path, suggest, triton=None):
    prof = tmp_path / "profiles" / "sm90.yaml"
    prof.parent.mkdir()
    shutil.copy(REPO / "profiles" / "sm90.yaml", prof)
    run = tmp_path / "run"
    run.mkdir()
    zero = {"pass": 0, "fail": 0, "skip": 0, "error": 0}
    fa2 = {"status": "pass", "cases": [], "counts": zero, "duration_s": 1.0, "extra": {"suggest": suggest} if suggest else {}}
    suites = {"fa2": fa2}
    if triton:
        suites["triton"] = {"status": "pass", "cases": [], "counts": zero, "duration_s": 1.0, "extra": {"suggest": triton}}
    (run / "results.json").write_text(json.dumps({
        "schema_version": 1, "manifest": {"profile": "sm90", "profile_source": str(prof),
                                          "started": "2026-11-21T00:00:00+00:00"},
        "env": {"facts": {"gpu": {"name": "NVIDIA H100 80GB HBM3"}}}, "suites": suites,
        "verdict": {"status": "pass", "totals": zero, "blocking": []}}))
    return prof, run


SUGGEST = {"fa2_backend": "flash_attn", "fa2_min_len_cmp": 4096, "fa2_min_len_win": None}


def test_suggest_writes_next_to_the_profile_and_leaves_it(tmp_path):
    prof, run = _run(tmp_path, SUGGEST)
    before = prof.read_text()
    r = cli("profile", "suggest", str(run), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    sug = prof.with_name("sm90.suggested.yaml")
    assert out["suggested"] == str(sug) and prof.read_text() == before
    routing = yaml.safe_load(sug.read_text())["routing"]
    assert routing["fa2_min_len_cmp"] == 4096 and routing["fa2_min_len_win"] is None
    assert routing["fa2_backend"] == "flash_attn" and routing["sel_triton_min_len"] == 1024
    # a second suggestion keeps the first one as a backup
    assert cli("profile", "suggest", str(run)).returncode == 0
    assert len(list(prof.parent.glob("sm90.suggested.yaml.bak-*"))) == 1


def test_apply_replaces_only_after_a_backup(tmp_path):
    prof, run = _run(tmp_path, SUGGEST)
    before = prof.read_text()
    r = cli("profile", "suggest", str(run), "--apply", "--json")
    assert r.returncode == 0, r.stderr
    backup = json.loads(r.stdout)["backup"]
    assert open(backup).read() == before
    assert yaml.safe_load(prof.read_text())["routing"]["fa2_min_len_cmp"] == 4096


def test_triton_route_thresholds_join_the_suggestion(tmp_path):
    """The triton suite's route recommendation (its bench of the Triton compressed / selection
    kernels vs the torch path) lands in the same suggested profile as the fa2 one, or alone."""
    prof, run = _run(tmp_path, SUGGEST, triton={"cmp_triton_min_len": 512, "select_triton_min_len": None})
    assert cli("profile", "suggest", str(run)).returncode == 0
    routing = yaml.safe_load(prof.with_name("sm90.suggested.yaml").read_text())["routing"]
    assert routing["cmp_triton_min_len"] == 512 and routing["select_triton_min_len"] is None
    assert routing["fa2_min_len_cmp"] == 4096
    (tmp_path / "alone").mkdir()
    prof, run = _run(tmp_path / "alone", None, triton={"cmp_triton_min_len": 128, "select_triton_min_len": 128})
    assert cli("profile", "suggest", str(run)).returncode == 0
    routing = yaml.safe_load(prof.with_name("sm90.suggested.yaml").read_text())["routing"]
    assert routing["cmp_triton_min_len"] == 128 and routing["fa2_min_len_cmp"] == 16384


def test_run_without_a_recommendation_is_bad_input(tmp_path):
    prof, run = _run(tmp_path, None)
    r = cli("profile", "suggest", str(run))
    assert r.returncode == 2 and "no routing recommendation" in r.stderr and "Traceback" not in r.stderr
    r = cli("profile", "suggest", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "no results.json" in r.stderr


# -- issue 64: the file the run used, the key it names, nothing else ---------------------
def test_apply_edits_the_top_level_routing_key_only():
    """A key of the same name elsewhere (here under suites) is left alone; a flow-style routing or a file
    that is not a profile is refused, not edited."""
    import pytest

    from nsa_validate.config import thresholds
    text = ("name: x\nsuites:\n  layer:\n    routing:\n      sel_triton_min_len: 5   # not this one\n"
            "routing:\n  # the threshold\n  sel_triton_min_len: 1024  # this one\n  fa2_backend: auto\n")
    out = thresholds.rewrite_routing(text, {"sel_triton_min_len": 4096}, "# h\n")
    data = yaml.safe_load(out)
    assert data["routing"]["sel_triton_min_len"] == 4096 and data["suites"]["layer"]["routing"]["sel_triton_min_len"] == 5
    assert "# this one" in out and "# not this one" in out
    for bad in ("routing: {sel_triton_min_len: 1024}\n", "sel_triton_min_len: 1024\n", "[1, 2]\n"):
        with pytest.raises(ValueError):
            thresholds.rewrite_routing(bad, {"sel_triton_min_len": 4096}, "# h\n")


def test_apply_refuses_a_shipped_profile_and_a_relative_source(tmp_path):
    shipped = REPO / "profiles" / "sm90.yaml"
    before = shipped.read_text()
    for source in (str(shipped), "profiles/sm90.yaml"):
        (d := tmp_path / source.replace("/", "_")).mkdir()
        prof, run = _run(d, SUGGEST)
        res = json.loads((run / "results.json").read_text())
        res["manifest"]["profile_source"] = source
        (run / "results.json").write_text(json.dumps(res))
        r = cli("profile", "suggest", str(run), "--apply")
        assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr
    assert shipped.read_text() == before


def test_apply_writes_through_a_linked_profile_and_keeps_one_header(tmp_path):
    prof, run = _run(tmp_path, SUGGEST)
    link = tmp_path / "linked.yaml"
    link.symlink_to(prof)
    res = json.loads((run / "results.json").read_text())
    res["manifest"]["profile_source"] = str(link)
    (run / "results.json").write_text(json.dumps(res))
    for _ in range(2):
        assert cli("profile", "suggest", str(run), "--apply").returncode == 0
    assert link.is_symlink() and yaml.safe_load(prof.read_text())["routing"]["fa2_min_len_cmp"] == 4096
    assert prof.read_text().count("Suggested by `nsa-validate profile suggest`") == 1
