"""The one timing helper (docs/method.md). Every bench in the project calls ``bench``.

On a GPU each repetition is bracketed by CUDA events on the current stream, so the figure is the
GPU's time, not Python's; with ``graph=True`` the work is captured in a CUDA graph, the repetitions
with their events too, so that the timed loop is a few launches of one graph and no host delay can fall
inside a sample. The warm-up runs the timed loop's iteration for at least WARMUP_MS of GPU time
first. With ``queued=True`` each repetition
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

import functools
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from nsa_core.cuda_graph import capturing

L2_FLUSH_BYTES = 256 << 20      # larger than any current L2 (H100 50 MB, B200 126 MB)
WARMUP_MS = 25.0                # the least GPU time the warm-up runs for, as ``triton.testing.do_bench``
MAX_WARMUP = 1000               # but at most this many extra warm-up calls
# repetitions one timed graph holds at most: n samples are ceil(n / GRAPH_CHUNK) replays of a graph of about n / that
# many. A graph's capture and instantiation cost host time by its nodes (~0.1 s for the decode step's 200 at B=16 on
# an H200, of a timing's 0.22-0.26 s); what a sample holds is the same in any replay (docs/decisions.md)
GRAPH_CHUNK = 50


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
    events_in_graph: bool = False    # graph timings: the samples' events recorded inside the graph (``bench``)

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
        """What a results record carries: median, band, count, timer, warm-up calls, the raw samples, and
        the GPU's clocks, power and temperature before and after (nvidia-smi; where it was read)."""
        optional = {k: v for k, v in (("telemetry_before", self.telemetry_before),
                                      ("telemetry_after", self.telemetry_after),
                                      ("events_in_graph", self.events_in_graph)) if v}
        return {"median_ms": self.median_ms, "p20_ms": self.p20_ms, "p80_ms": self.p80_ms,
                "reps": len(self.samples_ms), "timer": self.timer, "l2_flush": self.l2_flush, "warmup": self.warmup,
                "samples_ms": [round(s, 6) for s in self.samples_ms], **optional}

    def to_dict(self) -> dict:
        return asdict(self)


def _telemetry() -> dict:
    from nsa_validate.env.envcheck import gpu_telemetry
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


def _side_stream_calls(fn: Callable[[], object], calls: int) -> None:
    """fn called on a side stream: the warm-up torch.cuda.graphs asks for before a capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(s)


def _capture(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture fn in a CUDA graph (warmed up on a side stream, as torch.cuda.graphs requires)."""
    _warm_graph_replays()
    _side_stream_calls(fn, 3)
    g = torch.cuda.CUDAGraph()
    with capturing(g):
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
          graph: bool = False, queued: bool = False, telemetry: bool = True, warmup_ms: float = WARMUP_MS) -> Timing:
    """Time ``fn()``. ``reps`` None: as many as fit in ``budget_ms`` (within [min_reps, max_reps]),
    sized by one timed iteration (flush and call) after the warmup calls; else exactly ``reps``.

    On a GPU, with ``warmup`` > 0, the warm-up goes on as the timed loop runs (flush, then call)
    until it has taken ``warmup_ms`` of GPU time (at most MAX_WARMUP more calls): the first few
    milliseconds of a GPU-bound loop after lighter work run slower (H100, decode step B=16, 64k, in a
    ``oneshot``, three warm-up calls after a host-bound phase: the first 20 of 200 samples 118 µs, the
    rest 106-107). ``warmup`` = 0: no warm-up at all. ``Timing.warmup`` counts every warm-up call.

    ``graph``: fn captured in a CUDA graph (GPU only). Where torch records CUDA events inside a graph
    (``Event(external=True)``), the timed loop is replays of one graph, [flush, event, fn, event] × up to
    GRAPH_CHUNK, so nothing the host does (or fails to do in time) can fall between a sample's two events
    (``Timing.events_in_graph``); else each repetition is a replay between events on the stream.
    ``queued``: the GPU's work alone, each repetition launched while the GPU sleeps (timer
    "cuda_queued"; GPU only). A function that waits on the GPU inside cannot get ahead of it, and
    its queued figure stays its plain one."""
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
    if flush is not None:
        _evict_l2(flush)            # its kernel loads now, not inside the sizing iteration's events
    torch.cuda.synchronize()
    warm = warmup > 0 and warmup_ms > 0
    iter_ms = run_ms = None
    if reps is None or warm:        # one timed iteration, as the loop below runs it, to size the run
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        if flush is not None:
            _evict_l2(flush)
        e1.record()
        run()
        e2.record()
        torch.cuda.synchronize()
        warmup += 1
        iter_ms, run_ms = e0.elapsed_time(e2), e1.elapsed_time(e2)
    n = reps or n_reps(run_ms)
    in_graph = graph and _events_in_graph()
    if in_graph:
        samples, warmed = _timed_graph(fn, n, flush, warmup_ms if warm else 0.0, iter_ms)
        warmup += warmed
    else:
        if warm:                    # the rest of the warm-up, as the loop runs
            more = max(0, min(MAX_WARMUP, math.ceil(warmup_ms / max(iter_ms, 1e-3)) - 1))
            for _ in range(more):
                if flush is not None:
                    _evict_l2(flush)
                run()
            warmup += more
            torch.cuda.synchronize()
        samples = _timed_stream(run, n, flush, queued)
    after = _telemetry() if telemetry else {}
    timer = "cuda_graph" if graph else "cuda_queued" if queued else "cuda_events"
    return Timing(timer, samples, warmup, l2_flush, before, after, events_in_graph=in_graph)


@functools.cache
def _events_in_graph() -> bool:
    """Whether this torch records CUDA events as nodes of a captured graph (``external=True``); asked once."""
    try:
        torch.cuda.Event(enable_timing=True, external=True)
    except TypeError:
        return False
    return True


def _timed_stream(run: Callable[[], object], n: int, flush, queued: bool) -> list[float]:
    """n repetitions launched from the host, each between CUDA events on the stream (ms each)."""
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
    return [a.elapsed_time(b) for a, b in zip(starts, ends)]


def _graph_of(fn: Callable[[], object], n: int, flush) -> tuple[torch.cuda.CUDAGraph, torch.cuda.Event, list]:
    """fn captured n times in one CUDA graph, [flush, event, fn, event] × n after a first event: (the graph,
    its first event, the n samples' event pairs)."""
    start = torch.cuda.Event(enable_timing=True, external=True)
    events = [(torch.cuda.Event(enable_timing=True, external=True), torch.cuda.Event(enable_timing=True, external=True))
              for _ in range(n)]
    g = torch.cuda.CUDAGraph()
    with capturing(g):
        start.record()
        for a, b in events:
            if flush is not None:
                _evict_l2(flush)
            a.record()
            fn()
            b.record()
    return g, start, events


def _timed_graph(fn: Callable[[], object], n: int, flush, warmup_ms: float,
                 iter_ms: float | None) -> tuple[list[float], int]:
    """n repetitions of fn as replays of one CUDA graph, [flush, event, fn, event] × m, the events recorded by
    the graph itself: (the samples in ms, warm-up calls made). m is at most GRAPH_CHUNK: the graph is replayed
    ceil(n / GRAPH_CHUNK) times, the samples read after each replay (its events are the next one's), the first n
    kept (a last replay's spare samples, by position, never by value). The warm-up is a graph of its own, replayed
    until its replays have taken ``warmup_ms`` of GPU time (none for 0), then the timed graph's replays. The
    warm-up graph holds as many calls as ``warmup_ms`` needs by the sizing iteration's ``iter_ms``, one spare, or
    where that is a whole timed graph or more the timed graph serves (docs/decisions.md: a whole replay of 200 made
    any warm-up 200 calls). Its GPU time comes from its own events, so a host slower than the GPU cannot cut it
    short. ``bench`` calls it after ``_capture(fn)``, which has warmed the process's graph replays
    (``_warm_graph_replays``).

    With each repetition a replay launched from the host instead, a host that falls behind the GPU
    lands inside the samples: H100, the decode step at B=1, 64k (25 µs of GPU work, 200 samples), a
    ``suite decode`` run's first bench took 78 of its first 104 samples at 39-708 µs. In one graph the
    samples are GPU time alone, and they leave out the graph's launch from the host, which each
    replayed sample held (H100, 200 samples, three rounds: decode step B=1 64k 25.4 vs 25.9-26.1 µs,
    B=16 100.7-100.8 vs 101.3-101.7; five empty chained launches 7.8 vs 8.7). Between two replays the host
    syncs and launches the next, outside every sample: each sample still starts after its flush."""
    _side_stream_calls(fn, 1)       # fn ran (graph-replayed) just before: one call to satisfy the capture
    replays = math.ceil(n / GRAPH_CHUNK)
    g, g_start, events = _graph_of(fn, math.ceil(n / replays), flush)
    warmed = 0
    if warmup_ms > 0:
        k = math.ceil(warmup_ms / max(iter_ms or 0.0, 1e-3)) + 1
        w, w_start, w_events = (g, g_start, events) if k >= len(events) else _graph_of(fn, k, flush)
        w.replay()
        torch.cuda.synchronize()
        whole = w_start.elapsed_time(w_events[-1][1])         # GPU time of one replay
        more = max(1, min(math.ceil(warmup_ms / max(whole, 1e-3)), math.ceil(MAX_WARMUP / len(w_events))))
        for _ in range(more - 1):
            w.replay()
        warmed = more * len(w_events)
    samples: list[float] = []
    for _ in range(replays):
        g.replay()
        torch.cuda.synchronize()
        samples += [a.elapsed_time(b) for a, b in events]
    return samples[:n], warmed


# calls queued behind one GPU sleep when ``loop`` measures the host's cost: a decode call queues a few
# operations (a graph launch, copies), and a few hundred of them fill the launch queue, where the host would
# wait for room (docs/decisions.md)
HOST_CHUNK = 16


def loop_calls(calls: int, device: str = "cuda", warmup: int = 3) -> int:
    """How many times ``loop`` calls its ``fn`` for ``calls`` timed calls: the warm-up and the loop, and on a
    GPU the host's pass too (the loop's calls again, and one untimed lead call per ``HOST_CHUNK``)."""
    if device != "cuda":
        return warmup + calls
    return warmup + 2 * calls + math.ceil(calls / HOST_CHUNK)


@dataclass
class LoopTiming:
    """A call made token after token, as user code makes it (``loop``): ms per call."""
    timer: str                       # "cuda_events" | "cpu"
    calls: int
    wall_ms: float                   # host clock over the whole loop (one sync at its end) / calls
    events_ms: float | None          # CUDA events around the whole loop / calls (GPU)
    host_ms: float | None            # the host's own cost: the calls queued behind a GPU sleep (GPU)

    def summary(self) -> dict:
        return asdict(self)

    def implausible(self) -> str | None:
        """Why these figures cannot be right, or None: the host's own cost of a call cannot exceed the
        wall time of a call back to back (beyond noise), where the host issued every call too."""
        if self.host_ms is not None and self.host_ms > 1.15 * self.wall_ms:
            return (f"the host's cost a call ({self.host_ms:.4f} ms) exceeds the loop's wall time a call "
                    f"({self.wall_ms:.4f} ms): the host waited on the GPU while it was measured")
        return None


def loop(fn: Callable[[int], object], calls: int, *, device: str = "cuda", warmup: int = 3,
         warmed: Callable[[], None] | None = None) -> LoopTiming:
    """Time ``fn(i)`` for i = 0 .. calls−1 back to back, with nothing between the calls: what a decode
    loop in user code gets per token. The wall clock over the loop (synchronised once, at its end)
    and, on a GPU, CUDA events around it; then the host's own cost per call: the same calls made
    while the GPU sleeps, so the host never waits on it (``fn`` must not sync), ``HOST_CHUNK`` calls
    behind each sleep: more would fill the GPU's launch queue, and the host would wait for room in it.
    Each chunk starts with an untimed call: in a loop back to back every call but the first follows
    another, and the first call after the host has waited (on the GPU, or asleep) costs it 2-3 times as
    much (docs/decisions.md). ``fn`` is called ``loop_calls`` times in all.
    Where wall ≈ host, the host is the limit; where wall ≈ the GPU work of one call, the GPU is.
    ``warmup`` calls first (i = 0 ..), the loop's calls after them; no L2 flush: a loop's calls
    follow one another. ``warmed``: called once the first warm-up call's work has finished (it compiles
    and captures what the calls need); a process made ready ahead of its turn on the GPU waits there
    (``bench.decode.FreshLoop``), and the other warm-up calls then run right before the timed ones."""
    for i in range(warmup):
        fn(i)
        if i == 0 and warmed is not None:
            if device == "cuda":
                torch.cuda.synchronize()
            warmed()
    if warmup == 0 and warmed is not None:
        warmed()
    if device != "cuda":
        t0 = time.perf_counter()
        for i in range(warmup, warmup + calls):
            fn(i)
        return LoopTiming("cpu", calls, (time.perf_counter() - t0) * 1e3 / calls, None, None)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for i in range(warmup, warmup + calls):
        fn(i)
    b.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / calls
    events = a.elapsed_time(b) / calls
    # the host's cost: per chunk, the GPU held asleep for longer than the host takes to issue the chunk's
    # calls and its lead call (four times their wall time above, plus 0.2 ms); the lead call, then the
    # chunk's calls timed on the host alone
    spent = 0.0
    for start in range(warmup, warmup + calls, HOST_CHUNK):
        chunk = range(start, min(start + HOST_CHUNK, warmup + calls))
        torch.cuda._sleep(int((4 * wall * (len(chunk) + 1) + 0.2) * _sleep_cycles_per_ms()))
        fn(start)
        t0 = time.perf_counter()
        for i in chunk:
            fn(i)
        spent += time.perf_counter() - t0
        torch.cuda.synchronize()
    host = spent * 1e3 / calls
    return LoopTiming("cuda_events", calls, wall, events, host)
