"""The one timing helper: summary statistics, an honest label on a CPU, and the GPU's work alone
(queued) that tells a host-bound measurement."""
import time

import pytest
import torch

from nsa_validate.measure import timing


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


def test_cpu_loop_calls_token_after_token_and_is_labelled_cpu():
    """``loop``: warm-up calls first, then the timed ones, each with its own index; on a CPU one pass,
    the host clock only."""
    seen = []
    t = timing.loop(lambda i: (seen.append(i), time.sleep(1e-3)), 5, device="cpu", warmup=2)
    assert seen == list(range(7)) and t.timer == "cpu" and t.calls == 5
    assert timing.loop_calls(5, "cpu", warmup=2) == len(seen)
    assert t.wall_ms >= 1.0 and t.events_ms is None and t.host_ms is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the GPU: needs CUDA")
def test_gpu_loop_tells_the_hosts_cost_from_the_gpus_work():
    """``loop`` on a GPU: a call whose GPU work (~1 ms of sleep) outlasts its host work reads ~1 ms a
    call by the wall clock and the events, while its host cost is far below; a call with 1 ms of
    Python and little GPU work reads ~1 ms by all three."""
    from nsa_validate.measure.timing import _sleep_cycles_per_ms
    cycles = int(_sleep_cycles_per_ms())
    x = torch.zeros(1, device="cuda")
    seen = []
    gpu = timing.loop(lambda i: (seen.append(i), torch.cuda._sleep(cycles)), 20, device="cuda")
    assert gpu.wall_ms > 0.8 and gpu.events_ms > 0.8 and gpu.host_ms < 0.3, gpu
    assert len(seen) == timing.loop_calls(20, "cuda") == 3 + 2 * 20 + 2        # a lead call a chunk of 16
    host = timing.loop(lambda i: (x.add_(1), time.sleep(1e-3)), 20, device="cuda")
    assert host.wall_ms > 0.9 and host.host_ms > 0.9, host


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the GPU: needs CUDA")
def test_gpu_loop_host_cost_is_not_queue_waiting():
    """Calls of many small launches, more of them than the GPU's launch queue holds: the host's cost a
    call is measured in chunks that fit it, so it stays below the wall time a call (queued all at once
    behind one sleep, the host waited for room in the queue and read twice the wall time)."""
    x = torch.zeros(1, device="cuda")
    t = timing.loop(lambda i: [x.add_(1) for _ in range(8)], 600, device="cuda")
    assert t.implausible() is None and t.host_ms <= 1.15 * t.wall_ms, t


def test_loop_timing_with_a_host_cost_above_its_wall_time_is_implausible():
    ok = timing.LoopTiming("cuda_events", 10, wall_ms=0.10, events_ms=0.10, host_ms=0.06)
    assert ok.implausible() is None
    bad = timing.LoopTiming("cuda_events", 10, wall_ms=0.14, events_ms=0.14, host_ms=0.28)
    assert "exceeds the loop's wall time" in bad.implausible()
    assert timing.LoopTiming("cpu", 10, 0.1, None, None).implausible() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the GPU: needs CUDA")
def test_gpu_warmup_runs_for_warmup_ms_of_gpu_time():
    """On a GPU the warm-up runs the timed loop's iteration (flush, call) until it has taken
    WARMUP_MS of GPU time; warmup=0 means none at all. A call of ~1 ms of GPU sleep needs ~25."""
    from nsa_validate.measure.timing import _sleep_cycles_per_ms
    cycles = int(_sleep_cycles_per_ms())
    calls = []

    def fn():
        calls.append(1)
        torch.cuda._sleep(cycles)
    t = timing.bench(fn, reps=5, telemetry=False)
    assert len(calls) == t.warmup + 5 and len(t.samples_ms) == 5
    assert timing.WARMUP_MS / 1.5 <= t.warmup <= timing.WARMUP_MS + 4, t.warmup
    calls.clear()
    t = timing.bench(fn, reps=5, warmup=0, telemetry=False)
    assert len(calls) == 5 and t.warmup == 0
    # timed as one graph, the warm-up is WARMUP_MS too, not a whole replay of the graph's 100 calls
    t = timing.bench(lambda: torch.cuda._sleep(cycles), reps=100, graph=True, telemetry=False)
    assert len(t.samples_ms) == 100 and timing.WARMUP_MS / 1.5 <= t.warmup <= timing.WARMUP_MS + 8, t.warmup


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the GPU: needs CUDA")
def test_graph_samples_are_gpu_time_even_when_the_host_lags(monkeypatch):
    """graph=True: a host that is late launching the work must not land inside the samples. Every
    graph replay here first sleeps 2 ms on the host; the samples of 0.2 ms of GPU work stay 0.2 ms
    (each replay launched between events on the stream would measure ~2 ms)."""
    from nsa_validate.measure.timing import _events_in_graph, _sleep_cycles_per_ms
    if not _events_in_graph():
        pytest.skip("this torch cannot record CUDA events inside a graph (Event(external=True))")
    cycles = int(0.2 * _sleep_cycles_per_ms())
    replay = torch.cuda.CUDAGraph.replay

    def late(self):
        time.sleep(2e-3)
        replay(self)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", late)
    t = timing.bench(lambda: torch.cuda._sleep(cycles), graph=True, reps=20, telemetry=False)
    assert t.timer == "cuda_graph" and t.events_in_graph and len(t.samples_ms) == 20
    assert max(t.samples_ms) < 0.5, t.samples_ms
    # the warm-up ran the graph for WARMUP_MS of GPU time, though the sizing iteration, host lag and all, made each
    # call look ~10x longer: at least half the calls of WARMUP_MS at an iteration's flush and 0.2 ms (between them
    # the graph's events add a little; a warm-up cut short by the host's lag made a sixth: docs/decisions.md)
    flush = torch.ones(timing.L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    flush_ms = timing.bench(lambda: timing._evict_l2(flush), reps=5, l2_flush=False, telemetry=False).median_ms
    assert t.warmup >= timing.WARMUP_MS / (2 * (flush_ms + t.median_ms)), (t.warmup, flush_ms)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the GPU: needs CUDA")
def test_graph_timing_takes_its_samples_from_replays_of_a_graph_of_at_most_graph_chunk(monkeypatch):
    """n samples past GRAPH_CHUNK come from several replays of one graph of at most GRAPH_CHUNK repetitions
    (its capture costs the host by its nodes), exactly n of them, each the GPU work's time."""
    if not timing._events_in_graph():
        pytest.skip("this torch cannot record CUDA events inside a graph (Event(external=True))")
    sizes = []
    graph_of = timing._graph_of

    def counted(fn, n, flush):
        sizes.append(n)
        return graph_of(fn, n, flush)
    monkeypatch.setattr(timing, "_graph_of", counted)
    cycles = int(0.1 * timing._sleep_cycles_per_ms())
    n = 2 * timing.GRAPH_CHUNK + 7
    t = timing.bench(lambda: torch.cuda._sleep(cycles), graph=True, reps=n, telemetry=False)
    assert len(t.samples_ms) == n and sizes and max(sizes) <= timing.GRAPH_CHUNK, (len(t.samples_ms), sizes)
    assert 0.08 < min(t.samples_ms) and max(t.samples_ms) < 0.3, t.samples_ms


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the GPU: needs CUDA")
def test_queued_timing_tells_a_host_bound_call_from_a_gpu_bound_one():
    """CUDA events around a call that launches slower than the GPU runs measure the host; queued,
    the same call shows the GPU's work alone. A GPU-bound call measures the same both ways."""
    x = torch.randn(64, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)

    def host_bound():                    # 20 tiny kernels, 0.5 ms of Python between them
        for _ in range(20):
            x.mul_(1.0)
            time.sleep(5e-4)

    def gpu_bound():
        for _ in range(10):
            a @ a

    for fn, bound in ((host_bound, True), (gpu_bound, False)):
        plain = timing.bench(fn, reps=5, telemetry=False)
        queued = timing.bench(fn, reps=5, queued=True, telemetry=False)
        assert plain.timer == "cuda_events" and queued.timer == "cuda_queued"
        ratio = plain.median_ms / queued.median_ms
        if bound:
            assert plain.median_ms >= 10.0 and ratio > 5, (plain.median_ms, queued.median_ms)
        else:
            assert 0.8 < ratio < 1.25, (plain.median_ms, queued.median_ms)


def test_layer_measurement_is_host_bound_by_its_gpu_work_alone(tmp_path):
    """A layer measurement is host-bound when its timed figure exceeds the GPU's work alone by
    HOST_BOUND, and the tables then show the GPU's figure beside it; host time alone decides
    nothing (CUDA events around a host-bound call measure the host, so the two agree)."""
    from nsa_validate.report import layer_table
    from nsa_validate.bench import layer
    slow = layer.Measured(ms=1.12, p20_ms=1.1, p80_ms=1.2, host_ms=1.1, gpu_ms=0.22, timer="cuda_events")
    fine = layer.Measured(ms=10.0, p20_ms=9.9, p80_ms=10.1, host_ms=0.5, gpu_ms=9.8, timer="cuda_events")
    unknown = layer.Measured(ms=3.0, p20_ms=3.0, p80_ms=3.0, host_ms=3.0, timer="cuda_events")    # before gpu_ms
    assert slow.host_bound and slow.host_ratio == pytest.approx(1.12 / 0.22)
    assert not fine.host_bound and not unknown.host_bound and unknown.host_ratio is None
    assert layer_table._cell(slow) == "1.120 (GPU 0.220)" and layer_table._cell(fine) == "10.000"
    row = layer.Row(layer.Shape(1, 8192, 2048, 4, 16, 128, 128), {}, fine, fine, {}, {}, {},
                    {"compression": slow}, {"compression": slow})
    assert layer.Row.from_dict(row.to_dict()).stages_bwd["compression"].gpu_ms == 0.22
    rec = layer_table.records([row])[0]
    assert rec["nsa_fwd_gpu_ms"] == 9.8 and rec["host_bound"] is False
    assert layer_table._stage_cell(row, "compression") == "1.120 (GPU 0.220) / 1.120 (GPU 0.220)"


def test_fresh_loop_waits_after_its_warm_up_until_told_to_go():
    """``FreshLoop`` (the decode bench's user loop, in a process of its own): ready once warmed up, the timed
    loop only on ``run``; a process that cannot make its loop is one clear error, not a hang."""
    from nsa_validate.bench import decode
    loop = decode.FreshLoop(False, 1, 40, 60, "fp32", 2, seed=3, timeout_s=120, device="cpu")
    try:
        loop.ready()
        assert loop.proc.poll() is None, "the process went on without being told to"
        t = loop.run()
    finally:
        loop.close()
    assert t.timer == "cpu" and t.calls == 2 and t.wall_ms > 0 and loop.proc.returncode == 0
    unused = decode.FreshLoop(False, 1, 40, 60, "fp32", 2, seed=3, timeout_s=120, device="cpu")
    unused.close()                                          # a setup that failed before the loop ran
    assert unused.proc.returncode is not None and unused.proc.stdout.closed and unused.err.closed
    bad = decode.FreshLoop(False, 1, 40, 60, "fp8", 2, seed=3, timeout_s=120, device="cpu")
    with pytest.raises(RuntimeError, match="ended before it was ready .exit code 2.*invalid choice: 'fp8'"):
        bad.run()


def test_decode_loop_entry_point_prints_its_timing(capsys):
    """``python -m nsa_validate.bench.decode --loop N`` (what the decode bench runs in a process of its own on
    a GPU): the loop's ``LoopTiming`` as one JSON line."""
    import json

    from nsa_validate.bench import decode
    decode.main(["--batch", "1", "--context", "40", "--dtype", "fp32", "--config", "tiny", "--loop", "2",
                 "--device", "cpu", "--seed", "3"])
    t = timing.LoopTiming(**json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert t.timer == "cpu" and t.calls == 2 and t.wall_ms > 0


def test_decode_loop_longer_than_the_context_is_refused_before_any_work(capsys):
    """The loop ends at the context's last token, so it cannot append more tokens than the context holds:
    argparse's one line and exit code 2, before a cache or a layer is made."""
    from nsa_validate.bench import decode
    with pytest.raises(SystemExit) as e:
        decode.main(["--batch", "1", "--context", "8", "--config", "tiny", "--loop", "20", "--device", "cpu"])
    assert e.value.code == 2
    assert "the decode loop appends" in capsys.readouterr().err
