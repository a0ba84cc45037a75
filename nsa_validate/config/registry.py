"""The suites the CLI drives, one entry each: its file under ``suites/`` (a pytest module, run
in its own process), what it proves, the type of its section in a profile (``suites.<name>``),
and the time it may take unless the profile says otherwise.

Adding a suite: its file, an entry here (with its config type), and its sizes in
``profiles/base/gpu.yaml``. Nothing here imports a suite: the harness reaches them as files.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from nsa_core.routing import DECODE_BACKENDS, FA2_BACKENDS, RoutingPolicy
from nsa_validate.errors import UsageError
from nsa_validate.paths import REPO_ROOT

DTYPE_NAMES = ("fp32", "bf16", "fp16")


# -- range checks a config type's ``check(where)`` uses: bad input is one UsageError naming the field
def bad(field_: str, allowed: str, got) -> None:
    raise UsageError(f"field '{field_}' must be {allowed}, got {got!r}")


def positive(field_: str, v) -> None:
    if v is not None and not (v > 0):
        bad(field_, "> 0", v)


def positive_list(field_: str, vs) -> None:
    for i, v in enumerate(vs):
        positive(f"{field_}[{i}]", v)


def dtypes(field_: str, vs) -> None:
    for i, v in enumerate(vs):
        if v not in DTYPE_NAMES:
            bad(f"{field_}[{i}]", f"one of {', '.join(DTYPE_NAMES)}", v)


def pairs(field_: str, vs) -> None:
    for i, v in enumerate(vs):
        if len(v) != 2 or not all(x > 0 for x in v):
            bad(f"{field_}[{i}]", "a pair of numbers > 0", v)


def one_of(field_: str, v, allowed) -> None:
    if v not in allowed:
        bad(field_, "one of " + ", ".join(map(str, allowed)), v)


def check_routing(where: str, r: RoutingPolicy) -> None:
    for name, v in vars(r).items():
        if "_min_len" in name and v is not None and v < 0:
            bad(f"{where}.{name}", "a length >= 0 or null", v)
    one_of(f"{where}.fa2_backend", r.fa2_backend, FA2_BACKENDS)
    one_of(f"{where}.decode_backend", r.decode_backend, DECODE_BACKENDS)


@dataclass
class SanityCfg:
    batch: int = 2
    seq_len: int = 100
    decode_from: int = 60          # prefill length before the decode steps
    dtypes: list[str] = field(default_factory=lambda: ["fp32"])

    def check(self, w: str) -> None:
        positive(f"{w}.batch", self.batch)
        positive(f"{w}.seq_len", self.seq_len)
        if not 0 < self.decode_from < self.seq_len:
            bad(f"{w}.decode_from", f"between 1 and seq_len - 1 = {self.seq_len - 1}", self.decode_from)
        dtypes(f"{w}.dtypes", self.dtypes)


@dataclass
class CountersCfg:
    decode_steps: int = 40         # steps measured after each prefill length
    paper_contexts: list[int] = field(default_factory=lambda: [8192, 16384, 32768, 65536])
    backends: list[str] = field(default_factory=lambda: ["torch"])   # decode paths whose reads are checked
    # layers ("tiny", "paper") whose reads are also measured by effect (suites/read_effect.py)
    effect_layers: list[str] = field(default_factory=lambda: ["tiny", "paper"])

    def check(self, w: str) -> None:
        positive(f"{w}.decode_steps", self.decode_steps)
        positive_list(f"{w}.paper_contexts", self.paper_contexts)
        for i, b in enumerate(self.backends):
            one_of(f"{w}.backends[{i}]", b, DECODE_BACKENDS)
        for i, x in enumerate(self.effect_layers):
            one_of(f"{w}.effect_layers[{i}]", x, ("tiny", "paper"))


@dataclass
class TritonCfg:
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "fp16"])
    heads_per_group: list[int] = field(default_factory=lambda: [1, 2, 16])
    head_dims: list[list[int]] = field(default_factory=lambda: [[32, 16]])   # [d_k, d_v]
    seq_lens: list[int] = field(default_factory=lambda: [77])    # kernel parity, every row checked
    kv_heads: int = 2                                             # G of the kernel-level cases
    block_size: int = 16                                          # l' of the kernel-level cases
    n_selected: int = 4                                           # n of the kernel-level cases
    varlen_lens: list[int] = field(default_factory=lambda: [0, 1, 17, 40])   # one packed batch
    long_seq_lens: list[int] = field(default_factory=list)      # parity on sampled rows (GPU)
    # dtypes of the whole-module fwd+bwd case; None: fp32 and ``dtypes``. fp32 holds the layer to
    # the fp32 floor, but its IEEE-precision kernels take ~2.5 min to compile on an H100
    module_dtypes: list[str] | None = None
    prefill_paper_len: int | None = None                          # module prefill, paper config
    bench_seq_lens: list[int] = field(default_factory=list)
    route_seq_lens: list[int] = field(default_factory=list)      # Triton vs torch per routed stage (GPU)
    margin: float = 1.2                                           # speedup a route needs at every longer length

    def check(self, w: str) -> None:
        dtypes(f"{w}.dtypes", self.dtypes)
        dtypes(f"{w}.module_dtypes", self.module_dtypes or [])
        pairs(f"{w}.head_dims", self.head_dims)
        for name in ("heads_per_group", "seq_lens", "long_seq_lens", "bench_seq_lens", "route_seq_lens"):
            positive_list(f"{w}.{name}", getattr(self, name))
        for name in ("kv_heads", "block_size", "n_selected", "prefill_paper_len", "margin"):
            positive(f"{w}.{name}", getattr(self, name))
        for i, v in enumerate(self.varlen_lens):
            if v < 0:
                bad(f"{w}.varlen_lens[{i}]", ">= 0", v)


@dataclass
class Fa2Cfg:
    dtypes: list[str] = field(default_factory=lambda: ["bf16", "fp16"])
    bench_seq_lens: list[int] = field(default_factory=list)
    margin: float = 1.2

    def check(self, w: str) -> None:
        dtypes(f"{w}.dtypes", self.dtypes)
        positive_list(f"{w}.bench_seq_lens", self.bench_seq_lens)
        positive(f"{w}.margin", self.margin)


@dataclass
class DecodeCfg:
    contexts: list[int] = field(default_factory=lambda: [256, 512])
    batches: list[int] = field(default_factory=lambda: [1])
    dtype: str = "fp32"
    paper_config: bool = False     # G=4, h=16, d_k=192, d_v=128 (else the tiny config)
    # parity contexts whose reads are also measured by effect (suites/read_effect.py): a cache
    # copy per perturbed token, so the shortest context
    effect_contexts: list[int] = field(default_factory=lambda: [256])
    bench_contexts: list[int] | None = None     # the bench's contexts; None: ``contexts``
    # the Nsight Compute DRAM-counter probe (``dram_reads``, ~10 s on an H100: a profiled process)
    dram_counters: bool = True
    # the ``wide_cache`` parity case: at the longest context, just enough rows that the raw K cache
    # holds more than 2^31 elements (64-bit row offsets; ~16 GB of device memory at 64k)
    wide_cache: bool = False
    # the bench's graph-replayed step is also timed on this many steps in all, each with its own workspace (where
    # its buffers land moved the same step by up to 3% on an H100); the report gives their medians' range
    workspaces: int = 3
    # the caches' capacity as a multiple of their context ("2x", "1.5x"; "1x": full caches): a generation loop
    # allocates its cache for the longest sequence it may reach. The bench also times the step on a full cache
    capacity: str = "2x"
    # the step on the cache with room to grow may be this much slower than on the full one, at most
    headroom_margin: float = 0.05
    # the parity cases also check the step planned for the cache's whole capacity (a caller's CUDA graph's) where
    # NSAAttention.decode's own plan is smaller; at the bench's batch sizes, whose bench compiles it, always
    capacity_parity: bool = True
    # the decode loop users write: NSAAttention.decode called token after token, this many tokens a loop
    loop_tokens: int = 256

    @property
    def capacity_factor(self) -> float:
        """``capacity`` as a number (2.0 for "2x")."""
        return float(self.capacity.removesuffix("x")) if self.capacity.endswith("x") else float("nan")

    def capacity_for(self, S: int) -> int:
        """The bench's cache capacity for a context of S tokens."""
        return max(S, round(S * self.capacity_factor))

    def check(self, w: str) -> None:
        for name in ("contexts", "batches", "effect_contexts"):
            positive_list(f"{w}.{name}", getattr(self, name))
        positive_list(f"{w}.bench_contexts", self.bench_contexts or [])
        positive(f"{w}.workspaces", self.workspaces)
        dtypes(f"{w}.dtype", [self.dtype])
        try:
            factor = self.capacity_factor
        except ValueError:
            factor = None
        if factor is None or not factor >= 1:
            bad(f"{w}.capacity", "a multiple of the context, at least 1x, written as 2x or 1.5x", self.capacity)
        if not 0 <= self.headroom_margin:
            bad(f"{w}.headroom_margin", "a fraction >= 0", self.headroom_margin)
        positive(f"{w}.loop_tokens", self.loop_tokens)


@dataclass
class LayerCfg:
    """The whole-layer prefill bench (suites/test_layer.py, nsa_validate/bench/layer.py)."""
    shapes: list[list[int]] = field(default_factory=lambda: [[1, 128], [2, 256]])   # [B, S]
    head_dims: list[list[int]] = field(default_factory=lambda: [[32, 16]])           # [d_k, d_v]
    d_model: int = 64
    kv_heads: int = 2                   # G
    heads_per_group: int = 2            # h
    blocks: str = "tiny"                # "paper" (l=32, d=16, l'=64, n=16, w=512) | "tiny"
    dtype: str = "fp32"
    budget_ms: float = 200.0            # per timing (at least 3 samples whatever the budget)
    stages: bool = True                 # the per-stage breakdown of every row
    needle_len: int | None = None       # the needle case's context (None: the longest shape's S)
    routing: RoutingPolicy | None = None  # the layer's routing; None: the profile's own

    def check(self, w: str) -> None:
        pairs(f"{w}.shapes", self.shapes)
        pairs(f"{w}.head_dims", self.head_dims)
        for name in ("d_model", "kv_heads", "heads_per_group", "budget_ms", "needle_len"):
            positive(f"{w}.{name}", getattr(self, name))
        one_of(f"{w}.blocks", self.blocks, ("paper", "tiny"))
        dtypes(f"{w}.dtype", [self.dtype])
        if self.routing is not None:
            check_routing(f"{w}.routing", self.routing)


@dataclass(frozen=True)
class Suite:
    name: str
    file: str                   # under suites/
    proves: str
    config: type                # its section of a profile (``profile.suites.<name>``): a dataclass
                                # whose ``check(where)`` raises UsageError on values it cannot run with
    timeout_s: int = 1800       # its limit where the profile sets none (suites.timeout_s)
    # after the suite's process: (its case records, its RunContext, a SuiteExtra) -> the tables,
    # plots and headline figures the report and the fleet report read (None: the cases' own)
    summarise: Callable | None = None

    @property
    def path(self):
        return REPO_ROOT / "suites" / self.file


# summaries import pandas and matplotlib only when a suite has finished (not at every CLI start)
def _decode_summary(cases, ctx, extra) -> None:
    from nsa_validate.report import decode_table
    decode_table.summarise(cases, ctx, extra)


def _layer_summary(cases, ctx, extra) -> None:
    from nsa_validate.report import layer_table
    layer_table.summarise(cases, ctx, extra)


SUITES = {s.name: s for s in [
    Suite("sanity", "test_sanity.py",
          "tiny prefill + decode end to end; each branch (gate forced one-hot) vs the oracle; finite outputs",
          SanityCfg),
    Suite("triton", "test_triton.py",
          "Triton selection, compressed attention and block scoring kernels vs the oracle; GQA, varlen, determinism, "
          "module on the kernels; bench", TritonCfg),
    Suite("fa2", "test_fa2.py", "FA-2 varlen (flash_attn, torch varlen_attn) for window/compressed branches vs oracle; "
          "bench", Fa2Cfg),
    Suite("decode", "test_decode.py",
          "Triton decode step vs the oracle; step time (CUDA graphs), per branch, dense baseline, roofline", DecodeCfg,
          summarise=_decode_summary),
    Suite("layer", "test_layer.py",
          "the whole NSA layer (prefill fwd, fwd+bwd, peak memory, stage breakdown) vs a dense layer; needle at "
          "long range", LayerCfg, summarise=_layer_summary),
    Suite("counters", "test_counters.py",
          "decode read counters measured from the gathered indices == formula at every step; paper Table 4",
          CountersCfg),
]}
