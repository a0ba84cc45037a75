"""counters: decode read counters measured from what the decode step gathered == the formula (docs/nsa.md).

The decode step reports, per branch and KV head, how many KV tokens it attended over, counted
from the slice and gather-index tensors it actually used (the ``StepInfo`` it returns). At the first and last
step of each case (the last only for the paper layer; layers listed in ``effect_layers``) the
reads are also measured by their effect (``suites.read_effect``): each
token the formula says is read, perturbed alone, changes the output; every other cached token,
NaN-poisoned, changes nothing; and that set equals the one the step reports, token for token. Here those measured
counts are compared with the formula at every step, from prefill lengths that straddle every
boundary (t < l, t < w, t+1 not a multiple of l', more causal blocks than n), and the paper's
Table 4 is reproduced (tokens per step at 8k … 64k, ±1 for the paper's rounding). Each case runs
on every decode path the profile lists (``suites.counters.backends``: the torch path, and the
Triton decode kernel on GPUs), and proves from the dispatch log that that path ran.
"""
import contextlib
import dataclasses

import pytest
import torch

from nsa_core import BRANCHES, PAPER, DecodeCache, NSAAttention, routing, tiny
from nsa_validate.suite.context import current
from suites import read_effect

CTX = current()
CFG = CTX.profile.suites.counters
DEV = CTX.device
PAPER_SMALL = PAPER.__class__(**{**PAPER.to_dict(), "d_model": 64})  # paper heads/blocks, small model dim
TABLE4 = {8192: 2048, 16384: 2560, 32768: 3584, 65536: 5632}


def _prefill_lengths(cfg, window_full: bool = True):
    """Where the prefill stops: empty, one token, a span short of and at the first compressed token,
    a token short of the window (its steps then cross into the sliding window) and, with
    ``window_full``, exactly the window (the prefill fills it to the edge), past 3 blocks, past n."""
    L = cfg.block_size
    lens = [0, 1, cfg.cmp_len - 1, cfg.cmp_len, cfg.window - 1, 3 * L + 5, cfg.n_selected * L + 5]
    return sorted(set(lens + ([cfg.window] if window_full else [])))


# the paper layer leaves out the prefill that fills the window exactly: the tiny layer checks that edge
# (the same code at w=12), and the paper layer's steps from w-1 cross it (a paper case: ~70 s on a CPU)
CASES = [pytest.param(name, cfg, P, id=f"{name}-prefill{P}")
         for name, cfg in (("tiny", tiny()), ("paper", PAPER_SMALL)) for P in _prefill_lengths(cfg, name == "tiny")]


@pytest.fixture(params=CFG.backends)
def backend(request):
    """The decode path under test; a path that cannot run here is skipped with its reason."""
    if request.param != "torch":
        _, why = routing.lookup("decode", "step", request.param, device=DEV, dtype=torch.float32)
        if why:
            pytest.skip(f"decode path {request.param} cannot run here: {why}")
    return request.param


def _layer(cfg, backend):
    return NSAAttention(cfg, dataclasses.replace(CTX.profile.routing, decode_backend=backend)).to(DEV)


@pytest.mark.parametrize("name,cfg,P", CASES)
def test_reads_equal_formula_every_step(name, cfg, P, backend, record):
    torch.manual_seed(P)
    m = _layer(cfg, backend)
    steps = CFG.decode_steps
    x = torch.randn(2, P + steps, cfg.d_model, device=DEV)
    # one capacity for every prefill length of a layer: the Triton step's launch plan depends on the
    # cache's shape, so all these cases share one set of compiled kernels (~3 s a compile on a GPU)
    cache = DecodeCache(cfg, 2, max(_prefill_lengths(cfg)) + steps, device=DEV)
    mismatches, checked, by_effect, pending, log = [], 0, {}, [], None
    # reads by effect: first and last step of the tiny layer, the last step of the paper layer (its
    # 64 query heads make a perturbation row costly on a CPU); layers the profile lists
    effect_steps = () if name not in CFG.effect_layers else (P + steps - 1,) if name == "paper" else (P, P + steps - 1)
    # the dispatch log covers every step; the GPU's kernels are observed on the first step only
    # (the profiler's cost grows with every op it records)
    with torch.no_grad(), routing.capture() as every:
        if P:   # the counters concern decode only: fill the cache without prefill attention
            m.fill_cache(x[:, :P], cache)
        for t in range(P, P + steps):
            before = read_effect.copy_rows(cache, 1) if t in effect_steps else None
            with record.capture() if t == P else contextlib.nullcontext() as first:
                out, info = m.decode(x[:, t:t + 1], cache)
            log = first or log
            if before is not None:      # reads measured by their effect too (below)
                reported = read_effect.reported_sets(cfg, t, info.reads, info.idx)
                formula = read_effect.formula_sets(cfg, t, info.idx[0])
                for g in range(cfg.n_kv_heads):
                    assert len(reported["sel"][g]) == int(info.reads["sel"][0, g]), (
                        f"t={t}: the step's selected blocks hold {len(reported['sel'][g])} tokens up to t, "
                        f"its sel counter says {int(info.reads['sel'][0, g])}")
                pending.append((t, before, reported, formula))
            assert torch.isfinite(out).all(), f"non-finite decode output at t={t}"
            want = cfg.expected_reads(t)
            for br in BRANCHES:
                got = info.reads[br]
                checked += got.numel()
                if not bool((got == want[br]).all()):
                    mismatches.append(f"t={t} {br}: measured {got.unique().tolist()} != formula {want[br]}")
    for br in BRANCHES:
        record.expect_ran(log, "decode", br, backend)
        assert every.ran("decode", br, backend) >= steps, (
            f"decode/{br} ran on {backend} in {every.ran('decode', br, backend)} of {steps} steps; "
            f"ran: {every.backends('decode')}")
    run = read_effect.module_step
    for t, before, reported, formula in pending:     # outside the profiled block: thousands of rows
        for br in BRANCHES:
            n_cached = t if br != "cmp" else cfg.n_cmp_total(t)
            by_effect[f"t{t}/{br}"] = read_effect.check_step(run(m, x[:, t:t + 1]), cfg, t, before, br,
                                                             reported[br], formula[br], n_cached)
    record.metrics.update(steps=steps, checked=checked, first_t=P, last_t=P + steps - 1,
                          reads_last=cfg.expected_reads(P + steps - 1), reads_by_effect=by_effect)
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"


TABLE4_TITLE = "Decode reads per step (paper Table 4), measured from gathered indices"


@pytest.mark.parametrize("S", CFG.paper_contexts)
def test_paper_table4(S, backend, record, extra):
    """One decode step at t = S−1 after filling the cache with S−1 tokens (paper config)."""
    if S not in TABLE4:
        pytest.skip(f"paper Table 4 has no entry for S={S}")
    cfg = PAPER_SMALL
    torch.manual_seed(0)
    m = _layer(cfg, backend)
    x = torch.randn(1, S, cfg.d_model, device=DEV)
    cache = DecodeCache(cfg, 1, S, device=DEV)
    with torch.no_grad(), record.capture() as log:
        m.fill_cache(x[:, :S - 1], cache)
        out, info = m.decode(x[:, S - 1:S], cache)
    for br in BRANCHES:
        record.expect_ran(log, "decode", br, backend)
    assert torch.isfinite(out).all()
    measured = {br: info.reads[br].unique().tolist() for br in BRANCHES}
    assert all(len(v) == 1 for v in measured.values()), f"reads differ across KV heads: {measured}"
    measured = {br: v[0] for br, v in measured.items()}
    total = sum(measured.values())
    record.metrics.update(S=S, measured=measured, total=total, formula=cfg.expected_reads(S - 1),
                          paper=TABLE4[S], dense=S, expected_speedup=round(S / TABLE4[S], 2))
    extra.row(TABLE4_TITLE, {"S": S, "backend": backend, **measured, "measured total": total, "paper": TABLE4[S],
                             "dense": S, "expected speedup": round(S / TABLE4[S], 2)})
    assert measured == cfg.expected_reads(S - 1), f"measured {measured} != formula {cfg.expected_reads(S - 1)}"
    assert abs(total - TABLE4[S]) <= 1, f"total {total} vs paper {TABLE4[S]} (±1)"
