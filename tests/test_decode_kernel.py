"""The Triton decode step (kernels/decode.py) against the fp32 oracle's row t, and its measured
reads against the SPEC §3 formula, at positions around every boundary (t < l, t < w, partial
blocks, more causal blocks than n). Runs under the interpreter without a GPU."""
import pytest
import torch

from nsa_core import DecodeCache, NSAAttention, reference, routing, tiny
from nsa_core import torch_branches as tb
from nsa_validate.tolerance import compare

# the cache is NaN-poisoned past the prefill: under the interpreter a read of it warns, and fails
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFG = tiny(block_size=16, n_selected=4, window=20)
POSITIONS = [0, CFG.cmp_len - 2, CFG.cmp_len - 1, 17, CFG.window, 47, 80, 99]


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def layer(request):
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[request.param]
    m = NSAAttention(CFG).to(DEV).to(dtype)
    x = torch.randn(2, 100, CFG.d_model, device=DEV).to(dtype)
    return m, x, dtype


@pytest.mark.parametrize("t", POSITIONS)
def test_decode_step_matches_oracle_row_and_reads_formula(t, layer):
    from kernels.decode import decode_step
    m, x, dtype = layer
    with torch.no_grad():
        q, k, v = m._qkv(x[:, :t + 1])
        cache = DecodeCache(CFG, 2, 100, device=DEV, dtype=dtype)
        cache.write_prefill(k, v, m.cmp_k(k), m.cmp_v(v))
        idx = tb.select_blocks(q[:, t:t + 1], cache.k_cmp[:, :cache.n_cmp], CFG, start=t)[:, 0]
        pos = torch.full((2,), t, dtype=torch.int32, device=DEV)
        with routing.capture() as log:
            outs, reads = decode_step(q[:, t], cache.k, cache.v, cache.k_cmp, cache.v_cmp, idx, pos, CFG)
        assert all(log.ran("decode", br, "triton") for br in ("cmp", "sel", "win"))
        full_idx = m.select(x[:, :t + 1])
        full_idx[:, t] = idx
        ref = reference.forward(m, x[:, :t + 1], idx=full_idx)
        ref_lp = None if dtype == torch.float32 else reference.forward(m, x[:, :t + 1], idx=full_idx, dtype=dtype)
    for br in ("cmp", "sel", "win"):
        lp = None if ref_lp is None else ref_lp[f"o_{br}"][:, t]
        r = compare(outs[br], ref[f"o_{br}"][:, t], lp, dtype=dtype)
        assert r["ok"], (br, r)
        want = CFG.expected_reads(t)[br]
        assert (reads[br] == want).all(), (br, reads[br].tolist(), want)


@pytest.mark.parametrize("t", POSITIONS)
def test_static_selection_equals_prefill_selection(t):
    """select_blocks_at (static shapes, whole NaN-poisoned cache) == select_blocks at start = t."""
    torch.manual_seed(t)
    m = NSAAttention(CFG).to(DEV)
    x = torch.randn(2, 100, CFG.d_model, device=DEV)
    with torch.no_grad():
        q, k, v = m._qkv(x[:, :t + 1])
        cache = DecodeCache(CFG, 2, 100, device=DEV)
        cache.write_prefill(k, v, m.cmp_k(k), m.cmp_v(v))
        want = tb.select_blocks(q[:, t:t + 1], cache.k_cmp[:, :cache.n_cmp], CFG, start=t)[:, 0]
        got = tb.select_blocks_at(q[:, t], cache.k_cmp, torch.full((2,), t, device=DEV), CFG, 100)
    assert torch.equal(got, want)


def test_module_decode_on_the_kernel_matches_oracle_rows_and_counts_reads():
    """NSAAttention.decode routed to the kernel (profile decode_backend: triton): prefill 10 tokens,
    decode the rest; every step's output equals oracle row t and its reads equal the formula."""
    from nsa_core.routing import RoutingPolicy
    torch.manual_seed(1)
    m = NSAAttention(CFG, RoutingPolicy(decode_backend="triton")).to(DEV)
    x = torch.randn(2, 90, CFG.d_model, device=DEV)
    P = 10
    cache = DecodeCache(CFG, 2, 90, device=DEV)
    steps, idx = [], []
    with torch.no_grad(), routing.capture() as log:
        m(x[:, :P], cache=cache)
        for t in range(P, 90):
            steps.append(m.decode(x[:, t:t + 1], cache))
            idx.append(cache.idx)
            want = CFG.expected_reads(t)
            for br in ("cmp", "sel", "win"):
                assert (cache.reads[br] == want[br]).all(), (t, br, cache.reads[br].tolist(), want[br])
    assert all(log.ran("decode", br, "triton") == 90 - P for br in ("cmp", "sel", "win"))
    full_idx = torch.cat([m.select(x)[:, :P], torch.stack(idx, 1)], 1)
    ref = reference.forward(m, x, idx=full_idx)["out"][:, P:]
    r = compare(torch.cat(steps, 1), ref, None, dtype=torch.float32)
    assert r["ok"], r
