"""Every chunked code path at the sizes where it branches: the torch branches and block selection
process query rows in chunks of ``torch_branches.CHUNK``; here the rows span one chunk exactly, one
chunk and a row, and two chunks plus a ragged last one, in prefill and in decode steps that start
past the first chunk, each against the fp32 oracle (which chunks differently)."""
import pytest
import torch

from nsa_core import DecodeCache, NSAAttention, reference, tiny
from nsa_core import torch_branches as tb

C = tb.CHUNK
CFG = tiny(n_selected=5, window=40)


@pytest.mark.parametrize("S", [C, C + 1, 2 * C + 37], ids=lambda S: f"S{S}")
def test_prefill_branches_and_selection_across_chunks(S):
    torch.manual_seed(S)
    m = NSAAttention(CFG)
    x = torch.randn(2, S, CFG.d_model)
    ref = reference.forward(m, x)
    with torch.no_grad():
        idx = m.select(x)
        assert torch.equal(idx, ref["idx"]), "selected blocks differ from the oracle's"
        for br in ("cmp", "sel", "win"):
            out = m(x, only=br)
            want = reference.forward(m, x, only=br)["out"]
            err = (out - want).abs().max().item()
            assert err < 1e-4, f"{br}: max-abs {err:.2e} vs the oracle (rows {C}.. {S - 1} cross a chunk)"


def test_decode_rows_past_the_first_chunk_match_the_oracle():
    torch.manual_seed(0)
    m = NSAAttention(CFG)
    P, steps = 2 * C + 30, 12             # decode from inside the third chunk, across no boundary issue
    x = torch.randn(1, P + steps, CFG.d_model)
    ref = reference.forward(m, x)["out"]
    cache = DecodeCache(CFG, 1, P + steps)
    with torch.no_grad():
        m.fill_cache(x[:, :P], cache)
        for t in range(P, P + steps):
            out, _ = m.decode(x[:, t:t + 1], cache)
            assert (out[:, 0] - ref[:, t]).abs().max().item() < 1e-4, f"decode row {t}"


@pytest.mark.parametrize("pairs", [1, 7, 10**6], ids=["one-pair-a-piece", "ragged-pieces", "whole-chunks"])
def test_pieces_of_a_chunk_match_the_oracle(monkeypatch, pairs):
    """A chunk's (batch row, query row) pairs attended in pieces of ``pairs`` pairs (``_pieces``): one pair
    a piece, pieces of 7 that split the rows raggedly, whole chunks; prefill over two chunks and decode
    steps of three batch rows, each branch against the oracle."""
    torch.manual_seed(pairs)
    m = NSAAttention(CFG)
    S, B = C + 9, 3
    x = torch.randn(B, S, CFG.d_model)
    real = tb._pieces
    monkeypatch.setattr(tb, "_pieces", lambda B, c, pair, _: real(B, c, pair, pairs * pair))
    ref = reference.forward(m, x)
    with torch.no_grad():
        for br in ("cmp", "sel", "win"):
            err = (m(x, only=br) - reference.forward(m, x, only=br)["out"]).abs().max().item()
            assert err < 1e-4, f"prefill {br}: max-abs {err:.2e} vs the oracle"
        P = S - 4
        cache = DecodeCache(CFG, B, S)
        m.fill_cache(x[:, :P], cache)
        for t in range(P, S):
            out, _ = m.decode(x[:, t:t + 1], cache)
            err = (out[:, 0] - ref["out"][:, t]).abs().max().item()
            assert err < 1e-4, f"decode row {t}: max-abs {err:.2e} vs the oracle"


def test_selected_rows_of_a_strided_cache_equal_a_contiguous_ones():
    """``sel_attention`` copies the selected rows by ``index_select`` on a contiguous cache and by indexing on any
    other (a view into a wider tensor here): the same rows, so the same output, bit for bit."""
    torch.manual_seed(3)
    m = NSAAttention(CFG)
    x = torch.randn(2, 70, CFG.d_model)
    with torch.no_grad():
        q, k, v = m.project(x)
        idx = m.select(x)
        wide = lambda t: torch.cat([t, torch.full_like(t, float("nan"))], -1)[..., :t.shape[-1]]  # noqa: E731
        assert k.is_contiguous() and not wide(k).is_contiguous()
        assert torch.equal(tb.sel_attention(q, k, v, idx, CFG), tb.sel_attention(q, wide(k), wide(v), idx, CFG))
