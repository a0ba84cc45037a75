"""φ, the compression MLP: the module's against the oracle's, and its recompute-in-backward (long training
inputs) against the plain path."""
import pytest
import torch

import nsa_core.module as module
from nsa_core import NSAAttention, reference
from nsa_core.config import tiny


def _grads(m, x):
    return torch.autograd.grad(m(x).square().sum(), [x, *m.parameters()])


def test_recomputed_phi_matches(monkeypatch):
    torch.manual_seed(0)
    m = NSAAttention(tiny(d_model=32, n_kv_heads=2))
    x = torch.randn(2, 100, 32, requires_grad=True)
    plain = _grads(m, x)
    calls = []
    monkeypatch.setattr(module, "RECOMPUTE_PHI_FROM", 0)
    monkeypatch.setattr(module, "checkpoint", lambda *a, **k: calls.append(1) or torch.utils.checkpoint.checkpoint(*a, **k))
    recomputed = _grads(m, x)
    assert len(calls) == 2, "φ of k and of v must both take the recompute path"
    for a, b in zip(plain, recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("cmp_len,cmp_stride", [(8, 4), (12, 4), (4, 4), (6, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("S", [3, 8, 9, 37], ids=lambda s: f"S{s}")
def test_phi_matches_the_oracle(cmp_len, cmp_stride, S):
    """φ as the module computes it (over whole strides where l is a multiple of d, l = 8 / 12 / 4; over
    gathered spans otherwise, l = 6) equals the oracle's span-by-span loop, forward and every gradient
    (of kv, pe, fc1, fc2), in fp64; S runs from no complete span to spans with tokens left over."""
    torch.manual_seed(S + cmp_len)
    cfg = tiny(d_model=32, n_kv_heads=2, cmp_len=cmp_len, cmp_stride=cmp_stride)
    phi = module.Compressor(cfg, 8).double()
    kv = torch.randn(2, S, cfg.n_kv_heads, 8, dtype=torch.float64, requires_grad=True)
    params = [phi.pe, phi.fc1.weight, phi.fc1.bias, phi.fc2.weight, phi.fc2.bias]
    got = phi(kv)
    want = reference.compress(kv, cfg, *params)
    assert got.shape == want.shape == (2, cfg.n_cmp_total(S), cfg.n_kv_heads, 8)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if got.numel():
        dout = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad(got, [kv, *params], dout), torch.autograd.grad(want, [kv, *params], dout)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
