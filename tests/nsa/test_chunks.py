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
