"""The oracle's own properties (acceptance (a)–(d) of the foundation issue), on the CPU."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from nsa_core import BRANCHES, DecodeCache, NSAAttention, reference, tiny
from nsa_core import torch_branches as tb


def _layer(seed=0, **cfg):
    torch.manual_seed(seed)
    c = tiny(**cfg)
    return NSAAttention(c), c


def brute_topn(scores, t, cfg):
    """Top-n by the words of docs/nsa.md, one query, one group, in plain Python."""
    nb_causal = t // cfg.block_size + 1
    cur = t // cfg.block_size
    forced = sorted({0, cur, max(cur - 1, 0)})
    rest = [j for j in range(nb_causal) if j not in forced]
    rest.sort(key=lambda j: (-scores[j], j))
    chosen = sorted(forced + rest[:max(0, cfg.n_selected - len(forced))])
    return chosen + [-1] * (cfg.n_selected - len(chosen))


@pytest.mark.parametrize("seed", range(4))
def test_topn_matches_brute_force_both_paths(seed):
    cfg = tiny()
    torch.manual_seed(seed)
    S = 70
    NB = cfg.n_blocks(S)
    scores = torch.randint(0, 4, (1, S, 1, NB)).float()       # many exact ties on purpose
    pos = torch.arange(S)
    a = reference.select_blocks(scores, pos, cfg)
    b = tb.topn_blocks(scores, pos, cfg)
    for t in range(S):
        want = brute_topn(scores[0, t, 0].tolist(), t, cfg)
        assert a[0, t, 0].tolist() == want, f"oracle t={t}"
        assert b[0, t, 0].tolist() == want, f"fast path t={t}"


def test_selected_set_holds_block0_and_local_blocks():
    m, cfg = _layer(1)
    x = torch.randn(2, 90, cfg.d_model)
    idx = reference.forward(m, x)["idx"]
    for t in range(90):
        cur = t // cfg.block_size
        for b, g in itertools.product(range(2), range(cfg.n_kv_heads)):
            s = set(idx[b, t, g].tolist())
            assert {0, cur, max(cur - 1, 0)} <= s, (t, s)
            assert max(s) <= cur


def test_prefill_then_decode_equals_one_prefill_row_by_row():
    m, cfg = _layer(2)
    x = torch.randn(2, 50, cfg.d_model)
    full = reference.forward(m, x)["out"]
    cache = DecodeCache(cfg, 2, 50)
    pre = m(x[:, :17], cache=cache)
    rows = [m.decode(x[:, t:t + 1], cache)[0] for t in range(17, 50)]
    got = torch.cat([pre] + rows, 1)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("branch", ["sel", "win"])
def test_sel_and_win_equal_full_causal_when_covering_everything(branch):
    S = 40
    m, cfg = _layer(3, n_selected=8, window=64)       # n·l' = 64 >= S, w >= S
    x = torch.randn(2, S, cfg.d_model)
    out = reference.forward(m, x, only=branch)
    P = dict(m.named_parameters())
    q = (x @ P["q_proj.weight"].T).view(2, S, cfg.n_heads, cfg.d_k).transpose(1, 2)
    k = (x @ P["k_proj.weight"].T).view(2, S, cfg.n_kv_heads, cfg.d_k).transpose(1, 2)
    v = (x @ P["v_proj.weight"].T).view(2, S, cfg.n_kv_heads, cfg.d_v).transpose(1, 2)
    rep = cfg.heads_per_group
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    torch.testing.assert_close(out[f"o_{branch}"], dense.transpose(1, 2), rtol=0, atol=1e-5)


@pytest.mark.parametrize("S", [1, 5, 7])
def test_no_nan_for_t_below_l_including_gradients(S):
    m, cfg = _layer(4)
    assert S < cfg.cmp_len
    x = torch.randn(2, S, cfg.d_model, requires_grad=True)
    r = reference.forward(m, x)
    assert torch.equal(r["o_cmp"], torch.zeros_like(r["o_cmp"])), "no compressed token yet: zero output"
    for out in (r["out"], m(x)):
        assert torch.isfinite(out).all()
        (g,) = torch.autograd.grad(out.square().sum(), x)
        assert torch.isfinite(g).all()


def test_reads_formula_matches_definition():
    cfg = tiny()
    for t in range(200):
        nb = t // cfg.block_size + 1
        sel = sum(min((j + 1) * cfg.block_size, t + 1) - j * cfg.block_size
                  for j in brute_topn([0.0] * nb, t, cfg) if j >= 0)
        assert cfg.expected_reads(t)["sel"] == sel


def test_decode_cache_is_poisoned_until_written():
    _, cfg = _layer()
    c = DecodeCache(cfg, 1, 10)
    assert torch.isnan(c.k).all() and torch.isnan(c.v_cmp).all()


def test_only_rejects_unknown_branch():
    m, cfg = _layer()
    with pytest.raises(ValueError):
        m(torch.randn(1, 4, cfg.d_model), only="dense")
    assert set(BRANCHES) == {"cmp", "sel", "win"}


@pytest.mark.parametrize("t", [0, 30, 31, 47, 99])
def test_decode_row_equals_the_prefill_oracle_row(t):
    """reference.decode_row from cache contents == reference.forward's row t (same definitions)."""
    torch.manual_seed(t)
    cfg = tiny(block_size=16, n_selected=4, window=20)
    m = NSAAttention(cfg)
    x = torch.randn(2, t + 1, cfg.d_model)
    with torch.no_grad():
        full = reference.forward(m, x)
        q, k, v = m.project(x)
        row = reference.decode_row(q[:, t], k, v, m.cmp_k(k), m.cmp_v(v), t, cfg)
    assert torch.equal(row["idx"], full["idx"][:, t])
    for br in BRANCHES:
        torch.testing.assert_close(row[f"o_{br}"], full[f"o_{br}"][:, t], rtol=1e-5, atol=1e-6)
