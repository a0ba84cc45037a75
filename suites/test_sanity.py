"""sanity: a tiny NSA layer end to end on this device, every branch against the fp32 oracle.

Method (FlashAttention's): the layer's weights and input are made once and rounded to the test
dtype; the oracle runs on those same rounded values upcast to fp32 (the truth) and again in the
test dtype (the low-precision oracle), so the measured error is the computation's, not the
rounding of the inputs. Block selection is discrete: in low precision a near-tie may pick a
different block, so attention is compared given the module's own block indices, and the
selection itself is checked on its own (``selection_agrees_with_oracle``). Every case proves
from the dispatch log which backend ran.
"""
import pytest
import torch

from nsa_core import BRANCHES, DecodeCache, NSAAttention, reference, routing, tiny
from nsa_validate.suite.context import current
from nsa_validate.measure.tolerance import DTYPES, FLOOR

CTX = current()
CFG = CTX.profile.suites.sanity
DEV = CTX.device


def _layer(dtype_name: str, seed: int = 0, S: int | None = None):
    """(module in the test dtype, input in the test dtype, dtype)."""
    torch.manual_seed(seed)
    cfg = tiny()
    dtype = DTYPES[dtype_name]
    m = NSAAttention(cfg, CTX.profile.routing).to(DEV).to(dtype)
    x = torch.randn(CFG.batch, S or CFG.seq_len, cfg.d_model, device=DEV).to(dtype)
    return m, x, dtype


def _oracles(m, x, dtype, **kw):
    ref32 = reference.forward(m, x, dtype=torch.float32, **kw)
    ref_lp = None if dtype == torch.float32 else reference.forward(m, x, dtype=dtype, **kw)
    return ref32, ref_lp


def _lp(ref_lp, key, rows=slice(None)):
    return None if ref_lp is None else ref_lp[key][:, rows]


@pytest.mark.parametrize("dt", CFG.dtypes)
def test_prefill_matches_oracle(dt, record):
    m, x, dtype = _layer(dt)
    idx = m.select(x)
    ref32, ref_lp = _oracles(m, x, dtype, idx=idx)
    with record.capture() as log:
        out = m(x)
    for br, d in m.routes(x.shape[1], x.device, dtype).items():
        record.expect_ran(log, "prefill", br, d.backend)
    record.check("out", out, ref32["out"], _lp(ref_lp, "out"), dtype=dtype)
    record.assert_ok()


@pytest.mark.parametrize("dt", CFG.dtypes)
@pytest.mark.parametrize("branch", BRANCHES)
def test_branch_isolated(branch, dt, record):
    """Gate forced one-hot through the API: only that branch runs and matches the oracle branch."""
    m, x, dtype = _layer(dt, seed=1)
    idx = m.select(x)
    ref32, ref_lp = _oracles(m, x, dtype, only=branch, idx=idx)
    with record.capture() as log:
        out = m(x, only=branch, idx=idx)
    record.expect_ran(log, "prefill", branch, m.routes(x.shape[1], x.device, dtype)[branch].backend)
    others = [b for b in BRANCHES if b != branch and log.backends("prefill").get(b)]
    assert not others, f"only={branch} also ran {others}"
    record.check("out", out, ref32["out"], _lp(ref_lp, "out"), dtype=dtype)
    record.assert_ok()


@pytest.mark.parametrize("dt", CFG.dtypes)
def test_selection_agrees_with_oracle(dt, record):
    """The module's blocks equal the oracle's, except at near-ties: a block may be swapped only for
    one whose fp32 score is within 2x the low-precision oracle's score error (+ floor)."""
    m, x, dtype = _layer(dt, seed=4)
    got = m.select(x)
    ref32, ref_lp = _oracles(m, x, dtype, with_scores=True)
    s32 = ref32["scores"]
    tol = (2 * (ref_lp["scores"].float() - s32).abs().max().item() if ref_lp else 0.0) + FLOOR[dtype]
    want = ref32["idx"]
    differ = (got != want).any(-1)
    worst = 0.0
    for b, t, g in differ.nonzero().tolist():
        a, w = set(got[b, t, g].tolist()) - {-1}, set(want[b, t, g].tolist()) - {-1}
        cur = t // m.cfg.block_size
        assert {0, cur, max(cur - 1, 0)} <= a, f"t={t}: forced blocks missing from {sorted(a)}"
        assert len(a) == len(w), f"t={t}: {len(a)} blocks vs oracle {len(w)}"
        floor_score = min(s32[b, t, g, j].item() for j in w - a)     # what the module displaced
        for j in a - w:
            worst = max(worst, floor_score - s32[b, t, g, j].item())
    record.metrics.update(rows=differ.numel(), rows_differ=int(differ.sum()), worst_gap=worst, tie_tol=tol)
    assert worst <= tol, f"module chose a block {worst:.3e} below the oracle's (near-tie tolerance {tol:.3e})"


@pytest.mark.parametrize("dt", CFG.dtypes)
def test_decode_matches_oracle_rows(dt, record):
    """Prefill P tokens into the cache, decode the rest one by one: each step equals oracle row t
    (given the blocks each step selected)."""
    m, x, dtype = _layer(dt, seed=2)
    P, S = CFG.decode_from, x.shape[1]
    cache = DecodeCache(m.cfg, x.shape[0], S, device=DEV, dtype=dtype)
    # the dispatch log covers every step; the GPU's kernels are observed on the prefill and the first
    # step only (the profiler's cost grows with every op it records: ~10 s for 100 steps on an H100)
    with routing.capture() as every:
        with record.capture() as log:
            m(x[:, :P], cache=cache)
            first = m.decode(x[:, P:P + 1], cache)
        rows = [first, *(m.decode(x[:, t:t + 1], cache) for t in range(P + 1, S))]
    steps, idx = [out for out, _ in rows], [info.idx for _, info in rows]
    backend = m.policy.decode_backend
    for br in BRANCHES:
        record.expect_ran(log, "decode", br, backend)
        assert every.ran("decode", br, backend) >= S - P, (
            f"decode/{br} ran on {backend} in {every.ran('decode', br, backend)} of {S - P} steps; "
            f"ran: {every.backends('decode')}")
    full_idx = torch.cat([m.select(x)[:, :P], torch.stack(idx, 1)], 1)
    ref32, ref_lp = _oracles(m, x, dtype, idx=full_idx)
    out = torch.cat(steps, dim=1)
    record.check("decode_rows", out, ref32["out"][:, P:], _lp(ref_lp, "out", slice(P, None)), dtype=dtype)
    record.metrics["steps"] = S - P
    record.assert_ok()


@pytest.mark.parametrize("dt", CFG.dtypes)
@pytest.mark.parametrize("S", [1, 7, 8, 13])
def test_short_sequences_finite(S, dt, record):
    """t < l (no compressed token yet) and t < w: outputs and gradients finite, matching the oracle."""
    m, x, dtype = _layer(dt, seed=3, S=S)
    ref32, ref_lp = _oracles(m, x, dtype)
    xl = x.clone().requires_grad_(True)
    with record.capture() as log:
        out = m(xl)
    for br, d in m.routes(S, xl.device, dtype).items():
        record.expect_ran(log, "prefill", br, d.backend)
    out.float().square().sum().backward()
    assert torch.isfinite(xl.grad).all(), "non-finite input gradient"
    bad = [n for n, p in m.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite parameter gradients: {bad}"
    record.check("out", out, ref32["out"], _lp(ref_lp, "out"), dtype=dtype)
    record.assert_ok()
