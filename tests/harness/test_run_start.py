"""A run's start: the suites begin beside the environment check, their events shown after its report,
and a broken environment stops them with nothing counted (``run/execute.py``, ``run/listener.Held``)."""
import json
import time

from nsa_validate.env import envcheck
from nsa_validate.run.execute import RunRequest, execute
from nsa_validate.run.listener import Listener
from nsa_validate.run.listener import Held


class Recorder(Listener):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def env_checked(self, report) -> None:
        self.events.append(("env_checked", report.verdict))

    def env_broken(self) -> None:
        self.events.append(("env_broken",))

    def suite_started(self, name, where, processes=1) -> None:
        self.events.append(("suite_started", name))

    def suite_progress(self, name, done, total, running, elapsed_s) -> None:
        self.events.append(("suite_progress", name, len(done)))

    def suite_finished(self, name, where, result) -> None:
        self.events.append(("suite_finished", name))


def test_suite_events_are_kept_in_order_until_released():
    rec = Recorder()
    held = Held(rec)
    held.suite_started("decode", "", 2)
    held.suite_progress("decode", [1], 3, None, 0.5)
    rec.env_checked(envcheck.EnvReport())            # what the run shows first
    assert rec.events == [("env_checked", "ok")]
    held.release()
    held.suite_finished("decode", "", None)
    assert rec.events == [("env_checked", "ok"), ("suite_started", "decode"), ("suite_progress", "decode", 1),
                          ("suite_finished", "decode")]


def test_a_broken_environment_stops_the_suites_started_beside_its_check(tmp_path, monkeypatch):
    """The check (here a stand-in) returns only once a suite's process has started: the run must not wait
    for it to start them. It finds the stack broken: the suite is stopped, nothing of it counts, and no
    suite event reaches the caller."""
    started = {}

    def broken_after_the_suites_start(wait=True):
        t0 = time.monotonic()
        while not list(tmp_path.glob("*/*/logs/sanity.log")) and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        started["suite"] = bool(list(tmp_path.glob("*/*/logs/sanity.log")))
        return envcheck.EnvReport(findings=[envcheck.Finding("torch", "broken", "a stand-in finding")])

    monkeypatch.setattr(envcheck, "collect", broken_after_the_suites_start)
    rec = Recorder()
    out = execute(RunRequest(["sanity"], "cpu", level="quick", out=str(tmp_path), gate_env=True), rec)
    assert started["suite"], "the suite's process had not started while the environment was checked"
    assert out.status == "env-broken" and out.results["suites"] == {}, (out.status, out.results["suites"])
    assert rec.events == [("env_checked", "broken"), ("env_broken",)], rec.events
    manifest = json.loads((out.run_dir / "manifest.json").read_text())
    assert manifest["status"] == "env-broken"
    assert manifest["phases_s"]["suites_from"] <= manifest["phases_s"]["env"], manifest["phases_s"]
