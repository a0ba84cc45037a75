"""The one timing helper (docs/method.md). Every bench in the project calls ``bench``.

On a GPU each repetition is bracketed by CUDA events on the current stream, so the figure is the
GPU's time, not Python's; with ``graph=True`` the work is first captured in a CUDA graph and each
repetition is one graph replay (no launch overhead at all). With ``queued=True`` each repetition
waits behind a GPU sleep that outlasts the host's launching of it, so every kernel is queued
before the GPU reaches it: the figure is the GPU's work alone, without the gaps a slow host
leaves. (CUDA events around a host-bound call measure the host: the GPU runs each kernel as it
arrives. Only the queued figure tells such a call from a GPU-bound one.) An optional L2 flush
before every repetition makes the reads come from HBM: it reads a buffer larger than any L2, so
the cache it leaves holds clean lines (a flush that writes leaves it full of dirty lines, and the
timed work would pay for writing them back). The raw samples are kept; the summary is the median and
the p20–p80 band, never a lone mean. On the CPU the timer is ``time.perf_counter`` and the result
is labelled so (``timer == "cpu"``): such figures are noise for performance purposes.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

L2_FLUSH_BYTES = 256 << 20      # larger than any current L2 (H100 50 MB, B200 126 MB)


def _evict_l2(buf: torch.Tensor) -> None:
    """Evict L2 by reading ``buf`` (L2_FLUSH_BYTES). A read, not a write (``buf.zero_()``, as
    triton.testing.do_bench flushes): a written buffer stays in L2 as dirty lines whose write-back
    the timed work pays. H100, NSA decode step (paper config, 64k, graph replay), read vs write
    flush: B=16 110.8 vs 117.9 us, B=1 29.8-30.6 vs 31.4-31.9 (27.6 with no flush: its 14 MB stay
    in L2 otherwise)."""
    buf.amax()


@dataclass
class Timing:
    timer: str                       # "cuda_events" | "cuda_graph" | "cuda_queued" | "cpu"
    samples_ms: list[float]
    warmup: int
    l2_flush: bool
    telemetry_before: dict = field(default_factory=dict)
    telemetry_after: dict = field(default_factory=dict)

    def decile(self, k: int) -> float:
        """The k-th decile (k = 2: p20) of the samples, linear interpolation."""
        s = self.samples_ms
        return s[0] if len(s) == 1 else statistics.quantiles(s, n=10, method="inclusive")[k - 1]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def p20_ms(self) -> float:
        return self.decile(2)

    @property
    def p80_ms(self) -> float:
        return self.decile(8)

    def summary(self) -> dict:
        """What a results record carries: median, band, count, timer, and the raw samples."""
        return {"median_ms": self.median_ms, "p20_ms": self.p20_ms, "p80_ms": self.p80_ms,
                "reps": len(self.samples_ms), "timer": self.timer, "l2_flush": self.l2_flush,
                "samples_ms": [round(s, 6) for s in self.samples_ms]}

    def to_dict(self) -> dict:
        return asdict(self)


def _telemetry() -> dict:
    from nsa_validate.envcheck import gpu_telemetry
    t = gpu_telemetry()
    return {k: t[k] for k in ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "pstate") if k in t}


_GRAPHS_WARM: set[int] = set()                 # the GPUs this process has captured throwaway graphs on


def _warm_graph_replays() -> None:
    """Capture two throwaway CUDA graphs on the current GPU, once per process, as ``_capture`` captures
    (warm-up calls on a side stream, then the capture). Before that, the graphs a process replays run
    slower, the first one it captured included (which speeds up once two more exist; allocations of the
    same sizes do not do it): H100, the paper config's decode step at B=16, 64k, graph-replayed after the
    read flush, fresh processes: the first two ``bench`` calls 105.3-106.9 µs, every later one 100.6-101.6
    (five processes); with two graphs of one small kernel captured this way first, 101.0-101.2 from the
    first call, and 101.1-101.3 through this function (the same two captured without the side stream's
    warm-up calls: the first call still 106.4-106.9); one graph timed, 104.8-105.2, then again after two
    such captures, 99.9-100.0. So a graph figure does not depend on what its process happened to
    capture before it."""
    dev = torch.cuda.current_device()
    if dev in _GRAPHS_WARM:
        return
    _GRAPHS_WARM.add(dev)
    x = torch.zeros(1, device="cuda")
    for _ in range(2):
        _capture(lambda: x.add_(1))
    torch.cuda.synchronize()


def _capture(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture fn in a CUDA graph (warmed up on a side stream, as torch.cuda.graphs requires)."""
    _warm_graph_replays()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


_CYCLES_PER_MS: float | None = None             # torch.cuda._sleep's rate, measured on first use


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured once per process."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)                 # a first, untimed sleep (module load, clocks up)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        _CYCLES_PER_MS = 10_000_000 / max(a.elapsed_time(b), 1e-3)
    return _CYCLES_PER_MS


def bench(fn: Callable[[], object], *, device: str = "cuda", warmup: int = 3, reps: int | None = None,
          budget_ms: float = 400.0, min_reps: int = 5, max_reps: int = 200, l2_flush: bool = True,
          graph: bool = False, queued: bool = False, telemetry: bool = True) -> Timing:
    """Time ``fn()``. ``reps`` None: as many as fit in ``budget_ms`` (within [min_reps, max_reps]),
    sized by one timed call after the warmup calls; else exactly ``reps``. ``graph``: time
    replays of a CUDA graph of fn (GPU only). ``queued``: the GPU's work alone, each repetition
    launched while the GPU sleeps (timer "cuda_queued"; GPU only). A function that waits on the GPU
    inside cannot get ahead of it, and its queued figure stays its plain one."""
    def n_reps(est_ms: float) -> int:
        return reps or max(min_reps, min(max_reps, int(budget_ms / max(est_ms, 1e-3))))

    if device != "cuda":
        for _ in range(warmup):
            fn()
        if reps is None:            # one timed call to size the run
            t0 = time.perf_counter()
            fn()
        n = reps or n_reps((time.perf_counter() - t0) * 1e3)
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return Timing("cpu", samples, warmup, False)

    before = _telemetry() if telemetry else {}
    run = _capture(fn) if graph else fn
    for _ in range(warmup):
        run()
    flush = torch.ones(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda") if l2_flush else None
    torch.cuda.synchronize()
    if reps is None:                # one timed call to size the run
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        torch.cuda.synchronize()
    n = reps or n_reps(e0.elapsed_time(e1))
    sleep = 0
    if queued:                      # outlast the host's launching of one repetition, twice over
        t0 = time.perf_counter()
        run()
        host_ms = (time.perf_counter() - t0) * 1e3
        sleep = int((2 * host_ms + 0.5) * _sleep_cycles_per_ms())
        torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        if flush is not None:
            _evict_l2(flush)
        if sleep:
            torch.cuda._sleep(sleep)
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    samples = [a.elapsed_time(b) for a, b in zip(starts, ends)]
    after = _telemetry() if telemetry else {}
    timer = "cuda_graph" if graph else "cuda_queued" if queued else "cuda_events"
    return Timing(timer, samples, warmup, l2_flush, before, after)
