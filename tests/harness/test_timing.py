"""The one timing helper: summary statistics, and an honest label on a CPU."""
import pytest

from nsa_validate import timing


def test_summary_is_median_and_p20_p80_of_the_samples():
    t = timing.Timing("cuda_events", [5.0, 1.0, 2.0, 4.0, 3.0], warmup=1, l2_flush=True)
    s = t.summary()
    assert s["median_ms"] == 3.0 and s["reps"] == 5 and s["timer"] == "cuda_events"
    assert s["p20_ms"] == pytest.approx(1.8) and s["p80_ms"] == pytest.approx(4.2)
    assert s["samples_ms"] == [5.0, 1.0, 2.0, 4.0, 3.0]


def test_one_sample():
    t = timing.Timing("cpu", [2.5], warmup=0, l2_flush=False)
    assert t.median_ms == t.p20_ms == t.p80_ms == 2.5


def test_cpu_bench_is_labelled_cpu_and_respects_reps():
    calls = []
    t = timing.bench(lambda: calls.append(1), device="cpu", warmup=2, reps=7)
    assert t.timer == "cpu" and len(t.samples_ms) == 7 and len(calls) == 2 + 7     # no sizing call
