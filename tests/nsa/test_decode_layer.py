"""kernels.decode_layer.LayerDecodeStep (the whole layer's decode step as device operations of
fixed shapes) gives what NSAAttention.decode gives, step after step, across compressed-span
completions, from a prefilled and from an empty cache."""
import pytest
import torch

from nsa_core import DecodeCache, NSAAttention, tiny
from nsa_core.routing import RoutingPolicy

pytest.importorskip("triton")
from kernels import routes  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFGS = {"mlp": tiny(d_model=32, n_kv_heads=2),
        # φ = mean, a span length that is no power of two
        "mean-l6": tiny(d_model=32, n_kv_heads=2, compress="mean", cmp_len=6, cmp_stride=3)}


@pytest.mark.parametrize("phi", list(CFGS))
@pytest.mark.parametrize("prefill", [0, 21])
def test_layer_step_equals_module_decode(prefill, phi):
    CFG = CFGS[phi]
    why = routes.triton_unavailable(cfg=CFG, device=DEV, dtype=torch.float32)
    if why:
        pytest.skip(f"Triton decode kernel cannot run here: {why}")
    from kernels.decode_layer import LayerDecodeStep
    torch.manual_seed(4)
    m = NSAAttention(CFG, RoutingPolicy(decode_backend="triton")).to(DEV)
    steps = 2 * CFG.cmp_len + 3                                    # several spans complete
    x = torch.randn(2, prefill + steps, CFG.d_model, device=DEV)
    ref_cache, cache = (DecodeCache(CFG, 2, prefill + steps, device=DEV) for _ in range(2))
    with torch.no_grad():
        if prefill:
            m(x[:, :prefill], cache=ref_cache)
            m(x[:, :prefill], cache=cache)
        step = LayerDecodeStep(m, cache)
        for t in range(prefill, prefill + steps):
            want, info = m.decode(x[:, t:t + 1], ref_cache)
            got = step(x[:, t:t + 1])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"t={t}")
            assert torch.equal(step.last.idx.long(), info.idx), f"t={t}: selected blocks differ"
    assert cache.length == ref_cache.length and int(cache.pos[0]) == prefill + steps - 1
    n = CFG.n_cmp_total(prefill + steps)
    torch.testing.assert_close(cache.k_cmp[:, :n], ref_cache.k_cmp[:, :n], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache.v_cmp[:, :n], ref_cache.v_cmp[:, :n], rtol=1e-6, atol=1e-6)
    assert torch.isnan(cache.k_cmp[:, n:]).all(), "a compressed slot past the spans was written"
