"""Suites sharing a GPU (nsa_validate.suite.gpu_share): parity cases together, a timed case alone."""
import json
import os
import re
import threading
import time

import yaml

from nsa_validate.suite import gpu_share
from tests.harness.test_cli import _small_profile, cli


def test_shared_holders_overlap_and_an_exclusive_one_waits_for_them(tmp_path):
    lock, events = str(tmp_path / "gpu0.lock"), []

    def holder(name, exclusive, hold_s):
        with gpu_share.hold(lock, exclusive):
            events.append(("in", name, time.monotonic()))
            time.sleep(hold_s)
            events.append(("out", name, time.monotonic()))

    a = threading.Thread(target=holder, args=("parity-a", False, 0.6))
    b = threading.Thread(target=holder, args=("parity-b", False, 0.6))
    a.start(), b.start()
    time.sleep(0.2)                                   # both parity cases hold it now
    c = threading.Thread(target=holder, args=("bench", True, 0.1))
    c.start()
    for t in (a, b, c):
        t.join(10)
    at = {(kind, name): ts for kind, name, ts in events}
    assert at[("in", "parity-b")] < at[("out", "parity-a")], "shared holders did not overlap"
    assert at[("in", "bench")] >= max(at[("out", "parity-a")], at[("out", "parity-b")]), \
        "the exclusive holder ran while a shared one still held the GPU"


def test_a_waiting_exclusive_holder_goes_before_shared_ones_that_come_after_it(tmp_path):
    """The turnstile: a parity case that asks while a timed case waits goes after the timed case,
    not on and on before it; a start-up hold (not queued) still gets in, as a waiting timed case needs."""
    lock, events = str(tmp_path / "gpu0.lock"), []

    def holder(name, exclusive, hold_s, queued=True):
        fd = gpu_share.acquire(lock, exclusive, queued=queued)
        events.append(("in", name, time.monotonic()))
        time.sleep(hold_s)
        events.append(("out", name, time.monotonic()))
        gpu_share.release(fd)

    a = threading.Thread(target=holder, args=("parity-a", False, 0.6))
    a.start()
    time.sleep(0.15)                                  # parity-a holds it
    c = threading.Thread(target=holder, args=("bench", True, 0.3))
    c.start()
    time.sleep(0.15)                                  # the bench waits for parity-a
    b = threading.Thread(target=holder, args=("parity-b", False, 0.1))
    s = threading.Thread(target=holder, args=("start-up", False, 0.05, False))
    b.start(), s.start()
    for t in (a, b, c, s):
        t.join(10)
    at = {(kind, name): ts for kind, name, ts in events}
    assert at[("in", "start-up")] < at[("out", "parity-a")], "a start-up hold waited at the turnstile"
    assert at[("in", "bench")] >= max(at[("out", "parity-a")], at[("out", "start-up")]), "overlap"
    assert at[("in", "parity-b")] >= at[("out", "bench")], "a parity case that came later went before the bench"


def test_share_gpu_runs_the_suites_at_once(tmp_path):
    prof = _small_profile(tmp_path)
    p = yaml.safe_load(prof.read_text())
    p["suites"]["fa2"]["bench_seq_lens"] = [256]      # a timed case that starts (and skips inside: no GPU)
    prof.write_text(yaml.safe_dump(p))
    r = cli("suite", "sanity", "fa2", "--profile", str(prof), "--out", str(tmp_path / "runs"), "--share-gpu", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    # stderr is not a terminal here (as in CI): a plain line per suite start, finished case and suite end
    assert re.search(r"^\[ *[0-9.]+s\] sanity: started", r.stderr, re.M), r.stderr[-2000:]
    assert re.search(r"^\[ *[0-9.]+s\] sanity/prefill_matches_oracle\[\w+\] pass \([0-9.]+ s\) \[\d+/\d+\]$", r.stderr, re.M)
    assert re.search(r"^\[ *[0-9.]+s\] sanity: pass in [0-9.]+ s \(\d+ passed", r.stderr, re.M)
    out = json.loads(r.stdout)
    assert out["suites"]["sanity"]["status"] == "pass" and out["suites"]["sanity"]["counts"]["pass"] > 0
    run = next((tmp_path / "runs").glob("*/*"))
    assert json.loads((run / "manifest.json").read_text())["share_gpu"] is True
    assert not list(run.glob(".gpu*")), "the lock or start files were left in the run folder"
    assert len(json.loads(r.stdout)["suites"]) == 2
    held = [json.loads(x) for x in (run / "logs" / "gpu0_share.jsonl").read_text().splitlines()]
    assert {h["exclusive"] for h in held} == {False, True}, "no case held the GPU (or none alone)"
    what = {h["what"] for h in held}
    # a timed case sets up beside the others and runs alone; a case skipped before it starts holds nothing
    assert {"suites/test_fa2.py::test_bench[cmp-S256] (setup)", "suites/test_fa2.py::test_bench[cmp-S256]"} <= what, what
    assert [h for h in held if h["what"] == "suites/test_fa2.py::test_bench[cmp-S256]"][0]["exclusive"]
    assert not any("not-in-profile" in w for w in what), what
    assert gpu_share.overlaps(str(run / "logs" / "gpu0_share.jsonl")) == []
    # the cases that held it alone, in the manifest (the report's "Where the time went" names the longest)
    manifest = json.loads((run / "manifest.json").read_text())
    alone = {h["what"]: h["t1"] - h["t0"] for h in held if h["exclusive"]}
    assert set(manifest["gpu_alone_s"]) == set(alone) and manifest["phases_s"]["alone"] >= 0, manifest
    assert "Timed cases holding a GPU alone:" in (run / "report.md").read_text()


def test_a_hold_log_line_cut_short_is_skipped(tmp_path):
    """A process killed while it wrote its hold leaves half a line: the overlap check and the time alone skip it."""
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "gpu0_share.jsonl"
    log.write_text(json.dumps({"pid": 1, "exclusive": True, "t0": 1.0, "t1": 2.5, "what": "a::bench"}) + "\n"
                   + json.dumps({"pid": 2, "exclusive": False, "t0": 3.0, "t1": 4.0, "what": "b::parity"}) + "\n"
                   + '{"pid": 3, "exclusive": fal')
    assert gpu_share.overlaps(str(log)) == []
    assert gpu_share.alone(tmp_path) == {"a::bench": 1.5}
    # the seconds before a moment (the warming processes' last compile), only for cases that had some
    assert gpu_share.alone(tmp_path, until=2.0) == {"a::bench": 1.0}
    assert gpu_share.alone(tmp_path, until=0.5) == {}


def test_a_suite_in_several_processes_beside_others_takes_its_exclusive_cases_first(monkeypatch):
    """``plugin.pytest_collection_modifyitems``: exclusive cases first (their setups run beside the other
    processes' parity cases), each group in its collected order; a skipped exclusive case is not moved,
    nor is anything where the suite runs alone on its GPU or as one process."""
    import dataclasses

    from nsa_validate.suite import context, plugin

    class Case:
        def __init__(self, name, *marks):
            self.name, self.marks = name, set(marks)

        def get_closest_marker(self, mark):
            return mark if mark in self.marks else None

        def iter_markers(self, name):
            return iter(())

    def order(**ctx):
        cases = [Case("parity1"), Case("bench", "nsa_exclusive"), Case("parity2"),
                 Case("skipped", "nsa_exclusive", "skip"), Case("needle", "nsa_exclusive")]
        monkeypatch.setattr(context, "_current", dataclasses.replace(context.current(), **ctx))
        plugin.pytest_collection_modifyitems(None, None, cases)
        return [c.name for c in cases]
    assert order(gpu_lock="lock", workers=3) == ["bench", "needle", "parity1", "parity2", "skipped"]
    assert order(gpu_lock=None, workers=3) == ["parity1", "bench", "parity2", "skipped", "needle"]
    assert order(gpu_lock="lock", workers=1) == ["parity1", "bench", "parity2", "skipped", "needle"]


def _warming(path: str):
    """A stand-in warming process: ``warming_lock``'s lock handed to a process that sleeps 1 s (as ``prewarm``
    hands it to its first warming process, which forks the others); -> the process."""
    import subprocess
    import sys
    fd = gpu_share.warming_lock(path)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"], pass_fds=(fd,))
    os.close(fd)                                      # the process's now
    return proc


def test_a_timed_case_waits_for_the_warming_processes_to_end(tmp_path):
    """``wait_warming``: the lock ``warming_lock`` took is held as long as the process it was handed to lives;
    the wait ends with it, at once where there is none, and where the run has removed the warming's folder."""
    path = str(tmp_path / "alive")
    proc = _warming(path)
    t0 = time.monotonic()
    gpu_share.wait_warming(path)
    # the lock goes as the process exits, a moment before it can be reaped: its one second of sleep waited out
    assert time.monotonic() - t0 > 0.9, "the wait ended while the process lived"
    proc.wait(timeout=10)
    t0 = time.monotonic()
    gpu_share.wait_warming(path)                      # none left
    gpu_share.wait_warming(str(tmp_path / "gone" / "alive"))
    assert time.monotonic() - t0 < 0.5


def test_a_case_lets_go_of_the_gpu_while_it_waits_for_a_quiet_cpu(tmp_path):
    """``plugin.wait_quiet`` (the ``quiet`` fixture): a timed case holding the GPU alone while the warming runs
    lets go of it until the warming ends (a parity case gets in meanwhile), then holds it alone again; the
    stretch before is logged apart. Once the warming is over, or where there was none, it returns at once."""
    from nsa_validate.suite import plugin
    lock, alive, events = str(tmp_path / "gpu0.lock"), str(tmp_path / "alive"), []
    proc = _warming(alive)
    assert gpu_share.warming_running(alive)

    def parity():
        time.sleep(0.2)
        with gpu_share.hold(lock, False, "b::parity"):
            events.append(("parity in", time.monotonic()))
    with gpu_share.hold(lock, True, "a::bench") as h:
        plugin._QUIET["a::bench"] = (h, alive)
        t = threading.Thread(target=parity)
        t.start()
        t0 = time.monotonic()
        assert plugin.wait_quiet("a::bench") is True
        waited = time.monotonic() - t0
        events.append(("bench again", time.monotonic()))
        t.join(10)
        assert plugin.wait_quiet("a::bench") is False, "waited twice"
        plugin._QUIET.pop("a::bench")
    proc.wait(timeout=10)
    assert waited > 0.9, "the wait ended while the warming process lived"
    at = dict(events)
    assert at["parity in"] < at["bench again"], "the GPU was not let go while the case waited"
    held = [json.loads(x) for x in open(f"{lock}.log")]
    assert [h["what"] for h in held] == ["a::bench (before the quiet CPU)", "b::parity", "a::bench"], held
    assert gpu_share.overlaps(f"{lock}.log") == []
    assert not gpu_share.warming_running(alive) and not gpu_share.warming_running(str(tmp_path / "none"))
    with gpu_share.hold(lock, True, "d::bench") as h:   # the GPU taken while the warming ran; it ended since
        plugin._QUIET["d::bench"] = (h, alive)
        t0 = time.monotonic()
        assert plugin.wait_quiet("d::bench") is True, "timings made beside the warming not said so"
        assert time.monotonic() - t0 < 0.5 and h.fd is not None
        plugin._QUIET["c::bench"] = (None, None)        # no warming when it took the GPU: at once, the GPU kept
        assert plugin.wait_quiet("c::bench") is False
    for k in ("c::bench", "d::bench"):
        plugin._QUIET.pop(k)
    assert [json.loads(x)["what"] for x in open(f"{lock}.log")][3:] == ["d::bench"]


def test_the_layer_bench_times_its_dense_layers_before_the_quiet_and_the_nsa_layer_after(monkeypatch):
    """``layer.measure(quiet=...)``: the dense layers (GPU-bound) are timed first, beside whatever the CPU
    does; the NSA layer, whose host time is a figure of the row, only after ``quiet`` returned; the row
    says whether the dense layers were timed beside the compiles."""
    from nsa_core.routing import RoutingPolicy
    from nsa_validate.bench import layer
    order, state = [], {"quiet": False}

    def fake_time(fn, device, budget_ms, warmed=False):
        order.append(state["quiet"])
        return layer.Measured(ms=1.0, p20_ms=1.0, p80_ms=1.0, host_ms=0.1, timer="cpu")

    def quiet():
        state["quiet"] = True
        return True
    monkeypatch.setattr(layer, "_time", fake_time)
    shape = layer.Shape(1, 64, 32, 1, 2, 16, 16, dtype="fp32", blocks="tiny")
    row = layer.measure(shape, RoutingPolicy(), "cpu", stages=False, quiet=quiet)
    n_dense = 2 * len(row.dense)
    assert n_dense >= 2 and order == [False] * n_dense + [True, True], order
    assert row.dense_beside_compiles and layer.Row.from_dict(row.to_dict()).dense_beside_compiles
    from nsa_validate.report import layer_table
    assert layer_table.records([row])[0]["dense_beside_compiles"] is True


def test_a_case_past_the_warming_wait_is_not_taken_for_the_warming(tmp_path):
    """``warming_running``: a case that ``wait_warming`` let through holds the lock for an instant, exclusive; a
    look at that instant must not read it as the warming still running (the warming holds it shared, for seconds)."""
    import fcntl
    path = str(tmp_path / "alive")
    open(path, "w").close()
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    threading.Timer(0.004, os.close, [fd]).start()
    assert not gpu_share.warming_running(path)
