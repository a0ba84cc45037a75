"""sanity: a tiny NSA layer end to end on this device, every branch against the fp32 oracle.

Each case: random input, the module in the test dtype on the profile's device, the oracle in
fp32 and again in the test dtype (tolerance rule of SPEC §4), and the dispatch log proving
which backend ran.
"""
import pytest
import torch

from nsa_core import BRANCHES, DecodeCache, NSAAttention, reference, routing, tiny
from nsa_validate.context import current
from nsa_validate.tolerance import DTYPES

CTX = current()
CFG = CTX.profile.suites.sanity
DEV = CTX.device


def _layer(dtype_name: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tiny()
    m = NSAAttention(cfg, CTX.profile.routing).to(DEV)
    x = torch.randn(CFG.batch, CFG.seq_len, cfg.d_model, device=DEV)
    return m, x, DTYPES[dtype_name]


def _oracles(m, x, dtype, **kw):
    ref32 = reference.forward(m, x, dtype=torch.float32, **kw)
    ref_lp = None if dtype == torch.float32 else reference.forward(m, x, dtype=dtype, **kw)
    return ref32, ref_lp


@pytest.mark.parametrize("dt", CFG.dtypes)
def test_prefill_matches_oracle(dt, record):
    m, x, dtype = _layer(dt)
    ref32, ref_lp = _oracles(m, x, dtype)
    with routing.capture() as log:
        out = m.to(dtype)(x.to(dtype))
    for br, d in m.routes(x.shape[1], x.device, dtype).items():
        record.expect_ran(log, "prefill", br, d.backend)
    record.check("out", out, ref32["out"], ref_lp and ref_lp["out"], dtype=dtype)
    record.assert_ok()


@pytest.mark.parametrize("dt", CFG.dtypes)
@pytest.mark.parametrize("branch", BRANCHES)
def test_branch_isolated(branch, dt, record):
    """Gate forced one-hot through the API: only that branch runs and matches the oracle branch."""
    m, x, dtype = _layer(dt, seed=1)
    ref32, ref_lp = _oracles(m, x, dtype, only=branch)
    with routing.capture() as log:
        out = m.to(dtype)(x.to(dtype), only=branch)
    record.expect_ran(log, "prefill", branch, m.routes(x.shape[1], x.device, dtype)[branch].backend)
    others = [b for b in BRANCHES if b != branch and log.backends("prefill").get(b)]
    assert not others, f"only={branch} also ran {others}"
    record.check("out", out, ref32["out"], ref_lp and ref_lp["out"], dtype=dtype)
    record.assert_ok()


@pytest.mark.parametrize("dt", CFG.dtypes)
def test_decode_matches_oracle_rows(dt, record):
    """Prefill P tokens into the cache, decode the rest one by one: each step equals oracle row t."""
    m, x, dtype = _layer(dt, seed=2)
    ref32, ref_lp = _oracles(m, x, dtype)
    m = m.to(dtype)
    P, S = CFG.decode_from, x.shape[1]
    cache = DecodeCache(m.cfg, x.shape[0], S, device=DEV, dtype=dtype)
    xl = x.to(dtype)
    with routing.capture() as log:
        m(xl[:, :P], cache=cache)
        steps = [m.decode(xl[:, t:t + 1], cache) for t in range(P, S)]
    for br in BRANCHES:
        record.expect_ran(log, "decode", br, m.policy.decode_backend)
    out = torch.cat(steps, dim=1)
    record.check("decode_rows", out, ref32["out"][:, P:], ref_lp and ref_lp["out"][:, P:], dtype=dtype)
    record.metrics["steps"] = S - P
    record.assert_ok()


@pytest.mark.parametrize("dt", CFG.dtypes)
@pytest.mark.parametrize("S", [1, 7, 8, 13])
def test_short_sequences_finite(S, dt, record):
    """t < l (no compressed token yet) and t < w: outputs and gradients finite, matching the oracle."""
    m, _, dtype = _layer(dt, seed=3)
    x = torch.randn(2, S, m.cfg.d_model, device=DEV)
    ref32, ref_lp = _oracles(m, x, dtype)
    m = m.to(dtype)
    xl = x.to(dtype).requires_grad_(True)
    with routing.capture() as log:
        out = m(xl)
    for br, d in m.routes(S, xl.device, dtype).items():
        record.expect_ran(log, "prefill", br, d.backend)
    out.float().square().sum().backward()
    assert torch.isfinite(xl.grad).all(), "non-finite input gradient"
    bad = [n for n, p in m.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite parameter gradients: {bad}"
    record.check("out", out, ref32["out"], ref_lp and ref_lp["out"], dtype=dtype)
    record.assert_ok()
