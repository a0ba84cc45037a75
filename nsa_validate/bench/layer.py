"""The whole NSA layer against a dense attention layer: prefill forward, forward+backward, peak memory,
and where the time goes. Plain functions returning typed rows; usable from a Python prompt:

    >>> from nsa_validate.bench import layer
    >>> from nsa_core.routing import RoutingPolicy
    >>> shape = layer.Shape(B=1, S=16384, d_model=2048, G=4, h=16, d_k=128, d_v=128)
    >>> row = layer.measure(shape, RoutingPolicy(sel_triton_min_len=1024), device="cuda")

What is timed is what people run: ``NSAAttention`` (q/k/v projections, φ, block scoring, the three
branches as the routing policy picks them, gate, mix, output projection) on x [B, S, D]; forward
under ``no_grad``, and forward+backward (the gradients of x and every parameter). The dense layer
does the same projections with one causal attention over all tokens: SDPA on its fused backends
(never the math path) and flash-attn when installed. Where a kernel cannot take d_v ≠ d_k, v is
zero-padded to d_k (that reads more bytes than the dense layer needs), and a second, same-bytes
dense layer with d = (d_k + d_v)/2 for q, k and v is measured too; both are labelled.

Every timing is a ``timing.bench`` (CUDA events; L2 flushed), which is what a caller waits for:
where Python launches slower than the GPU runs, the events measure the host. So each is also timed
queued (``timing.bench(queued=True)``: the GPU's work alone) where the host could be the limit, and
one whose timed figure exceeds that by more than HOST_BOUND is host-bound. Host time (the Python
call until it returns, before any synchronisation, on a warm call: compilation is not host time) is
recorded beside them. A measurement that runs out of memory is recorded as ``oom`` and the sweep
goes on.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels  # noqa: F401  (registers the Triton and FA-2 backends the routing picks)
from nsa_core import NSAAttention, routing
from nsa_core.config import PAPER, NSAConfig, tiny
from nsa_core.routing import BRANCHES, RoutingPolicy
from nsa_validate.measure import timing
from nsa_validate.measure.tolerance import DTYPES

HOST_BOUND = 1.5            # timed / queued (GPU work alone) above which a measurement is labelled host-bound
QUEUED_REPS = 5             # repetitions of the queued timing
SLOW_REPS = 3               # repetitions of a call that takes more than a third of the budget (``_time``)


@dataclass(frozen=True)
class Shape:
    """One layer and input: x [B, S, d_model]; G KV heads, h query heads per group."""
    B: int
    S: int
    d_model: int
    G: int
    h: int
    d_k: int
    d_v: int
    dtype: str = "bf16"
    blocks: str = "paper"       # "paper": l=32, d=16, l'=64, n=16, w=512; "tiny": l=8, d=4, l'=16, n=4, w=64

    def config(self) -> NSAConfig:
        """The paper's block geometry (``PAPER``) or the small one the decode suite's CPU runs use."""
        dims = dict(d_model=self.d_model, n_kv_heads=self.G, heads_per_group=self.h, d_k=self.d_k, d_v=self.d_v)
        if self.blocks == "paper":
            return dataclasses.replace(PAPER, **dims)
        return tiny(block_size=16, n_selected=4, window=64, **dims)

    @property
    def label(self) -> str:
        return f"B{self.B}-S{self.S}-dk{self.d_k}-dv{self.d_v}"


@dataclass
class Measured:
    """One timed function: its time (what a caller waits for: GPU events, or the CPU's clock), the
    GPU's work alone, host time, peak memory; or ``oom``."""
    ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    host_ms: float | None = None
    peak_gib: float | None = None
    timer: str = ""
    oom: str = ""                   # "" or what ran out of memory, with the size it tried
    gpu_ms: float | None = None     # the GPU's work alone (queued repetitions); None: the host cannot be the limit
    timing: timing.Timing | None = field(default=None, repr=False)

    @property
    def host_ratio(self) -> float | None:
        """Timed figure / the GPU's work alone: 1 when the GPU never waits on the host."""
        return None if self.ms is None or not self.gpu_ms else self.ms / self.gpu_ms

    @property
    def host_bound(self) -> bool:
        return self.host_ratio is not None and self.host_ratio > HOST_BOUND


@dataclass
class Row:
    """One (shape, routing): the NSA layer, the dense layers, the stage breakdown."""
    shape: Shape
    routes: dict[str, str]                                   # branch -> backend that ran (dispatch log)
    nsa_fwd: Measured
    nsa_fwdbwd: Measured
    dense_fwd: dict[str, Measured]                           # dense layer name -> forward
    dense_fwdbwd: dict[str, Measured]
    dense: dict[str, Dense]                                  # dense layer name -> what it is
    stages_fwd: dict[str, Measured] = field(default_factory=dict)
    stages_bwd: dict[str, Measured] = field(default_factory=dict)
    log: routing.DispatchLog | None = field(default=None, repr=False)   # what the untimed forward ran
    dense_beside_compiles: bool = False      # the dense layers timed while a run compiled on the CPU (``measure``)

    def best_dense(self, phase: str) -> tuple[str, Measured] | None:
        """The fastest dense layer that reads no more than the NSA layer's K/V bytes per token
        (padded layers are not a fair baseline once a same-bytes one exists)."""
        got = {k: m for k, m in (self.dense_fwd if phase == "fwd" else self.dense_fwdbwd).items()
               if m.ms is not None and not self.dense[k].pad_v}
        return min(got.items(), key=lambda kv: kv[1].ms) if got else None

    def speedup(self, phase: str) -> float | None:
        """dense / NSA for ``phase`` ("fwd" or "fwdbwd"): > 1 means the NSA layer is faster."""
        nsa = self.nsa_fwd if phase == "fwd" else self.nsa_fwdbwd
        best = self.best_dense(phase)
        return best[1].ms / nsa.ms if best and nsa.ms else None

    def to_dict(self) -> dict:
        """JSON-able (a case record's ``metrics["row"]``), without the samples and the dispatch log."""
        m = lambda x: {k: v for k, v in dataclasses.asdict(x).items() if k != "timing"}  # noqa: E731
        return {"shape": dataclasses.asdict(self.shape), "routes": self.routes,
                "nsa_fwd": m(self.nsa_fwd), "nsa_fwdbwd": m(self.nsa_fwdbwd),
                "dense_fwd": {k: m(v) for k, v in self.dense_fwd.items()},
                "dense_fwdbwd": {k: m(v) for k, v in self.dense_fwdbwd.items()},
                "dense": {k: dataclasses.asdict(v) for k, v in self.dense.items()},
                "stages_fwd": {k: m(v) for k, v in self.stages_fwd.items()},
                "stages_bwd": {k: m(v) for k, v in self.stages_bwd.items()},
                "dense_beside_compiles": self.dense_beside_compiles}

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        ms = lambda x: {k: Measured(**v) for k, v in x.items()}  # noqa: E731
        return cls(Shape(**d["shape"]), d["routes"], Measured(**d["nsa_fwd"]), Measured(**d["nsa_fwdbwd"]),
                   ms(d["dense_fwd"]), ms(d["dense_fwdbwd"]), {k: Dense(**v) for k, v in d["dense"].items()},
                   ms(d["stages_fwd"]), ms(d["stages_bwd"]),
                   dense_beside_compiles=d.get("dense_beside_compiles", False))


# -- the dense layer --------------------------------------------------------------------------
class DenseLayer(nn.Module):
    """The dense counterpart of an NSA layer: the same q/k/v/o projections (H·d_k, G·d_k, G·d_v,
    H·d_v) and one causal attention over every token. ``backend``: "sdpa" or "flash_attn".
    ``pad_v``: zero-pad v to d_k for kernels that need one head dim (output sliced back)."""

    def __init__(self, d_model: int, G: int, h: int, d_k: int, d_v: int, backend: str, pad_v: bool = False) -> None:
        super().__init__()
        self.G, self.h, self.d_k, self.d_v, self.backend, self.pad_v = G, h, d_k, d_v, backend, pad_v
        H = G * h
        self.q_proj = nn.Linear(d_model, H * d_k, bias=False)
        self.k_proj = nn.Linear(d_model, G * d_k, bias=False)
        self.v_proj = nn.Linear(d_model, G * d_v, bias=False)
        self.o_proj = nn.Linear(H * d_v, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        H = self.G * self.h
        q = self.q_proj(x).view(B, S, H, self.d_k)
        k = self.k_proj(x).view(B, S, self.G, self.d_k)
        v = self.v_proj(x).view(B, S, self.G, self.d_v)
        if self.pad_v:
            v = F.pad(v, (0, self.d_k - self.d_v))
        if self.backend == "flash_attn":
            from flash_attn import flash_attn_func
            o = flash_attn_func(q, k, v, causal=True)                       # GQA native
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
            with sdpa_kernel(fused if x.is_cuda else [SDPBackend.MATH]):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True, enable_gqa=True).transpose(1, 2)
        return self.o_proj(o[..., :self.d_v].reshape(B, S, H * self.d_v))


@dataclass(frozen=True)
class Dense:
    """One dense layer to compare with: its backend and head dims, and what it is (``label``)."""
    name: str
    label: str
    backend: str
    d_k: int
    d_v: int
    pad_v: bool = False

    def make(self, shape: Shape) -> DenseLayer:
        return DenseLayer(shape.d_model, shape.G, shape.h, self.d_k, self.d_v, self.backend, self.pad_v)

    @property
    def attention_dims(self) -> tuple[int, int]:
        """(d_k, d_v) the attention kernel works on (padded v counts as d_k)."""
        return (self.d_k, self.d_k if self.pad_v else self.d_v)


def dense_layers(shape: Shape, device: str) -> dict[str, Dense]:
    """The dense layers to compare with: each backend at the layer's own dims; where it needs
    d_v = d_k, padded v plus a same-bytes layer."""
    out = {}
    from kernels import fa2
    dtype = DTYPES[shape.dtype]
    backends = ["sdpa"] + (["flash_attn"] if fa2.unavailable("flash_attn", device=device, dtype=dtype) is None else [])
    same = 8 * math.ceil((shape.d_k + shape.d_v) / 16)          # (d_k + d_v)/2, a multiple of 8
    for be in backends:
        if shape.d_k == shape.d_v or (be == "sdpa" and _sdpa_takes_dv(shape, device)):
            out[be] = Dense(be, f"{be}, d_k={shape.d_k}, d_v={shape.d_v}", be, shape.d_k, shape.d_v)
        else:
            out[f"{be}_padded"] = Dense(f"{be}_padded", f"{be}, v zero-padded to {shape.d_k} (reads more than "
                                        "the dense layer needs)", be, shape.d_k, shape.d_v, pad_v=True)
            out[f"{be}_samebytes"] = Dense(f"{be}_samebytes", f"{be}, same bytes: d_k=d_v={same} (K+V bytes per "
                                           f"token as {shape.d_k}+{shape.d_v})", be, same, same)
    return out


def _sdpa_takes_dv(shape: Shape, device: str) -> bool:
    """Does a fused SDPA backend take d_v ≠ d_k here? Tried on a tiny input."""
    if device != "cuda":
        return True                                                    # the math path takes anything
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.zeros(1, shape.G * shape.h, 8, shape.d_k, device=device, dtype=torch.bfloat16)
    k = torch.zeros(1, shape.G, 8, shape.d_k, device=device, dtype=torch.bfloat16)
    v = torch.zeros(1, shape.G, 8, shape.d_v, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return True
    except RuntimeError:
        return False


# -- measuring ------------------------------------------------------------------------------
def _time(fn: Callable[[], object], device: str, budget_ms: float, warmed: bool = False) -> Measured:
    """timing.bench plus host time and peak memory of one call; ``oom`` instead of raising.

    First an untimed call (Triton compiles, SDPA picks its kernel), then a call that measures the
    host time. ``warmed``: the same kernels have run at this shape in this process (``warm``), so
    the first call measures the host time, and only a call that took less than a third of the budget
    is made again for it; a slower one keeps that first figure, which includes the allocator's
    requests after ``warm`` emptied its cache (an upper bound of a warm call's: the dense layer's
    forward+backward at 64k, 0.47 s a call on an H200, one call fewer). A call that takes more than a
    third of the budget is timed three times, right after the call that measured its host time (its
    warm-up); the rest as many times as fit in the budget. The
    queued timing (the GPU's work alone) is made only where the host could be the limit: a call
    whose host time is under (HOST_BOUND − 1)/HOST_BOUND of its timed figure (a third) cannot be
    host-bound, and its ``gpu_ms`` stays None (the dense layer's forward+backward at 64k: 0.47 s a
    call, four calls fewer to wait for)."""
    if device != "cuda":            # one call: a CPU timing is noise, and the interpreter is slow
        tm = timing.bench(fn, device=device, warmup=0, reps=1)
        return Measured(tm.median_ms, tm.p20_ms, tm.p80_ms, tm.median_ms, None, tm.timer, timing=tm)
    try:
        def host_call() -> tuple[float, float]:
            """One call: (its host time, its time until the GPU is done), ms."""
            t0 = time.perf_counter()
            fn()
            host = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            return host, (time.perf_counter() - t0) * 1e3

        if not warmed:
            fn()                    # warmup: Triton compiles, SDPA picks its kernel; not timed
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        host, whole = host_call()   # its host time and peak memory
        if warmed and whole <= budget_ms / SLOW_REPS:
            host, whole = host_call()       # a quick call's host time, from a warm call
        peak = torch.cuda.max_memory_allocated() / 2**30
        if whole > budget_ms / SLOW_REPS:     # slow: three samples it is
            tm = timing.bench(fn, device=device, warmup=0, reps=SLOW_REPS, telemetry=False)
        else:
            tm = timing.bench(fn, device=device, warmup=1, budget_ms=budget_ms, min_reps=SLOW_REPS, max_reps=50,
                              telemetry=False)
        gpu = None
        # timed <= GPU + host, so with host < timed / 3 the GPU's work is over 2/3 of timed: not host-bound
        if host * HOST_BOUND / (HOST_BOUND - 1) >= tm.median_ms:
            gpu = timing.bench(fn, device=device, warmup=0, reps=min(QUEUED_REPS, len(tm.samples_ms)), queued=True,
                               telemetry=False).median_ms
        return Measured(tm.median_ms, tm.p20_ms, tm.p80_ms, host, peak, tm.timer, gpu_ms=gpu, timing=tm)
    except torch.cuda.OutOfMemoryError as e:
        return Measured(oom=f"out of memory: {str(e).splitlines()[0][:160]}")
    finally:
        torch.cuda.empty_cache()


def _fwd_bwd(m: nn.Module, x: torch.Tensor, dout: torch.Tensor) -> Callable[[], object]:
    """Forward then the gradients of x and every parameter (nothing accumulates between calls)."""
    xs = x.detach().requires_grad_(True)
    inputs = [xs, *[p for p in m.parameters() if p.requires_grad]]
    return lambda: torch.autograd.grad(m(xs), inputs, dout)


def build(shape: Shape, policy: RoutingPolicy, device: str, seed: int = 0) -> tuple[NSAAttention, torch.Tensor]:
    """The NSA layer (weights in the shape's dtype) and an input x [B, S, D]."""
    dtype = DTYPES[shape.dtype]
    torch.manual_seed(seed)
    with torch.device(device):      # initialised where it runs (on an H200 pod's CPU: 0.26-0.38 s a build)
        m = NSAAttention(shape.config(), policy).to(dtype=dtype)
    x = torch.randn(shape.B, shape.S, shape.d_model, device=device, dtype=dtype)
    return m, x


def warm(shape: Shape, policy: RoutingPolicy, device: str) -> frozenset[str]:
    """Compile, untimed, what ``measure(shape)`` runs: one forward and one forward+backward at the
    shortest power-of-two length (from 4096) that ``policy`` routes as it routes ``shape.S``. Triton
    specialises a kernel on dtypes, head dims and launch settings, not on the length, so the timed
    call finds every kernel compiled; a suite runs this beside other suites' parity cases and only
    the timing alone on the GPU. Then, where at least half the GPU's memory is free, each dense layer's
    forward and forward+backward once at the shape itself: a library kernel's first call on a machine
    loads it (H200, a fresh pod's first ``oneshot --level quick``: SDPA's at 64k took 0.8 s and 1.3 s
    longer inside the timed case than on a second run; the calls take ~9 GiB there). Nothing to
    compile on a CPU (the interpreter). Returns the dense layers so run (``measure``'s ``warmed``)."""
    if device != "cuda":
        return frozenset()
    query = dict(cfg=shape.config(), device=torch.device(device), dtype=DTYPES[shape.dtype])
    routed = lambda S: {br: d.backend for br, d in routing.prefill_routes(policy, S, **query).items()}  # noqa: E731
    want, S = routed(shape.S), 4096
    while S < shape.S and routed(S) != want:
        S *= 2
    m, x = build(dataclasses.replace(shape, S=min(S, shape.S)), policy, device)
    with torch.no_grad():
        m(x)
    _fwd_bwd(m, x, torch.randn_like(x))()
    del m, x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    if free < total / 2:      # beside other suites' cases: never where it could take memory a parity case needs
        return frozenset()
    x = torch.randn(shape.B, shape.S, shape.d_model, device=device, dtype=DTYPES[shape.dtype])
    warmed = set()
    for name, spec in dense_layers(shape, device).items():
        try:
            with torch.device(device):
                d = spec.make(shape).to(dtype=x.dtype)
            with torch.no_grad():
                d(x)
            _fwd_bwd(d, x, torch.randn_like(x))()
            del d
            torch.cuda.synchronize()
            warmed.add(name)
        except torch.cuda.OutOfMemoryError:     # the timed case says whether it fits alone (``oom``)
            pass
        finally:
            torch.cuda.empty_cache()
    return frozenset(warmed)


def measure(shape: Shape, policy: RoutingPolicy, device: str, *, budget_ms: float = 1000.0,
            stages: bool = True, capture=routing.capture, warmed: frozenset[str] = frozenset(),
            quiet: Callable[[], bool] = lambda: False) -> Row:
    """Time the NSA layer and its dense counterparts on one shape (see the module docstring).
    ``warmed``: the dense layers ``warm`` ran at this shape in this process (their timing makes no
    untimed call first: ``_time``).
    ``capture``: the context manager (yielding a ``routing.DispatchLog``) one forward runs in first
    (untimed on a GPU; on a CPU the timed forward), e.g. a suite's recorder that also watches the
    GPU's kernels; ``Row.log`` keeps it.
    ``quiet``: called between the dense layers' timings and the NSA layer's, it waits for a busy CPU to
    quieten (a run's compiles); True where the CPU was busy during the dense layers' timings
    (``Row.dense_beside_compiles``). The dense layers go first: GPU-bound (at 64k 120-730 ms of GPU work a
    call for a few ms of Python), their timings do not move with the CPU's load; the NSA layer's host time
    is a figure of the row, and a busy CPU would inflate it."""
    m, x = build(shape, policy, device)
    dout = torch.randn_like(x)
    on_gpu = device == "cuda"
    dense_fwd, dense_fwdbwd = {}, {}
    dense = dense_layers(shape, device)
    for name, spec in dense.items():
        torch.manual_seed(1)
        with torch.device(device):
            d = spec.make(shape).to(dtype=x.dtype)
        with torch.no_grad():
            dense_fwd[name] = _time(lambda: d(x), device, budget_ms, warmed=name in warmed)
        dense_fwdbwd[name] = _time(_fwd_bwd(d, x, dout), device, budget_ms, warmed=name in warmed)
        del d
    beside = quiet()
    with torch.no_grad(), capture() as log:
        if on_gpu:
            m(x)
        else:               # a CPU times one call (``_time``): the logged forward is that call, not one more
            fwd = _time(lambda: m(x), device, budget_ms)
    routes = {br: "/".join(log.backends("prefill").get(br, [])) for br in routing.PREFILL_STAGES}
    if on_gpu:
        with torch.no_grad():
            fwd = _time(lambda: m(x), device, budget_ms)
    fwdbwd = _time(_fwd_bwd(m, x, dout), device, budget_ms)
    row = Row(shape, routes, fwd, fwdbwd, dense_fwd, dense_fwdbwd, dense, log=log, dense_beside_compiles=beside)
    if stages and fwd.ms is not None:
        row.stages_fwd, row.stages_bwd = breakdown(m, x, device, budget_ms)
    return row


ONE_OP = "branches + mix (one op)"
# stages the one op runs inside it (``NSAAttention.one_op``): in a row that has it, each is timed
# forward alone (the same launches) and left out of the sums; its backward is the one op's
PARTS_OF_ONE_OP = ("cmp attention", "scoring + top-n", "sel attention", "win attention")
STAGES = ("projections", "compression", "cmp attention", "scoring + top-n", "sel attention",
          "win attention", "gate + mix", "gate + out proj", ONE_OP)


def summed(stages: dict[str, Measured]) -> list[Measured]:
    """The stages of a breakdown that add up to the layer: all but the one op's parts where the
    layer ran the one op."""
    return [m for k, m in stages.items() if not (ONE_OP in stages and k in PARTS_OF_ONE_OP)]


def breakdown(m: NSAAttention, x: torch.Tensor, device: str, budget_ms: float) -> tuple[dict, dict]:
    """Each stage of the layer timed alone on the inputs the layer gives it, forward and (where it
    has a gradient) backward: {stage: Measured}. The stages' sum next to the whole layer's time
    shows what the stage boundaries cost (launches, host work, synchronisations). Where the layer
    runs its branches and mix as one op (every stage on Triton), that op is a stage, forward and
    backward, beside the gate MLP with the output projection; the branches are still timed forward
    alone (``PARTS_OF_ONE_OP``), since their backward passes apart are not what the layer runs."""
    S = x.shape[1]
    routes = m.routes(S, x.device, x.dtype)
    one = m.one_op(routes)
    timed = {}              # on a CPU: stages whose forward timing is the call that made their output

    def output_of(stage: str, fn: Callable[[], object]):
        """fn(), the stage's forward; on a CPU, where a timing is one call (``_time``), timed as that stage's."""
        if device == "cuda":
            return fn()
        out = []
        timed[stage] = _time(lambda: out.append(fn()), device, budget_ms)
        return out[-1]
    with torch.no_grad():
        q, k, v = m.project(x)
        k_cmp, v_cmp = m.cmp_k(k), m.cmp_v(v)
        o_cmp, lse = output_of("cmp attention", lambda: m.run_branch("cmp", routes, with_lse=True, q=q, k_cmp=k_cmp,
                                                                     v_cmp=v_cmp))
        idx = output_of("scoring + top-n", lambda: m.select_from(q, k_cmp, routes, lse=lse))
    fns = {"projections": (m.project, (x,)),
           "compression": (lambda k, v: (m.cmp_k(k), m.cmp_v(v)), (k, v)),
           "cmp attention": (lambda q, kc, vc: m.run_branch("cmp", routes, q=q, k_cmp=kc, v_cmp=vc), (q, k_cmp, v_cmp)),
           # given the compressed branch's lse when it has one, as the layer does
           "scoring + top-n": (lambda q, kc: m.select_from(q, kc, routes, lse=lse), (q, k_cmp)),
           "sel attention": (lambda q, k, v: m.run_branch("sel", routes, q=q, k=k, v=v, idx=idx), (q, k, v)),
           "win attention": (lambda q, k, v: m.run_branch("win", routes, q=q, k=k, v=v), (q, k, v))}
    if one is None:
        with torch.no_grad():
            o_sel = output_of("sel attention", lambda: fns["sel attention"][0](q, k, v))
            o_win = output_of("win attention", lambda: fns["win attention"][0](q, k, v))
        fns["gate + mix"] = (lambda x, *o: m.mix(m.gates(x), dict(zip(BRANCHES, o)), routes), (x, o_cmp, o_sel, o_win))
    else:
        def one_fn(g, q, k, v, kc, vc):
            return one(cfg=m.cfg, g=g, q=q, k=k, v=v, k_cmp=kc, v_cmp=vc)
        with torch.no_grad():
            g = m.gates(x)
            o = output_of(ONE_OP, lambda: one_fn(g, q, k, v, k_cmp, v_cmp)).reshape(*x.shape[:2], -1)
        fns["gate + out proj"] = (lambda x, o: (m.gates(x), m.o_proj(o)), (x, o))
        fns[ONE_OP] = (one_fn, (g, q, k, v, k_cmp, v_cmp))
    fwd, bwd = {}, {}
    for name, (fn, args) in fns.items():
        if name in timed:
            fwd[name] = timed[name]
        else:
            with torch.no_grad():
                fwd[name] = _time(lambda: fn(*args), device, budget_ms)
        if name == "scoring + top-n" or (one is not None and name in PARTS_OF_ONE_OP):
            continue                     # discrete (no gradient flows through it), or inside the one op
        leaves = [a.detach().requires_grad_(True) for a in args]
        params = [p for p in m.parameters() if p.requires_grad]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        grads = [torch.randn_like(o) for o in outs]
        wrt = leaves + params
        bwd[name] = _time(lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True),
                          device, budget_ms)
        del out, outs, grads
    return fwd, bwd

