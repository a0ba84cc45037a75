"""The three prefill branches, block selection and the gated mix as one differentiable op, for a
layer that runs all of them on the Triton kernels.

Apart, each branch is an autograd op of its own and so is the mix: the mix's backward writes
g_b·dO for every branch (three [T, H, d_v] tensors: 1 GiB each at 64k with 64 heads) for the
branches to read back, and autograd adds up the three branches' dq (and the selection and window
branches' dk and dv) with an elementwise add each. Here the backward gives every branch's kernels
the mix's dO and the branch's gate column instead: the gate folds into each row's log-sum-exp
(``common.gated_lse``: g·P = exp2(s − (lse2 − log2 g)), so the kernels' loops are unchanged),
the dq kernel writes the gate's gradient rowsum(dO ∘ O_b) beside delta, and the second and third
branches add their dq, dk, dv to the first's in the kernels' own stores (fp32 sums, rounded once
per branch). The forward is five launches (compressed, scoring + top-n, selection, its dense
prefix, window): the window kernel takes the gate and the other two outputs and writes the gated
sum as well, so no pass of its own re-reads the three outputs. Where no gradient is wanted
(inference) the window's own output is not even stored, and nothing is kept for a backward.

The dense prefix: a query at a position t < n·l' has at most n causal blocks, so its selection is all
of them (block 0 and the local two forced, the top-n of the rest: every one), and its selected-block
attention is plain causal attention over tokens 0..t. Those rows run as tiles of consecutive queries
sharing every key load (the compressed kernels with l = d = 1 and ``q_end`` = n·l', as the window
runs on them) instead of one program per token loading its blocks; the selection kernels start at
position n·l' (``first_row``). block_idx still lists their blocks. In the layer the forward gained at short
lengths and forward + backward was unchanged: the dense backward costs about what the selection's saves
(docs/decisions.md).

The window does not depend on the other branches, but running it on a second stream beside them gained
nothing: the kernels before it fill the GPU, so it ran after them all the same. Nor did the backward's
branches on several streams (docs/decisions.md).

Layouts (packed variable length; cu_seqlens [B+1] int32, cu_cmp [B+1] int32 of the compressed
tokens): g [T, H, 3] (cmp, sel, win); q [T, H, d_k]; k [T, G, d_k], v [T, G, d_v]; k_cmp
[N, G, d_k], v_cmp [N, G, d_v] -> (o [T, H, d_v], block_idx [T, G, n] int32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import compressed, scoring, selection, window


@dataclass(frozen=True)
class Shape:
    """What the kernels take besides tensors (NSA's config and the batch's longest sequence)."""
    cmp_len: int
    cmp_stride: int
    block_size: int
    n_selected: int
    window: int
    scale: float
    max_seqlen: int


def _prefix(sh: Shape) -> int:
    """n·l': the positions whose selection is every causal block (the dense prefix)."""
    return sh.n_selected * sh.block_size


def _forward(g, q, k, v, k_cmp, v_cmp, cu, cu_cmp, sh: Shape, keep: bool):
    """(o, idx, and with ``keep`` what the backward reads: o_b and lse_b of every branch)."""
    # (no profiler range per stage: torch.profiler attributes no Triton kernel to one, so the
    # kernels are attributed to the whole op, and the suites look for them block-wide)
    o_cmp, lse_cmp = compressed.compressed_attention_fwd(q, k_cmp, v_cmp, sh.cmp_len, sh.cmp_stride, cu, cu_cmp,
                                                         scale=sh.scale, max_seqlen=sh.max_seqlen)
    idx = scoring.select_blocks(q, k_cmp, lse_cmp, sh.cmp_len, sh.cmp_stride, sh.block_size, sh.n_selected,
                                cu, cu_cmp, scale=sh.scale, max_seqlen=sh.max_seqlen)
    P = _prefix(sh)
    o_sel, lse_sel = selection.selection_attention_fwd(q, k, v, idx, sh.block_size, cu, scale=sh.scale,
                                                       max_seqlen=sh.max_seqlen, first_row=P)
    compressed.compressed_attention_fwd(q, k, v, 1, 1, cu, cu, scale=sh.scale, max_seqlen=sh.max_seqlen,
                                        out=o_sel, lse=lse_sel, q_end=P)
    o_win, lse_win, o = window.window_attention_fwd(q, k, v, sh.window, cu, scale=sh.scale, max_seqlen=sh.max_seqlen,
                                                    mix=(g, o_cmp, o_sel), keep_o=keep)
    return o, idx, ((o_cmp, lse_cmp, o_sel, lse_sel, o_win, lse_win) if keep else None)


class _Branches(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, q, k, v, k_cmp, v_cmp, cu, cu_cmp, sh: Shape):
        o, idx, (o_cmp, lse_cmp, o_sel, lse_sel, o_win, lse_win) = _forward(g, q, k, v, k_cmp, v_cmp, cu, cu_cmp, sh,
                                                                              keep=True)
        ctx.save_for_backward(g, q, k, v, k_cmp, v_cmp, cu, cu_cmp, idx, o_cmp, lse_cmp, o_sel, lse_sel, o_win, lse_win)
        ctx.sh = sh
        ctx.mark_non_differentiable(idx)
        return o, idx

    @staticmethod
    def backward(ctx, do, _didx):
        g, q, k, v, k_cmp, v_cmp, cu, cu_cmp, idx, o_cmp, lse_cmp, o_sel, lse_sel, o_win, lse_win = ctx.saved_tensors
        sh = ctx.sh
        do = do.contiguous()
        dg = torch.empty_like(g)
        (g_cmp, g_sel, g_win), (dg_cmp, dg_sel, dg_win) = g.unbind(-1), dg.unbind(-1)     # [T, H] views
        dq, dk_cmp, dv_cmp = compressed.compressed_attention_bwd(
            do, q, k_cmp, v_cmp, o_cmp, lse_cmp, sh.cmp_len, sh.cmp_stride, cu, cu_cmp, scale=sh.scale,
            max_seqlen=sh.max_seqlen, gate=g_cmp, dgate=dg_cmp)
        _, dk, dv = selection.selection_attention_bwd(
            do, q, k, v, o_sel, lse_sel, idx, sh.block_size, cu, scale=sh.scale, max_seqlen=sh.max_seqlen,
            dq=dq, gate=g_sel, dgate=dg_sel, accumulate=True, first_row=_prefix(sh))
        compressed.compressed_attention_bwd(
            do, q, k, v, o_sel, lse_sel, 1, 1, cu, cu, scale=sh.scale, max_seqlen=sh.max_seqlen, gate=g_sel,
            dgate=dg_sel, dq=dq, dk=dk, dv=dv, accumulate=True, q_end=_prefix(sh))
        compressed.compressed_attention_bwd(
            do, q, k, v, o_win, lse_win, 1, 1, cu, cu, scale=sh.scale, max_seqlen=sh.max_seqlen, window=sh.window,
            gate=g_win, dgate=dg_win, dq=dq, dk=dk, dv=dv, accumulate=True)
        return dg, dq, dk, dv, dk_cmp, dv_cmp, None, None, None


def nsa_branches(g, q, k, v, k_cmp, v_cmp, cu_seqlens, cu_cmp, sh: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_b g_b·o_b over the compressed, selected and window branches, the blocks selected from the
    compressed branch's probabilities: (o [T, H, d_v], block_idx [T, G, n] int32), differentiable
    in g, q, k, v, k_cmp and v_cmp (see the module docstring for layouts)."""
    if g.shape != (*q.shape[:2], 3):
        raise ValueError(f"g must be [T, H, 3] = [{q.shape[0]}, {q.shape[1]}, 3]; got {tuple(g.shape)}")
    args = (g.contiguous(), q, k, v, k_cmp, v_cmp, cu_seqlens, cu_cmp, sh)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (g, q, k, v, k_cmp, v_cmp)):
        return _Branches.apply(*args)
    o, idx, _ = _forward(*args, keep=False)
    return o, idx
