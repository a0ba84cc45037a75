"""The layer bench's ``_time`` on the GPU path (forced here on a CPU): an out-of-memory measurement is
recorded as a result and the sweep's table still renders (a shape that does not fit), and a dense
layer that ``layer.warm`` already ran at its shape is not warmed again before its samples."""
import torch

from nsa_validate.report import layer_table
from nsa_validate.bench import layer
from nsa_validate.report.extra import SuiteExtra

OOM = "CUDA out of memory. Tried to allocate 96.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


def _no_cuda_calls(monkeypatch):
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)


def test_oom_is_recorded_with_the_size_it_tried(monkeypatch):
    _no_cuda_calls(monkeypatch)
    calls = []

    def fn():
        calls.append(1)
        raise torch.cuda.OutOfMemoryError(OOM)

    m = layer._time(fn, "cuda", budget_ms=100.0)
    assert calls, "the measured function never ran"
    assert m.ms is None and m.timing is None
    assert "Tried to allocate 96.00 GiB" in m.oom


def test_other_errors_are_not_swallowed(monkeypatch):
    _no_cuda_calls(monkeypatch)

    def fn():
        raise RuntimeError("an illegal memory access was encountered")

    try:
        layer._time(fn, "cuda", budget_ms=100.0)
    except RuntimeError as e:
        assert "illegal memory access" in str(e)
    else:
        raise AssertionError("a non-OOM error was recorded as a result")


def test_table_renders_an_oom_row(tmp_path):
    shape = layer.Shape(1, 65536, 2048, 4, 16, 192, 128)
    oom = layer.Measured(oom=f"out of memory: {OOM}")
    ok = layer.Measured(ms=120.0, p20_ms=119.0, p80_ms=121.0, host_ms=2.0, peak_gib=9.3, timer="cuda")
    dense = {"sdpa": layer.Dense("sdpa", "sdpa, d_k=192, d_v=128", "sdpa", 192, 128)}
    row = layer.Row(shape, {"cmp": "triton", "sel": "triton", "win": "fa2:auto", "select": "triton"},
                    nsa_fwd=ok, nsa_fwdbwd=oom, dense_fwd={"sdpa": ok}, dense_fwdbwd={"sdpa": oom}, dense=dense)
    assert row.speedup("fwdbwd") is None and row.speedup("fwd") == 1.0
    extra = SuiteExtra(str(tmp_path))
    df = layer_table.finish([row], extra, device="CPU")
    assert len(df) == 1 and (tmp_path / "layer.csv").exists()
    cells = [r["NSA fwd+bwd"] for r in extra.data["tables"][layer_table.TABLE]]
    assert cells and "oom" in cells[0], cells


def _calls_made(monkeypatch, cost_ms: float, warmed: bool) -> tuple[int, layer.Measured]:
    """How many times ``_time`` calls a function that takes ``cost_ms`` of a fake clock, before timing it
    (``timing.bench`` stubbed: three samples of that cost)."""
    _no_cuda_calls(monkeypatch)
    clock, calls = [0.0], []
    monkeypatch.setattr(layer.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(layer.timing, "bench", lambda fn, **k: layer.timing.Timing("cuda_events", [cost_ms] * 3, 0, True))

    def fn():
        calls.append(1)
        clock[0] += cost_ms / 1e3

    m = layer._time(fn, "cuda", budget_ms=300.0, warmed=warmed)
    return len(calls), m


def test_a_warmed_slow_call_is_not_warmed_again(monkeypatch):
    # the dense layer's 64k forward+backward that layer.warm ran at its shape: its first call measures the host
    assert _calls_made(monkeypatch, 470.0, warmed=True)[0] == 1
    # not warmed by layer.warm (too little memory free then): an untimed call first
    assert _calls_made(monkeypatch, 470.0, warmed=False)[0] == 2


def test_a_warmed_quick_call_measures_its_host_time_on_a_second_call(monkeypatch):
    # a quick call's host time would be the allocator's after warm's empty_cache: measured again, warm
    n, m = _calls_made(monkeypatch, 40.0, warmed=True)
    assert n == 2 and m.host_ms == 40.0
    assert _calls_made(monkeypatch, 40.0, warmed=False)[0] == 2
