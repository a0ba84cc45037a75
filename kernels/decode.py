"""Triton NSA decode step: all three branches, all h heads of a KV group, split over the context.

One program per (batch row · KV head, chunk). The chunks of a step are laid out statically:
``C_CMP`` chunks over the compressed cache (tokens 0 .. n_cmp(t)−1), ``C_WIN`` chunks over the
window (positions max(0, t−w+1) .. t) and one chunk per selection slot (block j, positions
j·l' .. min(j·l'+l', t+1)−1). Each program loads only those tokens (masked loads: a token outside
its range is never read), computes an unnormalised partial softmax for the h query heads and
counts the tokens it used; ``decode_step`` merges the partials of each branch (log-sum-exp) and
sums the counts into the measured reads of SPEC §3. Shapes never depend on t (the position is a
device tensor), nothing syncs with the host, so a step can be captured in a CUDA graph.

Layouts: q [B, H, d_k] (the new token); k/v cache [B, Tmax, G, d]; k_cmp/v_cmp [B, Nmax, G, d];
idx [B, G, n] (selection blocks of this step, -1 unused); pos [B] int32 (t, the new token's
position, already written to the cache).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_core import routing
from nsa_core.config import NSAConfig

LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(Q, K, V, KC, VC, IDX, POS, PM, PL, PACC, PCNT,
                   sqb, sqh, skb, skt, skg, svb, svt, svg, skcb, skct, skcg, svcb, svct, svcg, sib, sig,
                   scale_log2,
                   G: tl.constexpr, H_PER_G: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
                   CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, C_CMP: tl.constexpr, C_WIN: tl.constexpr,
                   N_CHUNKS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BH: tl.constexpr, BN: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr):
    bg = tl.program_id(0)
    c = tl.program_id(1)
    b = bg // G
    g = bg % G
    t = tl.load(POS + b)
    rows = tl.arange(0, BH)
    row_ok = rows < H_PER_G
    offs_n = tl.arange(0, BN)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + (g * H_PER_G + rows)[:, None] * sqh + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    if c < C_CMP:
        # compressed token i is usable iff i·d + l − 1 <= t
        n_cmp = tl.where(t + 1 >= CMP_LEN, (t + 1 - CMP_LEN) // CMP_STRIDE + 1, 0)
        kpos = c * BN + offs_n
        valid = kpos < n_cmp
        kp = KC + b * skcb + kpos.to(tl.int64) * skct + g * skcg
        vp = VC + b * svcb + kpos.to(tl.int64) * svct + g * svcg
    elif c < C_CMP + C_WIN:
        lo = tl.maximum(t - WINDOW + 1, 0)
        kpos = lo + (c - C_CMP) * BN + offs_n
        valid = kpos <= t
        kp = K + b * skb + kpos.to(tl.int64) * skt + g * skg
        vp = V + b * svb + kpos.to(tl.int64) * svt + g * svg
    else:
        j = tl.load(IDX + b * sib + g * sig + (c - C_CMP - C_WIN))
        kpos = j * BLOCK + offs_n
        valid = (offs_n < BLOCK) & (kpos >= 0) & (kpos <= t)     # j = -1: an unused slot
        kp = K + b * skb + kpos.to(tl.int64) * skt + g * skg
        vp = V + b * svb + kpos.to(tl.int64) * svt + g * svg
    k = tl.load(kp[:, None] + offs_dk[None, :], mask=valid[:, None] & (offs_dk[None, :] < DK), other=0.0)
    v = tl.load(vp[:, None] + offs_dv[None, :], mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
    s = tl.where(valid[None, :], tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    out = (bg * N_CHUNKS + c).to(tl.int64)
    tl.store(PM + out * BH + rows, m)
    tl.store(PL + out * BH + rows, tl.sum(p, 1))
    tl.store(PACC + (out * BH + rows)[:, None] * BDV + offs_dv[None, :],
             tl.dot(p.to(v.dtype), v, input_precision=PREC))
    tl.store(PCNT + out, tl.sum(valid.to(tl.int32), 0))


def _merge(pm, pl, pacc):
    """Log-sum-exp merge of chunk partials [BG, C, BH(, BDV)] -> [BG, BH, BDV] (0 with no key)."""
    M = pm.amax(1, keepdim=True)
    w = torch.exp2(pm - torch.where(torch.isinf(M), torch.zeros_like(M), M))     # m = -inf -> 0
    L = (w * pl).sum(1)
    return (w[..., None] * pacc).sum(1) / torch.where(L == 0, torch.ones_like(L), L)[..., None]


def decode_step(q, k, v, k_cmp, v_cmp, idx, pos, cfg: NSAConfig, phase: str = "decode"):
    """One decode step's three branch outputs and measured reads.

    Returns ({"cmp"|"sel"|"win": o [B, H, d_v] in q's dtype}, {"cmp"|"sel"|"win": reads [B, G]
    int64 — tokens each KV head's program actually loaded and used}).
    """
    B, H, dk = q.shape
    G, h, dv = cfg.n_kv_heads, cfg.heads_per_group, cfg.d_v
    BN = max(16, triton.next_power_of_2(cfg.block_size))
    C_CMP = triton.cdiv(max(k_cmp.shape[1], 1), BN)
    C_WIN = triton.cdiv(cfg.window, BN) + 1        # a window not aligned to BN spans one more tile
    n = idx.shape[-1]
    NC = C_CMP + C_WIN + n
    BH, BDK, BDV = max(16, triton.next_power_of_2(h)), max(16, triton.next_power_of_2(dk)), \
        max(16, triton.next_power_of_2(dv))
    dev = q.device
    pm = torch.empty(B * G, NC, BH, device=dev, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(B * G, NC, BH, BDV, device=dev, dtype=torch.float32)
    pcnt = torch.empty(B * G, NC, device=dev, dtype=torch.int32)
    _decode_kernel[(B * G, NC)](
        q, k, v, k_cmp, v_cmp, idx, pos, pm, pl, pacc, pcnt,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2),
        idx.stride(0), idx.stride(1), cfg.scale * LOG2E,
        G=G, H_PER_G=h, BLOCK=cfg.block_size, WINDOW=cfg.window, CMP_LEN=cfg.cmp_len, CMP_STRIDE=cfg.cmp_stride,
        C_CMP=C_CMP, C_WIN=C_WIN, N_CHUNKS=NC, DK=dk, DV=dv, BH=BH, BN=BN, BDK=BDK, BDV=BDV,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    spans = {"cmp": slice(0, C_CMP), "win": slice(C_CMP, C_CMP + C_WIN), "sel": slice(C_CMP + C_WIN, NC)}
    outs, reads = {}, {}
    for br, sl in spans.items():
        o = _merge(pm[:, sl], pl[:, sl], pacc[:, sl])                            # [BG, BH, BDV]
        outs[br] = o.view(B, G, BH, BDV)[:, :, :h, :dv].reshape(B, H, dv).to(q.dtype)
        reads[br] = pcnt[:, sl].sum(1).view(B, G).long()
        routing.note(phase, br, "triton")
    return outs, reads
