"""φ's recompute-in-backward (long training inputs) gives the gradients of the plain path."""
import torch

import nsa_core.module as module
from nsa_core import NSAAttention
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
