"""Physically impossible figures fail: bandwidth past the device's measured ceiling, TFLOP/s past
the spec sheet, non-positive times."""
import pytest

from nsa_validate.measure import limits, timing
from nsa_validate.suite import plugin

H100 = limits.Ceilings(copy_gbs=3000.0, read_gbs=3100.0, l2_bytes=50 << 20, peak_tflops=989.0)


def _t(ms: float, flush: bool = True, timer: str = "cuda_graph") -> timing.Timing:
    return timing.Timing(timer, [ms * f for f in (0.98, 0.99, 1.0, 1.01, 1.02)], 3, flush)


def test_twice_the_copy_bandwidth_is_implausible():
    nbytes = 228e6                                           # the decode step's bytes at B=16, 64k
    honest = _t(nbytes / 1600e9 * 1e3)                       # 1600 GB/s: 53% of the copy bandwidth
    halved = _t(nbytes / 6000e9 * 1e3)                       # a timer that misses half the work
    assert limits.implausible(honest.summary(), nbytes, None, H100) == []
    bad = limits.implausible(halved.summary(), nbytes, None, H100)
    assert len(bad) == 1 and "6000 GB/s" in bad[0] and "3100 GB/s" in bad[0]


def test_cached_working_set_is_not_held_to_dram_bandwidth():
    small = 8e6                                              # fits the L2, and the L2 was not flushed
    assert limits.implausible(_t(small / 9000e9 * 1e3, flush=False).summary(), small, None, H100) == []
    assert limits.implausible(_t(small / 9000e9 * 1e3, flush=True).summary(), small, None, H100)


def test_flops_past_the_spec_peak_and_non_positive_times_are_implausible():
    flops = 2e12
    assert limits.implausible(_t(1.0).summary(), None, flops, H100)            # 2000 TFLOP/s
    assert limits.implausible(_t(4.0).summary(), None, flops, H100) == []      # 500 TFLOP/s
    zero = timing.Timing("cuda_events", [0.0, 0.1, 0.1], 3, True).summary()
    assert "non-positive" in limits.implausible(zero, None, None, H100)[0]


def test_a_bench_record_past_the_ceiling_fails_its_case(monkeypatch):
    """What every suite's bench goes through: Recorder.timing fails the case."""
    monkeypatch.setattr(limits, "ceilings", lambda device, peak: H100)
    rec = plugin.Recorder()
    nbytes = 228e6
    rec.timing("graph", _t(nbytes / 1600e9 * 1e3), nbytes=nbytes)
    assert rec.metrics["graph"]["achieved_gbs"] == pytest.approx(1600, rel=1e-3)
    with pytest.raises(AssertionError, match=r"implausible measurement \(timing bug\?\): graph: 6000 GB/s"):
        rec.timing("graph", _t(nbytes / 6000e9 * 1e3), nbytes=nbytes)
