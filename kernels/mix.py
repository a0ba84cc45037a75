"""Triton gated mix of the three NSA branches: o = g_cmp·o_cmp + g_sel·o_sel + g_win·o_win.

The torch path (``NSAAttention.mix``) runs three elementwise ops forward and, through autograd,
a product and a reduction per branch backward, each a full pass over [T, H, d_v]; at 64k with 64
heads every pass is 1 GiB. This is one pass each way: the forward reads the three outputs once and
writes o; the backward reads dO and the three outputs once and writes the three branch gradients
and dg. Sums are taken in fp32 and rounded once.

Layouts (R = B·S·H rows of one head's output):
    g      [R, 3]       the gate (cmp, sel, win), any float dtype, contiguous in its last dim
    parts  3 × [R, d_v] the branch outputs, contiguous in their last dim
    o      [R, d_v]     dtype of the parts
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import load_2d, store_2d
from nsa_core import dispatch


@triton.jit
def _rows(P, r, ok, sr, DV: tl.constexpr, BDV: tl.constexpr):
    """Rows r of P as fp32 [BR, BDV] (zero past DV and where not ``ok``)."""
    return load_2d(P, r * sr, ok, DV, BDV).to(tl.float32)


@triton.jit
def _gates(G, r, ok, sg):
    """The three gate values of rows r, fp32 [BR] each."""
    return (tl.load(G + r * sg, mask=ok, other=0.0).to(tl.float32),
            tl.load(G + r * sg + 1, mask=ok, other=0.0).to(tl.float32),
            tl.load(G + r * sg + 2, mask=ok, other=0.0).to(tl.float32))


@triton.jit
def gated_sum(G, gbase, OC, OS, ow, base, ok, DV: tl.constexpr, BDV: tl.constexpr):
    """g₀·OC + g₁·OS + g₂·ow in fp32 [rows, BDV]: the gate's three values at G + gbase (+1, +2),
    the rows of OC and OS at ``base``, ow the third output's rows (fp32). The window kernel's
    epilogue (``kernels.compressed``, with the mix) computes the sum with it too."""
    g0, g1, g2 = _gates(G, gbase, ok, 1)
    return (g0[:, None] * _rows(OC, base, ok, 1, DV, BDV) + g1[:, None] * _rows(OS, base, ok, 1, DV, BDV)
            + g2[:, None] * ow)


@triton.jit
def _mix_fwd_kernel(G, OC, OS, OW, O, R, sg, so, DV: tl.constexpr, BR: tl.constexpr, BDV: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    ok = r < R
    o = gated_sum(G, r * sg, OC, OS, _rows(OW, r, ok, so, DV, BDV), r * so, ok, DV, BDV)
    store_2d(O, r * so, o, ok, DV, BDV)


@triton.jit
def _mix_bwd_kernel(G, OC, OS, OW, DO, DG, DOC, DOS, DOW, R, sg, so,
                    DV: tl.constexpr, BR: tl.constexpr, BDV: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    ok = r < R
    do = _rows(DO, r, ok, so, DV, BDV)
    g0, g1, g2 = _gates(G, r, ok, sg)
    store_2d(DOC, r * so, g0[:, None] * do, ok, DV, BDV)
    store_2d(DOS, r * so, g1[:, None] * do, ok, DV, BDV)
    store_2d(DOW, r * so, g2[:, None] * do, ok, DV, BDV)
    tl.store(DG + r * 3, tl.sum(do * _rows(OC, r, ok, so, DV, BDV), 1).to(DG.dtype.element_ty), mask=ok)
    tl.store(DG + r * 3 + 1, tl.sum(do * _rows(OS, r, ok, so, DV, BDV), 1).to(DG.dtype.element_ty), mask=ok)
    tl.store(DG + r * 3 + 2, tl.sum(do * _rows(OW, r, ok, so, DV, BDV), 1).to(DG.dtype.element_ty), mask=ok)


# -- launchers -----------------------------------------------------------------------------
def launch_config(BDV: int) -> dict:
    """BR rows per program: a few KiB of each operand in flight per warp (bandwidth-bound)."""
    return {"BR": max(1, 4096 // BDV), "num_warps": 4}


def _flat(g: torch.Tensor, parts: tuple[torch.Tensor, ...]):
    R, dv = parts[0].numel() // parts[0].shape[-1], parts[0].shape[-1]
    g2 = g.reshape(R, 3)
    ps = [p.reshape(R, dv) for p in parts]
    if any(p.stride(0) != dv or p.stride(1) != 1 for p in ps):
        ps = [p.contiguous() for p in ps]
    return g2.contiguous(), ps, R, dv


def mix_fwd(g: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """o [..., d_v] = Σ_i g[..., i:i+1]·parts[i], with g [..., 3] and parts three [..., d_v]."""
    g2, (oc, os_, ow), R, dv = _flat(g, parts)
    o = torch.empty_like(oc)
    if R:
        BDV = triton.next_power_of_2(dv)
        lc = launch_config(BDV)
        BR = lc.pop("BR")
        _mix_fwd_kernel[(triton.cdiv(R, BR),)](g2, oc, os_, ow, o, R, g2.stride(0), dv, DV=dv, BR=BR, BDV=BDV, **lc)
        dispatch.note("kernel", "mix_fwd", "triton")
    return o.view(parts[0].shape)


def mix_bwd(do: torch.Tensor, g: torch.Tensor, parts: tuple[torch.Tensor, ...]):
    """(dg [..., 3] in g's dtype, (d parts[i] = g_i·dO in the parts' dtype))."""
    g2, (oc, os_, ow), R, dv = _flat(g, parts)
    do2 = do.reshape(R, dv).contiguous()
    dg = torch.empty(R, 3, device=g.device, dtype=g.dtype)
    dps = [torch.empty_like(oc) for _ in range(3)]
    if R:
        BDV = triton.next_power_of_2(dv)
        lc = launch_config(BDV)
        BR = lc.pop("BR")
        _mix_bwd_kernel[(triton.cdiv(R, BR),)](g2, oc, os_, ow, do2, dg, *dps, R, g2.stride(0), dv,
                                              DV=dv, BR=BR, BDV=BDV, **lc)
        dispatch.note("kernel", "mix_bwd", "triton")
    return dg.view(g.shape), tuple(d.view(parts[0].shape) for d in dps)


class _Mix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, o_cmp, o_sel, o_win):
        ctx.save_for_backward(g, o_cmp, o_sel, o_win)
        return mix_fwd(g, (o_cmp, o_sel, o_win))

    @staticmethod
    def backward(ctx, do):
        g, *parts = ctx.saved_tensors
        dg, dps = mix_bwd(do, g, tuple(parts))
        return (dg, *dps)


def gated_mix(g: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor) -> torch.Tensor:
    """NSA's gated sum of the branch outputs, differentiable in all four inputs.

    g [..., H, 3] the gate (cmp, sel, win); o_* [..., H, d_v] one dtype -> o [..., H, d_v] in that
    dtype, summed in fp32. Equal to ``g[..., 0:1]·o_cmp + g[..., 1:2]·o_sel + g[..., 2:3]·o_win``.
    """
    if not (o_cmp.shape == o_sel.shape == o_win.shape) or g.shape != (*o_cmp.shape[:-1], 3):
        raise ValueError(f"g must be [..., 3] over the outputs' [..., d_v]; got g {tuple(g.shape)}, "
                         f"outputs {tuple(o_cmp.shape)}, {tuple(o_sel.shape)}, {tuple(o_win.shape)}")
    if not (o_cmp.dtype == o_sel.dtype == o_win.dtype):
        raise ValueError(f"the branch outputs must share one dtype; got {o_cmp.dtype}, {o_sel.dtype}, {o_win.dtype}")
    return _Mix.apply(g, o_cmp, o_sel, o_win)
