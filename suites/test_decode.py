"""decode: the Triton decode step against the fp32 oracle, and a decode bench that times the GPU.

Parity (``parity[S]``, ``parity[B4-S]``, ``parity[B8-S]`` at B = 2, 4, 8): a cache of S tokens
(random K/V, random compressed K/V, NaN past them); the step for token t = S−1 must select the
oracle's blocks (``reference.decode_row``, fp32, from the same cache values) and match each branch's
output and the gate mix within the 2x rule against the oracle run in the test dtype with the same
blocks; the reads it counted must equal the formula, and at the profile's ``effect_contexts`` (B=2)
they are also measured by their effect on the output (``suites.read_effect``: each token the formula
says is read moves it; every other one, NaN, does not). Where the profile's dtype is not fp32,
``parity[fp32-S]`` runs the step in fp32 at the shortest context, held to the fp32 floor: a step whose
fp32 dots round to TF32 fails it.

Caches are allocated with room to grow (``suites.decode.capacity``, 2x the context by default: what a
generation loop allocates), NaN past their tokens; the parity cases, the bench and the Nsight Compute
probe all run on such caches.

Bench (``bench[B-S]``, docs/method.md): the step is ``kernels.decode.DecodeStep`` (append the new token's
K/V, select its blocks, the three branches, merge, gate mix) as ``NSAAttention.decode`` runs it at position
S−1 (planned for the tokens held: ``kernels.decode.horizon``), captured in a CUDA graph and replayed
(``timing.bench(graph=True)``), and also run eagerly; each branch alone (only its work: selection
belongs to ``sel``); on a GPU as many launches doing nothing, chained as the step's are
(``kernels.decode.launch_floor``): a floor under the step; and a dense decode over the whole cache that reads the dense layer's bytes
(append + SDPA on a fused backend with k at d_k and v at d_v; flash-attn's ``flash_attn_with_kvcache``
when installed, at d_k = d_v = (d_k + d_v)/2 where the layer's differ, as FA-2 needs one head dim:
the same K+V bytes per token). The headline "x dense" is against the faster of those two; flash-attn
with v zero-padded to d_k (20% more bytes at 192/128) is a second, labelled column only. Bytes
= measured reads × (d_k + d_v) × bytes/elem × G × B; achieved GB/s against the device's measured
copy bandwidth and the profile's spec-sheet figure. The case at the profile's largest batch and
longest bench context checks its ``expect`` figures (for this GPU). Each case records its row; the
suite's summary (``nsa_validate.report.decode_table.summarise``, run by the harness after the suite)
labels launch-bound rows (eager/graph > 1.5, or a curve flat in S: ``nsa_validate.measure.roofline``),
writes ``decode.csv`` (columns in ``decode_table.COLUMNS``), two PNG plots, the report table and
the headline figures.

The bench also times the step on a full cache of the same tokens (capacity = S) and the step planned for the
cache's whole capacity (what a caller's CUDA graph records), and fails where either on the cache with room to
grow is more than ``headroom_margin`` slower than the full cache's (at a power-of-two context on a 2x cache
``m.decode``'s step has the full cache's plan: there the capacity's plan is the one the margin tests); and the loop
users write,
``NSAAttention.decode`` token after token (``loop_tokens`` of them, the last at position S−1: wall clock,
CUDA events, the host's own cost per call, ``decode_bench.decode_loop``), beside the graph-replayed
layer step, labelled host-bound where it takes more than 1.5x that step's GPU time.

On a CPU the kernels run under the Triton interpreter at tiny sizes and the timer is
``time.perf_counter`` (rows say ``timer=cpu``): those figures only prove the plumbing.
"""
from __future__ import annotations

import gc
import sys
from types import SimpleNamespace

import pytest
import torch

from nsa_core.cuda_graph import capturing
from nsa_validate.measure import evidence, limits, ncu, roofline, timing
from nsa_validate.report import decode_table
from nsa_validate.bench import decode as decode_bench
from nsa_validate.suite.context import current
from nsa_validate.suite.plugin import no_sizes, profile_cases
from nsa_validate.measure.tolerance import DTYPES
from suites import read_effect

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

CTX = current()
CFG = CTX.profile.suites.decode
DEV = CTX.device
LAYER = decode_bench.layer_config(CFG.paper_config)
DTYPE = DTYPES[CFG.dtype]
GPU = DEV == "cuda"


def _require(dtype=DTYPE):
    from kernels import routes
    why = routes.triton_unavailable(cfg=LAYER, device=DEV, dtype=dtype)
    if why:
        pytest.skip(f"Triton decode kernel cannot run here: {why}")
    from kernels import decode
    return decode


def _cache(B, S, seed, capacity=None, dtype=DTYPE):
    """A DecodeCache of S tokens and the new token's tensors (``nsa_validate.bench.decode``), allocated for
    the profile's ``capacity`` (room to grow, as a generation loop allocates it; NaN past the tokens)."""
    return decode_bench.make_inputs(LAYER, B, S, dtype, DEV, seed, capacity=capacity or CFG.capacity_for(S))


# -- parity ---------------------------------------------------------------------------------
# B=2 and B=4: with the paper's 4 KV heads, B·G 8 and 16, the two window / selection tilings (one selection block
# a tile, two: ``kernels.decode.TWO_BLOCK_TILES``); B=8 (B·G 32) at the longest context: on Hopper the launches
# there let the next one go at the end of their programs, not at their start (``kernels.decode.EARLY_TRIGGER_ROWS``);
# B=16 (B·G 64) there too: the bench's batch, where Hopper takes the shallow window + selection launch if its kernel
# fits three programs an SM (``kernels.decode.SHALLOW_MIN_TILES``).
# Where the profile's dtype is not fp32, one fp32 case at the shortest context: held to the fp32 floor, which a
# step whose fp32 dots round to TF32 (~1e-3 relative) cannot meet
@pytest.mark.parametrize("B,S,dt", profile_cases([pytest.param(2, S, CFG.dtype, id=f"S{S}") for S in CFG.contexts] +
                                                 [pytest.param(4, S, CFG.dtype, id=f"B4-S{S}") for S in CFG.contexts] +
                                                 [pytest.param(8, S, CFG.dtype, id=f"B8-S{S}") for S in CFG.contexts[-1:]] +
                                                 [pytest.param(16, S, CFG.dtype, id=f"B16-S{S}") for S in CFG.contexts[-1:]] +
                                                 [pytest.param(2, S, "fp32", id=f"fp32-S{S}") for S in CFG.contexts[:1]
                                                  if CFG.dtype != "fp32"],
                                                 "decode", "contexts", 3))
def test_parity(B, S, dt, record):
    dtype = DTYPES[dt]
    decode = _require(dtype)
    cache, new = _cache(B, S, seed=S, dtype=dtype)
    t = S - 1
    # NSAAttention.decode's step at t, planned for the tokens held (``decode.horizon``), and where that is not the
    # capacity, the step planned for every position (a caller's CUDA graph's), on the same oracle: at every parity
    # case where the profile asks (``capacity_parity``), else at the bench's batch sizes (the bench compiles it)
    step = decode.step_at(LAYER, cache, t)
    record.metrics["capacity"], record.metrics["plan_tokens"] = cache.max_len, step.horizon
    record.metrics["blocks_per_tile"] = step.plan.bpt
    record.metrics["pdl_mode"] = step.plan.gdc          # 0 none, 2 early trigger, 3 late (kernels.decode._gdc)
    # the window + selection programs' tiles and pipeline stages (4 and 2: the shallow launch)
    record.metrics["win_sel_tiles"] = step.plan.win_tiles
    record.metrics["win_sel_stages"] = step.plan.win_stages
    results = {"": _step(step, new, record)}
    if step.horizon < cache.max_len and (CFG.capacity_parity or B in CFG.batches):
        results["_whole"] = _step(decode.DecodeStep(LAYER, cache), new, record)
    _against_oracle(record, results, cache, new, t, slice(None), dtype=dtype)
    if S in CFG.effect_contexts and B == 2 and dt == CFG.dtype:
        record.metrics["reads_by_effect"] = _reads_by_effect(decode, cache, new, results[""], t)
    record.assert_ok()


@pytest.mark.parametrize("S", profile_cases([pytest.param(S, id=f"S{S}") for S in CFG.contexts[-1:]],
                                           "decode", "contexts", 1))
def test_exact_ties(S, record):
    """The step's top-n where every unforced causal block scores exactly the same (random scores never
    tie): one compressed token per block (l = d = l'), q = 0, so every logit is exactly 0, each head's
    probabilities are equal and their sum over the heads is the same sum in every block. Past the
    forced blocks the step must take the lowest-numbered blocks, as the oracle does (docs/nsa.md), at
    the longest context, with no near-tie allowance; on a cache with room to grow, as every case."""
    import dataclasses

    from nsa_core import reference
    decode = _require()
    cfg = dataclasses.replace(LAYER, cmp_len=LAYER.block_size, cmp_stride=LAYER.block_size)
    cache, new = decode_bench.make_inputs(cfg, 2, S, DTYPE, DEV, seed=S + 1, capacity=CFG.capacity_for(S))
    new["q"].zero_()
    t, cur, n = S - 1, (S - 1) // cfg.block_size, cfg.n_selected
    with torch.no_grad(), record.capture() as log:
        r = decode.DecodeStep(cfg, cache)(**new)
    for br in ("cmp", "sel", "win"):
        record.expect_ran(log, "decode", br, "triton")
    ref = reference.decode_row(new["q"], cache.k, cache.v, cache.k_cmp, cache.v_cmp, t, cfg)
    free = ref["scores"][:, :, 1:cur - 1]
    assert free.numel() and (free == free[:, :, :1]).all(), "construction: the oracle's scores do not tie exactly"
    lowest = sorted({0, cur - 1, cur} | set(range(1, n - 2)))[:n]
    got = r.idx.long()
    record.metrics.update(S=S, blocks=got[0, 0].tolist(), oracle=ref["idx"][0, 0].tolist(), lowest=lowest)
    assert (ref["idx"] == torch.tensor(lowest, device=ref["idx"].device)).all(), "the oracle does not take the lowest"
    differ = (got != ref["idx"]).any(-1)
    assert not differ.any(), (f"{int(differ.sum())} of {differ.numel()} (row, KV head) differ from the oracle's "
                              f"lowest blocks: {got[differ][0].tolist()} vs {lowest}")


def _wide_batch(S: int) -> int:
    """The fewest rows whose raw K cache of S tokens holds more than 2^31 elements with the last
    row's offset past int32 (b · S·G·d_k, while the strides themselves fit in int32)."""
    return 2 ** 31 // (S * LAYER.n_kv_heads * LAYER.d_k) + 2


@pytest.mark.nsa_exclusive
@pytest.mark.parametrize("B,S", profile_cases([pytest.param(_wide_batch(S), S, id=f"wide-S{S}")
                                               for S in (CFG.contexts[-1:] if CFG.wide_cache else [])],
                                              "decode", "wide_cache", 2))
def test_wide_cache(B, S, record):
    """A cache of more than 2^31 elements: its first and last rows (the largest offsets) against the
    oracle as in ``parity``. (A 32-bit row offset read wrapped addresses there: NaN in the last row,
    then an illegal address in the graph-replayed step; H100, B=44 at 64k, before 64-bit offsets.)"""
    decode = _require()
    need = B * S * LAYER.n_kv_heads * ((LAYER.d_k + LAYER.d_v) * DTYPE.itemsize + LAYER.d_k * 4)  # + fp32 draw
    free = torch.cuda.mem_get_info()[0] if GPU else None
    if free is not None and free < 1.2 * need:
        pytest.skip(f"needs ~{1.2 * need / 2**30:.1f} GiB of free device memory, {free / 2**30:.1f} GiB free")
    cache, new = _cache(B, S, seed=S, capacity=S)        # a full cache: the offsets, not the headroom, are the point
    record.metrics["k_cache_elements"] = cache.k.numel()
    r = _step(decode.DecodeStep(LAYER, cache), new, record)
    for b in (0, B - 1):
        _against_oracle(record, {f"_row{b}": r}, cache, new, S - 1, slice(b, b + 1))
    record.assert_ok()


def _step(step, new, record):
    """One eager step; its three branches must have run on the Triton kernels."""
    with torch.no_grad(), record.capture() as log:
        r = step(**new)
    for br in ("cmp", "sel", "win"):
        record.expect_ran(log, "decode", br, "triton")
    return r


def _against_oracle(record, results: dict, cache, new, t, rows: slice, dtype=DTYPE):
    """Batch rows ``rows`` of each step result in ``results`` ({tag: StepOut} for token t) vs the fp32 oracle,
    computed once: the same blocks, each branch's output and the gate mix within the 2x rule (the oracle in the
    test dtype with the same blocks as the low-precision reference), reads == formula. Checks are named
    ``o_<branch><tag>``."""
    from nsa_core import reference
    args = (new["q"][rows], cache.k[rows], cache.v[rows], cache.k_cmp[rows], cache.v_cmp[rows], t, LAYER)
    ref = reference.decode_row(*args)
    lp = reference.decode_row(*args, idx=ref["idx"], dtype=dtype) if dtype != torch.float32 else None
    g = new["gate"][rows]
    mix = lambda o, dt: sum(g[..., i:i + 1].to(dt) * o[f"o_{br}"] for i, br in enumerate(("cmp", "sel", "win")))  # noqa: E731
    want = LAYER.expected_reads(t)
    for tag, r in results.items():
        mismatch = (r.idx[rows].long() != ref["idx"]).any(-1)
        record.metrics[f"idx_rows_differing{tag}"] = int(mismatch.sum())
        assert not mismatch.any(), (f"selected blocks differ from the oracle's in {int(mismatch.sum())} of "
                                    f"{mismatch.numel()} (row, KV head){tag}")
        for br in ("cmp", "sel", "win"):
            record.check(f"o_{br}{tag}", r.out[br][rows], ref[f"o_{br}"], lp and lp[f"o_{br}"], dtype=dtype)
        record.check(f"mixed{tag}", r.mixed[rows], mix(ref, torch.float32), lp and mix(lp, dtype), dtype=dtype)
        got = {br: r.reads[br][rows].unique().tolist() for br in ("cmp", "sel", "win")}
        record.metrics[f"reads{tag}"] = {"measured": got, "formula": want}
        assert got == {br: [want[br]] for br in got}, f"measured reads {got} != formula {want}{tag}"


def _reads_by_effect(decode, cache, new, r, t):
    """The step's reads measured by their effect on its output (``suites.read_effect``), per branch
    on the kernel alone: the tokens that move the output are the formula's, token for token, and
    the ones the step reported."""
    def run(c, br):
        n = c.k.shape[0]
        one = {k: new[k][:1].expand(n, *new[k].shape[1:]).contiguous() for k in ("q", "k_new", "v_new", "pos")}
        with torch.no_grad():
            return decode.DecodeStep(LAYER, c, branches=(br,))(**one).out[br].clone()
    reported = read_effect.reported_sets(LAYER, t, r.reads, r.idx)
    formula = read_effect.formula_sets(LAYER, t, r.idx[0])
    cached = {"cmp": LAYER.n_cmp(t), "sel": t, "win": t}
    return {br: read_effect.check_step(run, LAYER, t, cache, br, reported[br], formula[br], cached[br])
            for br in ("cmp", "sel", "win")}


@pytest.mark.parametrize("_", profile_cases([pytest.param(None, id="graph")] if CFG.contexts else [],
                                             "decode", "contexts", 1))      # a decode suite with no sizes runs none
def test_layer_step(_, record):
    """The whole layer's decode step users capture (``kernels.decode_layer.LayerDecodeStep``:
    projections, append, φ, gate, the three branches + gated mix, output projection), replayed from
    one CUDA graph on a GPU, eager elsewhere: after a prefill of P tokens each of 2·d + 3 steps (φ
    completes spans in between) equals the fp32 oracle's row t of the whole layer, given the blocks
    each step selected (the selection itself is checked against the oracle in ``parity``)."""
    from nsa_core import DecodeCache, reference
    _require()
    from kernels.decode_layer import LayerDecodeStep
    cfg = LAYER
    B, P, N = 2, 3 * cfg.block_size + 5, 2 * cfg.cmp_stride + 3
    m = decode_bench.nsa_layer(cfg, DTYPE, DEV, seed=11)
    x = torch.randn(B, P + N, cfg.d_model, device=DEV).to(DTYPE)
    cache = DecodeCache(cfg, B, P + N, device=DEV, dtype=DTYPE)
    outs, idx = [], []
    with torch.no_grad(), record.capture() as log:
        m(x[:, :P], cache=cache)
        step = LayerDecodeStep(m, cache)
        outs.append(step(x[:, P:P + 1]).clone())                 # eager: compiles, warms up
        idx.append(step.last.idx.clone())
        if GPU:
            buf = x[:, P + 1:P + 2].clone()
            g = torch.cuda.CUDAGraph()
            with capturing(g):
                out = step(buf)
            step.seek(P + 1)                                      # the capture ran the host's bookkeeping once
            run = lambda xt: (buf.copy_(xt), g.replay(), out)[2]  # noqa: E731
        else:
            run = step
        for t in range(P + 1, P + N):
            outs.append(run(x[:, t:t + 1]).clone())
            idx.append(step.last.idx.clone())
    for br in ("cmp", "sel", "win"):
        record.expect_ran(log, "decode", br, "triton")
    full_idx = torch.cat([m.select(x)[:, :P], torch.stack(idx, 1)], 1)
    ref32 = reference.forward(m, x, idx=full_idx)
    ref_lp = reference.forward(m, x, idx=full_idx, dtype=DTYPE) if DTYPE != torch.float32 else None
    record.metrics.update(prefill=P, steps=N, graph=GPU)
    record.check("layer_rows", torch.cat(outs, 1), ref32["out"][:, P:], ref_lp and ref_lp["out"][:, P:], dtype=DTYPE)
    n = cfg.n_cmp_total(P + N)
    assert torch.isfinite(cache.k_cmp[:, :n]).all() and torch.isfinite(cache.v_cmp[:, :n]).all(), \
        "a compressed slot of a completed span was left unwritten"
    record.assert_ok()


# -- bench ----------------------------------------------------------------------------------
def _copy_gbs() -> float | None:
    """Device copy bandwidth (GB/s, read + write) from 1 GiB → 1 GiB copies, measured once per
    process, by the first bench case's body (a fixture would measure it beside other suites'
    cases); None without a GPU."""
    return limits.measured_bandwidth()[0] if GPU else None


def _time(fn, graph, telemetry=False):
    """``telemetry``: the GPU's clocks, power and temperature read before and after (nvidia-smi, ~35 ms a
    read on an H200 pod): for the bench's headline timings only, not for each of its dozen timings."""
    if not GPU:                # one call: a CPU timing is noise, and the interpreter is slow (bench.layer alike)
        return timing.bench(fn, device=DEV, warmup=0, reps=1)
    return timing.bench(fn, device=DEV, graph=graph, budget_ms=300, min_reps=5, max_reps=200, telemetry=telemetry)


BENCH_CONTEXTS = CFG.bench_contexts if CFG.bench_contexts is not None else CFG.contexts
BENCH = [pytest.param(B, S, id=f"B{B}-S{S}") for B in CFG.batches for S in BENCH_CONTEXTS]


@pytest.fixture
def bench_setup(B, S):
    """The bench's inputs at (B, S) with every step it times run once: the Triton kernels compile
    here, before the timed body (which alone holds the GPU when suites share it)."""
    decode = _require()
    from kernels import fa2
    from kernels.decode_layer import LayerDecodeStep
    # the user loop's own process starts first: it builds and warms up beside this setup (``_user_loop``); it is
    # ended whatever happens after (a failing setup too)
    loop = _fresh_loop(B, S) if GPU else None
    if GPU:
        # every case's caches from the same allocator state, whatever cases ran before it in this process (a user
        # process allocates its cache once): the blocks earlier cases freed are given back first. One full-level
        # run each on an H200, B=16 64k on the 2x cache: 83.0 us without, 81.8 with (docs/decisions.md)
        gc.collect()
        torch.cuda.empty_cache()
    try:
        cache, new = _cache(B, S, seed=decode_bench.probe_seed(B, S))
        full, _ = _cache(B, S, seed=decode_bench.probe_seed(B, S), capacity=S)       # the same tokens, no room to grow
        m = decode_bench.nsa_layer(LAYER, DTYPE, DEV, seed=B)
        # the step NSAAttention.decode runs at position S−1, planned for the tokens held (``decode.step_at``)
        s = SimpleNamespace(cache=cache, new=new, step=decode.step_at(LAYER, cache, S - 1), m=m,
                            full_step=decode.DecodeStep(LAYER, full), whole_step=decode.DecodeStep(LAYER, cache),
                            alone={br: decode.step_at(LAYER, cache, S - 1, branches=(br,))
                                   for br in ("cmp", "sel", "win")},
                            layer=LayerDecodeStep(m, cache), x=torch.randn(B, 1, LAYER.d_model, device=DEV).to(DTYPE),
                            dense=decode_bench.dense_decodes(LAYER, full, DTYPE, DEV, flash_attn=fa2.unavailable(
                                "flash_attn", device=DEV, dtype=DTYPE) is None),
                            placed=[decode.step_at(LAYER, cache, S - 1) for _ in range(CFG.workspaces - 1)]
                            if GPU else [],
                            loop=loop)
        with torch.no_grad():
            for st in (s.step, s.full_step, s.whole_step, *s.alone.values(), *s.placed):
                st(**new)
            s.layer.seek(S - 1)
            s.layer(s.x)
        if loop is not None:
            loop.ready()
        yield s
    finally:
        if loop is not None:
            loop.close()


@pytest.mark.parametrize("B,S", profile_cases(BENCH, "decode", "contexts", 2))
@pytest.mark.nsa_exclusive
def test_bench(B, S, record, bench_setup):
    copy_gbs = _copy_gbs()
    step, new, layer, x, dense, m = (bench_setup.step, bench_setup.new, bench_setup.layer, bench_setup.x,
                                     bench_setup.dense, bench_setup.m)
    with torch.no_grad(), record.capture() as log:
        r = step(**new)
    for br in ("cmp", "sel", "win"):
        record.expect_ran(log, "decode", br, "triton")
    want = LAYER.expected_reads(S - 1)
    for what, res in (("", r), (" (full cache)", bench_setup.full_step(**new)),
                      (" (planned for the capacity)", bench_setup.whole_step(**new))):
        reads = {br: res.reads[br].unique().tolist() for br in ("cmp", "sel", "win")}
        assert reads == {br: [want[br]] for br in reads}, f"measured reads{what} {reads} != formula {want}"
    tokens = sum(want.values())
    # the whole layer's step is replayed at position S−1 every time (seek is part of the captured work)
    t, placed = {}, []                   # placed: the graph-replayed step's median per workspace
    with torch.no_grad():
        t["eager"] = _time(lambda: step(**new), graph=False)
        # the same tokens in a cache without room to grow: the step must not depend on the spare rows
        t["full"] = _time(lambda: bench_setup.full_step(**new), graph=True)
        # and the step planned for every position of the cache, as a caller's CUDA graph records it
        t["whole"] = _time(lambda: bench_setup.whole_step(**new), graph=True)
        if GPU:
            t["graph"] = _time(lambda: step(**new), graph=True, telemetry=True)
            placed.append(t["graph"].median_ms)
            # the same step on workspaces of its own: where the buffers land moves it (``decode.workspaces``)
            for i, other in enumerate(bench_setup.placed, 1):
                o = other(**new)
                assert torch.equal(o.mixed, r.mixed) and torch.equal(o.idx, r.idx), \
                    f"the step on workspace {i} differs from the first: not bit-identical"
                t[f"graph_ws{i}"] = _time(lambda other=other: other(**new), graph=True)
                placed.append(t[f"graph_ws{i}"].median_ms)
        for br, alone in bench_setup.alone.items():
            t[br] = _time(lambda: alone(**new), graph=True)
        # (whole=False: m.decode's plan at S−1, which the captured work's seek keeps every replay at)
        t["layer"] = _time(lambda: (layer.seek(S - 1), layer(x, whole=False)), graph=True, telemetry=True)
        if GPU:             # as many launches doing nothing, chained as the step's: a floor under it
            t["floor"] = _time(_require().launch_floor(DEV, B * LAYER.n_kv_heads), graph=True)
        for name, dd in dense.items():
            for what, fn in (("", dd.attend), ("_layer", lambda: dd.layer(x))):
                if what and name.endswith("_padded"):
                    continue
                with evidence.observe(DEV) as klog:
                    fn()
                record.expect_kernels(klog, f"decode/dense_{name}{what}", "sdpa_fused" if name == "sdpa" else "flash_attn")
                t[f"dense_{name}{what}"] = _time(fn, graph=True)
    # the least each timing must read from DRAM: its branches' tokens (the formula), or the cache,
    # and for whole layers their weights too
    kv = lambda n, dv=LAYER.d_v: roofline.bytes_read(n, LAYER.d_k, dv, DTYPE.itemsize, LAYER.n_kv_heads, B)  # noqa: E731
    nbytes = kv(tokens)
    weights = lambda mod: sum(p.numel() * p.element_size() for p in mod.parameters())  # noqa: E731
    least = {"eager": nbytes, "graph": nbytes, "full": nbytes, "whole": nbytes, "layer": nbytes + weights(m),
             "floor": 0,
             **{f"graph_ws{i}": nbytes for i in range(1, len(bench_setup.placed) + 1)},
             **{br: kv(want[br]) for br in ("cmp", "sel", "win")},
             **{f"dense_{k}": kv(S, LAYER.d_k if k.endswith("_padded") else LAYER.d_v) for k in dense},
             **{f"dense_{k}_layer": kv(S) + weights(dd.proj) for k, dd in dense.items()}}
    for name, tm in t.items():
        record.timing(name, tm, nbytes=least[name])
    loop = _user_loop(bench_setup, S)
    record.metrics["loop"] = loop.summary()
    main = t.get("graph", t["eager"])
    gbs = roofline.achieved_gbs(nbytes, main.median_ms)
    # the headline compares with dense decodes that read the dense layer's bytes, never the padded one
    ms = lambda k: t[k].median_ms if k in t else None  # noqa: E731
    dense_ms = min(t[k].median_ms for k in ("dense_sdpa", "dense_flash_attn") if k in t)
    dense_layer_ms = min(t[k].median_ms for k in ("dense_sdpa_layer", "dense_flash_attn_layer") if k in t)
    spec = CTX.expect.peak_bandwidth_gbs
    layer_ms = t["layer"].median_ms
    row = {"B": B, "S": S, "capacity": bench_setup.cache.max_len, "plan_tokens": step.horizon, "timer": main.timer,
           "step_ms": main.median_ms,
           "step_full_ms": t["full"].median_ms, "headroom_slowdown_pct": 100 * (main.median_ms / t["full"].median_ms - 1),
           "step_whole_ms": t["whole"].median_ms,
           "whole_slowdown_pct": 100 * (t["whole"].median_ms / t["full"].median_ms - 1),
           "step_p20_ms": main.p20_ms,
           "step_p80_ms": main.p80_ms, "step_ws_min_ms": min(placed, default=None),
           "step_ws_max_ms": max(placed, default=None), "workspaces": len(placed),
           "eager_ms": t["eager"].median_ms, "graph_ms": ms("graph"), "floor_ms": ms("floor"),
           **{f"{br}_ms": t[br].median_ms for br in ("cmp", "sel", "win")},
           "dense_sdpa_ms": ms("dense_sdpa"), "dense_flash_attn_ms": ms("dense_flash_attn"),
           "dense_flash_attn_padded_ms": ms("dense_flash_attn_padded"),
           "speedup_vs_dense": dense_ms / main.median_ms,
           "speedup_vs_padded": (t["dense_flash_attn_padded"].median_ms / main.median_ms
                                 if "dense_flash_attn_padded" in t else None),
           "expected_speedup": S / tokens,
           "layer_ms": t["layer"].median_ms, "layer_p20_ms": t["layer"].p20_ms, "layer_p80_ms": t["layer"].p80_ms,
           "dense_sdpa_layer_ms": ms("dense_sdpa_layer"), "dense_flash_attn_layer_ms": ms("dense_flash_attn_layer"),
           "layer_speedup_vs_dense": dense_layer_ms / t["layer"].median_ms,
           "loop_ms": loop.wall_ms, "loop_events_ms": loop.events_ms, "loop_host_ms": loop.host_ms,
           "loop_gpu_share": layer_ms / loop.wall_ms if GPU else None,
           "loop_host_bound": bool(GPU and loop.wall_ms > HOST_BOUND * layer_ms),
           "tokens_read": tokens, "bytes": nbytes, "achieved_gbs": gbs,
           "pct_copy_bw": 100 * gbs / copy_gbs if copy_gbs else None,
           "pct_spec_bw": 100 * gbs / spec if spec and GPU else None,
           "copy_gbs": copy_gbs, "gpu": CTX.device_name, "config": CONFIG_LABEL}
    record.metrics["row"] = row          # the suite's summary (decode_table.summarise) tabulates the rows
    problems = [f"implausible measurement (timing bug?): loop: {bad}"] if (bad := loop.implausible()) else []
    for what, key, pct in (("", "graph", "headroom_slowdown_pct"), (" planned for the capacity", "whole",
                                                                    "whole_slowdown_pct")):
        if GPU and row[pct] > 100 * CFG.headroom_margin:
            problems.append(
                f"B={B} S={S}: the step{what} on a cache of capacity {row['capacity']} took "
                f"{t[key].median_ms * 1e3:.1f} us, {row[pct]:.1f}% slower than on a full cache "
                f"({t['full'].median_ms * 1e3:.1f} us); at most {100 * CFG.headroom_margin:.0f}% allowed "
                f"(suites.decode.headroom_margin)")
    assert not problems, "; ".join(problems)
    if (B, S) == CHECKED_AT and GPU:
        _check_expectations(row)


HOST_BOUND = 1.5       # a loop taking this many times the GPU's work per token is labelled host-bound


def _fresh_loop(B: int, S: int):
    """The user loop's process (``decode_bench.FreshLoop``), on a cache of the bench's capacity, started in the
    bench's setup."""
    return decode_bench.FreshLoop(CFG.paper_config, B, S, CFG.capacity_for(S), CFG.dtype, CFG.loop_tokens, seed=B)


def _user_loop(s, S: int):
    """The loop users write (``decode_bench.decode_loop``): ``NSAAttention.decode`` token after token,
    ``loop_tokens`` of them ending at position S−1 (``decode_bench.loop_start``), in a cache of the bench's capacity.
    On a GPU in a process of its own, as a user's script runs it (``FreshLoop``: started and warmed up in the
    setup, timed here); on a CPU in this one (the interpreter's figures only prove the plumbing, and a
    process costs CI its start-up)."""
    if s.loop is not None:
        return s.loop.run()
    return decode_bench.decode_loop(s.m, s.cache, decode_bench.loop_start(S, CFG.loop_tokens, DEV), CFG.loop_tokens,
                                    DEV)


CONFIG_LABEL = (f"paper config G={LAYER.n_kv_heads}, h={LAYER.heads_per_group}, d_k={LAYER.d_k}, d_v={LAYER.d_v}"
                if CFG.paper_config else "tiny config")
# the profile's expectations hold at the largest batch and longest bench context
CHECKED_AT = (max(CFG.batches), max(BENCH_CONTEXTS)) if CFG.batches and BENCH_CONTEXTS else None


def _check_expectations(row: dict) -> None:
    """The profile's decode_roofline_min and decode_speedup_min (for this GPU) at ``CHECKED_AT``."""
    exp, problems = CTX.expect, []
    if exp.decode_roofline_min is not None and not row["pct_copy_bw"] >= 100 * exp.decode_roofline_min:
        problems.append(f"{row['pct_copy_bw']:.1f}% of copy bandwidth < {100 * exp.decode_roofline_min:.0f}% expected "
                        f"(expect.decode_roofline_min)")
    if exp.decode_speedup_min is not None and not row["speedup_vs_dense"] >= exp.decode_speedup_min:
        problems.append(f"{row['speedup_vs_dense']:.2f}x dense < {exp.decode_speedup_min}x expected "
                        f"(expect.decode_speedup_min)")
    assert not problems, f"B={row['B']} S={row['S']}: " + "; ".join(problems)


def _distinct_raw_tokens(idx, t: int) -> int:
    """Raw tokens the window and the selected blocks (idx [B, G, n], −1 unused) cover together,
    each counted once, summed over rows and KV heads."""
    B, G, _ = idx.shape
    L = LAYER.block_size
    pos = torch.arange(t + 1, device=idx.device)
    chosen = torch.zeros(B, G, t // L + 2, dtype=torch.bool, device=idx.device)
    chosen.scatter_(2, idx.long() + 1, True)                               # slot 0: the −1 entries
    covered = chosen[:, :, 1 + pos // L] | (pos >= t - LAYER.window + 1)
    return int(covered.sum())


@pytest.mark.skipif(not CFG.dram_counters, reason="not at this level (the profile's suites.decode.dram_counters is false)")
@pytest.mark.nsa_exclusive
def test_dram_reads(record, extra):
    """The GPU's own DRAM counters (Nsight Compute) on one eager step at the largest batch and
    context, next to the formula's bytes and the bytes counted from the step's indices. Fails when
    the step reads more than ``expect.decode_dram_ratio_max`` × the formula, or less than the distinct
    tokens its indices cover (a kernel that skipped work: ncu flushes the caches before each kernel,
    so every token read comes from DRAM at least once; the formula counts a token that both the
    window and a selected block cover twice, the hardware may read it once)."""
    for field, sizes in (("contexts", CFG.contexts), ("batches", CFG.batches)):
        if not sizes:
            pytest.skip(no_sizes("decode", field))
    why = ncu.unavailable()
    if why:
        pytest.skip(why)
    decode = _require()
    B, S = max(CFG.batches), max(CFG.contexts)
    cache, new = _cache(B, S, seed=decode_bench.probe_seed(B, S))
    with torch.no_grad(), record.capture() as log:
        r = decode.step_at(LAYER, cache, S - 1)(**new)
    for br in ("cmp", "sel", "win"):
        record.expect_ran(log, "decode", br, "triton")
    del cache
    nbytes = lambda tokens: roofline.bytes_read(tokens, LAYER.d_k, LAYER.d_v, DTYPE.itemsize, 1, 1)  # noqa: E731
    counted = {br: nbytes(int(r.reads[br].sum())) for br in ("cmp", "sel", "win")}     # summed over B and G
    distinct = nbytes(int(r.reads["cmp"].sum()) + _distinct_raw_tokens(r.idx, S - 1))
    want = LAYER.expected_reads(S - 1)
    formula = {br: roofline.bytes_read(want[br], LAYER.d_k, LAYER.d_v, DTYPE.itemsize, LAYER.n_kv_heads, B)
               for br in ("cmp", "sel", "win")}
    try:
        df = ncu.dram_bytes([sys.executable, "-m", "nsa_validate.bench.decode", "--batch", str(B), "--context", str(S),
                             "--dtype", CFG.dtype, "--config", "paper" if CFG.paper_config else "tiny",
                             "--capacity", str(CFG.capacity_for(S))])
    except ncu.NoCounterAccess as e:
        pytest.skip(str(e))
    launches = decode.step_launches(DEV, B * LAYER.n_kv_heads)
    assert len(df) == len(launches), f"ncu saw {len(df)} launches ({', '.join(df.kernel)}), a step makes {len(launches)}"
    # the launches that read the cache, each with its branches' formula bytes
    shares = {launches.index(name): sum(formula[br] for br in brs) for name, brs in decode.CACHE_READS.items()}
    total, f_total, c_total = float(df.dram_read.sum()), sum(formula.values()), sum(counted.values())
    ratio = total / f_total
    for row in decode_table.dram_rows(df, launches, B, S, shares, f_total, c_total, distinct):
        extra.row(decode_table.DRAM_TABLE, row)
    record.metrics.update(B=B, S=S, dram_read=total, dram_write=float(df.dram_write.sum()), formula_bytes=f_total,
                          counted_bytes=c_total, distinct_bytes=distinct, ratio=ratio,
                          launches=df.assign(what=list(launches)).to_dict("records"))
    assert counted == formula, f"bytes counted from the step's indices {counted} != formula {formula}"
    limit = CTX.expect.decode_dram_ratio_max
    assert total >= distinct, (f"DRAM reads {total / 1e6:.1f} MB < the {distinct / 1e6:.1f} MB of distinct tokens "
                               "the step's indices cover: a kernel skipped work")
    if limit is not None:
        assert ratio <= limit, (f"DRAM reads {total / 1e6:.1f} MB = {ratio:.3f} x the formula's "
                                f"{f_total / 1e6:.1f} MB > {limit} allowed (expect.decode_dram_ratio_max)")
