"""The fp32 floor the suites hold fp32 cases to (``tolerance.FLOOR``) is one TF32 dots cannot meet.

The suites' fp32 cases (``suites/test_triton.py::FP32``, ``suites/test_decode.py::test_parity[fp32-S…]``)
are there to catch a kernel whose fp32 path rounds its dot inputs to TF32 (10-bit mantissa). This
pins that they can: the selection kernel compiled with TF32 dots fails ``tolerance.compare`` on fp32
inputs, and compiled as shipped (``kernels.common.precision``: IEEE for fp32) passes it. GPU only: the
Triton interpreter computes every fp32 dot in IEEE whatever it is asked.
"""
from __future__ import annotations

import pytest
import torch

from nsa_core import reference
from nsa_core.config import tiny
from nsa_validate.measure.tolerance import compare, explain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="TF32 exists only on a GPU (the interpreter computes fp32 dots in IEEE)")

S, G, h, D, L, N = 1100, 2, 2, 64, 64, 8


@pytest.mark.parametrize("prec", ["ieee", "tf32"])
def test_the_fp32_floor_fails_tf32_dots(prec, monkeypatch):
    from kernels import routes, selection
    if why := routes.triton_unavailable(device="cuda", dtype=torch.float32):
        pytest.skip(f"Triton kernels cannot run here: {why}")
    shipped = selection.precision(torch.float32)
    assert shipped == "ieee", f"kernels.common.precision gives {shipped!r} for fp32"
    monkeypatch.setattr(selection, "precision", lambda dtype: prec)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(S, n, D, device="cuda", generator=g) for n in (G * h, G, G))
    cfg = tiny(block_size=L, n_selected=N, n_kv_heads=G)
    scores = torch.rand(1, S, G, cfg.n_blocks(S), device="cuda", generator=g)
    idx = reference.select_blocks(scores, torch.arange(S, device="cuda"), cfg)[0]
    o, _ = selection.selection_attention_fwd(q, k, v, idx.to(torch.int32), L)
    pos = torch.arange(S, device="cuda")
    ref = reference.masked_attention(q.view(1, S, G, h, D), k[None], v[None],
                                     reference.selection_mask(cfg, idx[None], pos, S), D ** -0.5)
    m = compare(o, ref.reshape(S, G * h, D), None, dtype=torch.float32)
    assert m["ok"] == (prec == "ieee"), f"{prec} dots: {explain(m)}"
