"""Triton compressed attention (NSA's compressed branch): forward with log-sum-exp, and backward.

Query t of a sequence attends to the compressed tokens i of its own sequence with
i·d + l − 1 <= t (the span [i·d, i·d + l) is complete by then); a query that sees none
(t < l − 1) gets o = 0 and lse = +inf, never NaN. The log-sum-exp is what block scoring
(``kernels/scoring.py``) needs to turn the scores into the branch's probabilities.

Group-centric like the selection kernel: one program takes a tile of BT consecutive query tokens
and all h query heads of one KV group (BT·h rows of one ``tl.dot``), so every compressed key and
value it loads serves the whole group. The backward pass is two deterministic kernels, no atomics:

* ``_cmp_dq_kernel``   — query-centric like the forward; also writes delta = rowsum(dO ∘ O).
* ``_cmp_dkdv_kernel`` — key-centric: one program takes BC compressed tokens of one KV head and
  one of NSPLIT runs of the query tiles that can see them (t >= i·d + l − 1) and writes an fp32
  partial; ``_cmp_dkdv_reduce_kernel`` adds a chunk's partials in split order.

Layouts (packed variable length, like flash-attn's varlen API):
    q        [T, H, d_k]     H = G·h; head ``g*h + i`` belongs to KV head g
    k_cmp    [N, G, d_k]     compressed keys of every sequence, packed by ``cu_cmp``
    v_cmp    [N, G, d_v]     d_v may differ from d_k
    cu_seqlens [B + 1]       int32 boundaries of the raw sequences in T (empty sequences allowed)
    cu_cmp   [B + 1]         int32 boundaries of their compressed tokens in N
                             (N_b = n_cmp_total(S_b): (S_b − l) // d + 1 when S_b >= l, else 0)
    o        [T, H, d_v]     q's dtype
    lse      [T, H]          fp32 natural-log sum of exp of the scaled scores (+inf: no key)

Token offsets are 64-bit; memory is O(T + N), no T×N matrix anywhere.

The same kernels run the sliding-window branch (``kernels/window.py``): there the keys are the raw
tokens (l = d = 1, so key i ends at position i) and a constexpr WINDOW = w > 0 also hides the keys
that ended w or more positions before the query, so the loops start at the window's first chunk.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.common import (LOG2E, LOG2E_C, cu_or_one, descriptor, descriptors_dk, descriptors_usable, dkdv_update,
                            dot_dk, dq_update, fp32_compiled, gate_args, gated_lse, head_dim_parts, launch_fitting,
                            load_2d, load_dk, pow2, precision, sm_count, store_2d, store_dk, usable)
from kernels.mix import gated_sum
from nsa_core import dispatch


# -- kernels -------------------------------------------------------------------------------


@triton.jit
def _seq(CU, CUC, b):
    """Sequence b: (first token, length, first compressed token, compressed length)."""
    bos = tl.load(CU + b)
    cbos = tl.load(CUC + b)
    return bos, tl.load(CU + b + 1) - bos, cbos, tl.load(CUC + b + 1) - cbos


@triton.jit
def _tile_rows(t0, seq_len, g, H_PER_G: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """Rows of a tile of BT tokens × BH heads: (token position in its sequence, query head, valid)."""
    r = tl.arange(0, BT * BH)
    t_rel = t0 + r // BH
    hh = r % BH
    return t_rel, g * H_PER_G + hh, (t_rel < seq_len) & (hh < H_PER_G)


@triton.jit
def _program_tile(CU, CUC, q_end, H_PER_G: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """A (token tile, KV head, sequence) program's rows: (g, the tile's first token t0 in its
    sequence, the query rows' end in it (the sequence's length, at most ``q_end``), its first
    compressed token and compressed length, and per row of the tile: position in the sequence,
    query head, valid, packed row t (int64)). The caller acts only where t0 < that end."""
    g = tl.program_id(1)
    bos, seq_len, cbos, n_seq = _seq(CU, CUC, tl.program_id(2))
    seq_len = tl.minimum(seq_len, q_end)
    t0 = tl.program_id(0) * BT
    t_rel, head, ok = _tile_rows(t0, seq_len, g, H_PER_G, BT, BH)
    return g, t0, seq_len, cbos, n_seq, t_rel, head, ok, (bos + t_rel).to(tl.int64)


@triton.jit
def _chunk_bounds(t0, seq_len, n_seq, CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr):
    """The chunks of BC keys a tile of tokens [t0, t_last] walks, as (lo, a, b, hi): [a, b) every
    row sees whole (no mask), [lo, a) and [b, hi) need the per-element test. b: the keys the first
    token sees, cut to whole chunks; hi: those the last token sees. Without a window lo = a = 0;
    with one, the keys that ended by t − w are out of sight: lo starts at the first chunk the
    first token still sees, a at the first the last token sees whole."""
    t_last = tl.minimum(t0 + BT, seq_len) - 1
    hi = tl.minimum(_n_cmp(t_last, CMP_LEN, CMP_STRIDE), n_seq)
    b = tl.minimum(_n_cmp(t0, CMP_LEN, CMP_STRIDE), n_seq) // BC * BC
    lo = b * 0
    a = b * 0
    if WINDOW > 0:
        lo = _n_cmp(t0 - WINDOW, CMP_LEN, CMP_STRIDE) // BC * BC
        a = tl.minimum(tl.maximum(tl.cdiv(_n_cmp(t_last - WINDOW, CMP_LEN, CMP_STRIDE), BC) * BC, lo), b)
    return lo, a, b, hi


@triton.jit
def _load_tile(P, row0, head, base, ok, D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr, TMA: tl.constexpr,
               ZERO: tl.constexpr):
    """[ROWS, BD]: rows row0 .. row0 + ROWS of one head, zero past D and (ZERO) where ``ok`` is
    False. TMA: ``P`` is a descriptor of a [rows, heads, D] tensor with block [ROWS, 1, BD]
    (``common.descriptor``), zero-filled past the tensor's edges; rows of a neighbouring sequence
    are real data, so a caller whose rows may cross into one and meet p = 0 there sets ZERO (0·NaN
    is NaN). Else ``P`` is a pointer and ``base`` [ROWS] the rows' element offsets."""
    if TMA:
        x = P.load([row0, head, 0]).reshape(ROWS, BD)
        if ZERO:
            x = tl.where(ok[:, None], x, 0.0)
        return x
    else:
        return load_2d(P, base, ok, D, BD)


@triton.jit
def _load_tile_dk(PA, PB, row0, head, base, ok, D: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr,
                  ROWS: tl.constexpr, TMA: tl.constexpr, ZERO: tl.constexpr):
    """``_load_tile`` of d_k-wide rows as two power-of-two parts (``common.head_dim_parts``):
    ([ROWS, BDA], [ROWS, BDB]). TMA: ``PA`` / ``PB`` are descriptors with blocks [ROWS, 1, BDA] /
    [ROWS, 1, BDB] of the same tensor (``common.descriptors_dk``); else ``PA`` is a pointer and
    ``base`` [ROWS] the rows' element offsets. BDB = 0: one part, returned twice (unused)."""
    if TMA:
        a = PA.load([row0, head, 0]).reshape(ROWS, BDA)
        b = a
        if BDB > 0:
            b = PB.load([row0, head, BDA]).reshape(ROWS, BDB)
        if ZERO:
            a = tl.where(ok[:, None], a, 0.0)
            if BDB > 0:
                b = tl.where(ok[:, None], b, 0.0)
        return a, b
    else:
        return load_dk(PA + base, ok, D, BDA, BDB)


@triton.jit
def _n_cmp(t, CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr):
    """Keys that have ended by position t, i.e. with i·d + l − 1 <= t (integer division truncates:
    guard t + 1 < l, which also covers a negative t)."""
    return tl.where(t + 1 >= CMP_LEN, (t + 1 - CMP_LEN) // CMP_STRIDE + 1, 0)


@triton.jit
def _visible(i, inb, t_rel, ok, CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr):
    """Query at position t_rel uses key i (it ended, i·d + l − 1 <= t, and, with a window, within
    the last w positions, i·d + l − 1 > t − w); both valid. Keys and queries come as broadcastable
    vectors: i[None, :] with t_rel[:, None] gives [rows, BC], i[:, None] with t_rel[None, :] [BC, rows]."""
    end = i * CMP_STRIDE + CMP_LEN - 1
    vis = ok & inb & (end <= t_rel)
    if WINDOW > 0:
        vis = vis & (end > t_rel - WINDOW)
    return vis


@triton.jit
def _fwd_chunk(acc, m_i, l_i, qa, qb, c0, n_hi, cbos, g, t_rel, ok, KC, KCB, VC, skt, skh, svt, svh, scale_log2,
               CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BC: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr,
               WITH_O: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """One online-softmax step over compressed tokens [c0, c0 + BC). MASKED=False where every row
    of the tile sees every token of the chunk (no per-element visibility test). q and the keys
    come as two d_k parts (qa/qb, ``_load_tile_dk``)."""
    i = c0 + tl.arange(0, BC)
    inb = i < n_hi
    kc = (cbos + i).to(tl.int64)
    # a masked chunk's scores out of sight go to -inf below, so its keys need no zeroing; its values do
    ka, kb = _load_tile_dk(KC, KCB, cbos + c0, g, kc * skt + g * skh, inb, DK, BDA, BDB, BC, TMA, False)
    s = dot_dk(qa, qb, ka, kb, BDB, PREC) * scale_log2
    if MASKED:
        vis = _visible(i[None, :], inb[None, :], t_rel[:, None], ok[:, None], CMP_LEN, CMP_STRIDE, WINDOW)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no key yet keeps m = -inf; shift by 0 instead (no inf - inf)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if WITH_O:
        v = _load_tile(VC, cbos + c0, g, kc * svt + g * svh, inb, DV, BDV, BC, TMA, MASKED)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _fwd_program(Q, KC, KCB, VC, CU, CUC, O, LSE, GATE, OC, OS, OM,
                 sqt, sqh, skt, skh, svt, svh, sot, soh, slt, slh, sgt, sgh, scale_log2, q_end,
                 CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr, H_PER_G: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                 BC: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr,
                 WITH_O: tl.constexpr, TMA: tl.constexpr, MIX: tl.constexpr, KEEP_O: tl.constexpr):
    """o and lse of a tile of BT tokens × the h heads of KV head g (WITH_O=False: lse only, for
    block scoring when the compressed branch itself ran elsewhere). MIX: also the gated sum of
    this branch's output with two others, OM = g₀·OC + g₁·OS + g₂·O (GATE [T, H, 3] with strides
    sgt, sgh; OC, OS, OM with O's strides), in fp32 from the outputs as stored, rounded once --
    what ``kernels.mix`` computes, without its pass over the three outputs; KEEP_O=False: O
    itself is not stored (inference: nothing will read it)."""
    g, t0, seq_len, cbos, n_seq, t_rel, head, ok, t = _program_tile(CU, CUC, q_end, H_PER_G, BT, BH)
    if t0 < seq_len:
        qa, qb = load_dk(Q + t * sqt + head * sqh, ok, DK, BDA, BDB)
        lo, a, b, n_hi = _chunk_bounds(t0, seq_len, n_seq, CMP_LEN, CMP_STRIDE, WINDOW, BT, BC)
        m_i = tl.full([BT * BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BT * BH], tl.float32)
        acc = tl.zeros([BT * BH, BDV], tl.float32)
        if WINDOW > 0:
            for c0 in range(lo, a, BC):
                acc, m_i, l_i = _fwd_chunk(acc, m_i, l_i, qa, qb, c0, n_hi, cbos, g, t_rel, ok, KC, KCB, VC, skt, skh, svt, svh,
                                           scale_log2, CMP_LEN, CMP_STRIDE, WINDOW, DK, DV, BC, BDA, BDB, BDV, PREC, WITH_O,
                                           True, TMA)
        for c0 in range(a, b, BC):
            acc, m_i, l_i = _fwd_chunk(acc, m_i, l_i, qa, qb, c0, n_hi, cbos, g, t_rel, ok, KC, KCB, VC, skt, skh, svt, svh,
                                       scale_log2, CMP_LEN, CMP_STRIDE, WINDOW, DK, DV, BC, BDA, BDB, BDV, PREC, WITH_O,
                                       False, TMA)
        for c0 in range(b, n_hi, BC):
            acc, m_i, l_i = _fwd_chunk(acc, m_i, l_i, qa, qb, c0, n_hi, cbos, g, t_rel, ok, KC, KCB, VC, skt, skh, svt, svh,
                                       scale_log2, CMP_LEN, CMP_STRIDE, WINDOW, DK, DV, BC, BDA, BDB, BDV, PREC, WITH_O,
                                       True, TMA)
        empty = l_i == 0.0
        lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / LOG2E_C)
        tl.store(LSE + t * slt + head * slh, lse, mask=ok)
        if WITH_O:
            base = t * sot + head * soh
            o = acc / tl.where(empty, 1.0, l_i)[:, None]
            if MIX:
                o = o.to(O.dtype.element_ty).to(tl.float32)        # this branch's output as stored
                if KEEP_O:
                    store_2d(O, base, o, ok, DV, BDV)
                store_2d(OM, base, gated_sum(GATE, t * sgt + head * sgh, OC, OS, o, base, ok, DV, BDV), ok, DV, BDV)
            else:
                store_2d(O, base, o, ok, DV, BDV)


@triton.jit
def _cmp_fwd_kernel(Q, KC, KCB, VC, CU, CUC, O, LSE,
                    sqt, sqh, skt, skh, svt, svh, sot, soh, slt, slh, scale_log2, q_end,
                    CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr, H_PER_G: tl.constexpr,
                    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                    BC: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr,
                    WITH_O: tl.constexpr, TMA: tl.constexpr):
    _fwd_program(Q, KC, KCB, VC, CU, CUC, O, LSE, LSE, O, O, O,
                 sqt, sqh, skt, skh, svt, svh, sot, soh, slt, slh, 0, 0, scale_log2, q_end,
                 CMP_LEN, CMP_STRIDE, WINDOW, H_PER_G, DK, DV, BT, BH, BC, BDA, BDB, BDV, PREC, WITH_O, TMA,
                 False, True)


@triton.jit
def _prefix_fwd_kernel(Q, KC, KCB, VC, CU, CUC, O, LSE,
                       sqt, sqh, skt, skh, svt, svh, sot, soh, slt, slh, scale_log2, q_end,
                       CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr, H_PER_G: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                       BC: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr,
                       WITH_O: tl.constexpr, TMA: tl.constexpr):
    # _cmp_fwd_kernel under a name of its own, launched with q_end (the selection's dense prefix,
    # kernels/branches.py): the suites tell from the kernels the GPU ran that the prefix ran
    _fwd_program(Q, KC, KCB, VC, CU, CUC, O, LSE, LSE, O, O, O,
                 sqt, sqh, skt, skh, svt, svh, sot, soh, slt, slh, 0, 0, scale_log2, q_end,
                 CMP_LEN, CMP_STRIDE, WINDOW, H_PER_G, DK, DV, BT, BH, BC, BDA, BDB, BDV, PREC, WITH_O, TMA,
                 False, True)


@triton.jit
def _cmp_fwd_mix_kernel(Q, KC, KCB, VC, CU, CUC, O, LSE, GATE, OC, OS, OM,
                        sqt, sqh, skt, skh, svt, svh, sot, soh, slt, slh, sgt, sgh, scale_log2, q_end,
                        CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr, H_PER_G: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                        BC: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr,
                        PREC: tl.constexpr, TMA: tl.constexpr, KEEP_O: tl.constexpr):
    # a kernel of its own name: the suites tell from the kernels the GPU ran that the mix ran here
    _fwd_program(Q, KC, KCB, VC, CU, CUC, O, LSE, GATE, OC, OS, OM,
                 sqt, sqh, skt, skh, svt, svh, sot, soh, slt, slh, sgt, sgh, scale_log2, q_end,
                 CMP_LEN, CMP_STRIDE, WINDOW, H_PER_G, DK, DV, BT, BH, BC, BDA, BDB, BDV, PREC, True, TMA, True, KEEP_O)


@triton.jit
def _dq_chunk(dqa, dqb, qa, qb, do, lse2, delta, c0, n_hi, cbos, g, t_rel, ok, KC, KCB, VC, skt, skh, svt, svh,
              scale_log2, CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr, DK: tl.constexpr,
              DV: tl.constexpr, BC: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr,
              PREC: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """dq += dS·K over compressed tokens [c0, c0 + BC) (MASKED=False: every row sees the whole
    chunk); q, K and dq as two d_k parts."""
    i = c0 + tl.arange(0, BC)
    inb = i < n_hi
    kc = (cbos + i).to(tl.int64)
    # out of sight: p = 0 (the scores are masked); dS·K and dO·Vᵀ must not meet another sequence's NaN
    ka, kb = _load_tile_dk(KC, KCB, cbos + c0, g, kc * skt + g * skh, inb, DK, BDA, BDB, BC, TMA, MASKED)
    v = _load_tile(VC, cbos + c0, g, kc * svt + g * svh, inb, DV, BDV, BC, TMA, MASKED)
    s = dot_dk(qa, qb, ka, kb, BDB, PREC) * scale_log2
    if MASKED:
        # masked scores go to -inf before exp2: a score the forward never saw must not overflow
        vis = _visible(i[None, :], inb[None, :], t_rel[:, None], ok[:, None], CMP_LEN, CMP_STRIDE, WINDOW)
        s = tl.where(vis, s, float("-inf"))
    return dq_update(dqa, dqb, s, ka, kb, v, do, lse2, delta, BDB, PREC)


@triton.jit
def _cmp_dq_kernel(Q, KC, KCB, VC, CU, CUC, O, DO, LSE, DELTA, DQ, GATE, DG, LSEG,
                   sqt, sqh, skt, skh, svt, svh, sot, soh, sdot, sdoh, slt, slh, sdqt, sdqh, sgt, sgh,
                   scale, scale_log2, q_end,
                   CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr, H_PER_G: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                   BC: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr,
                   TMA: tl.constexpr, GATED: tl.constexpr, ACC: tl.constexpr):
    g, t0, seq_len, cbos, n_seq, t_rel, head, ok, t = _program_tile(CU, CUC, q_end, H_PER_G, BT, BH)
    if t0 < seq_len:
        qa, qb = load_dk(Q + t * sqt + head * sqh, ok, DK, BDA, BDB)
        do = load_2d(DO, t * sdot + head * sdoh, ok, DV, BDV)
        o = load_2d(O, t * sot + head * soh, ok, DV, BDV)
        lse = tl.load(LSE + t * slt + head * slh, mask=ok, other=float("inf"))
        # delta = rowsum(dO ∘ O), also handed to the dk/dv kernel (launched after this one)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        tl.store(DELTA + t * slt + head * slh, delta, mask=ok)
        if GATED:               # dO is the mix's: delta is the gate's gradient, the gate goes into lse
            tl.store(DG + t * sgt + head * sgh, delta.to(DG.dtype.element_ty), mask=ok)
            lse = gated_lse(lse, GATE, t * sgt + head * sgh, ok)
            tl.store(LSEG + t * slt + head * slh, lse, mask=ok)          # for the dk/dv kernel
        lse2 = lse * LOG2E_C
        lo, a, b, n_hi = _chunk_bounds(t0, seq_len, n_seq, CMP_LEN, CMP_STRIDE, WINDOW, BT, BC)
        dqa = tl.zeros([BT * BH, BDA], tl.float32)
        dqb = dqa
        if BDB > 0:
            dqb = tl.zeros([BT * BH, BDB], tl.float32)
        if WINDOW > 0:
            for c0 in range(lo, a, BC):
                dqa, dqb = _dq_chunk(dqa, dqb, qa, qb, do, lse2, delta, c0, n_hi, cbos, g, t_rel, ok, KC, KCB, VC,
                                     skt, skh, svt, svh, scale_log2, CMP_LEN, CMP_STRIDE, WINDOW, DK, DV, BC, BDA, BDB,
                                     BDV, PREC, True, TMA)
        for c0 in range(a, b, BC):
            dqa, dqb = _dq_chunk(dqa, dqb, qa, qb, do, lse2, delta, c0, n_hi, cbos, g, t_rel, ok, KC, KCB, VC, skt,
                                 skh, svt, svh, scale_log2, CMP_LEN, CMP_STRIDE, WINDOW, DK, DV, BC, BDA, BDB, BDV,
                                 PREC, False, TMA)
        for c0 in range(b, n_hi, BC):
            dqa, dqb = _dq_chunk(dqa, dqb, qa, qb, do, lse2, delta, c0, n_hi, cbos, g, t_rel, ok, KC, KCB, VC, skt,
                                 skh, svt, svh, scale_log2, CMP_LEN, CMP_STRIDE, WINDOW, DK, DV, BC, BDA, BDB, BDV,
                                 PREC, True, TMA)
        store_dk(DQ, t * sdqt + head * sdqh, dqa * scale, dqb * scale, ok, DK, BDA, BDB, ACC)


@triton.jit
def _dkdv_tile(dka, dkb, dv, ka, kb, v, i, inb, t0, hi, bos, g, Q, DO, LSE, DELTA, sqt, sqh, sdot, sdoh, slt, slh,
               scale_log2, CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr,
               H_PER_G: tl.constexpr, DK: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr,
               DV: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BDV: tl.constexpr,
               PREC: tl.constexpr, MASKED: tl.constexpr):
    """dk/dv of the chunk += the contributions of query tokens [t0, t0 + BT) (rows past ``hi`` or
    the group's heads give 0: their lse loads as +inf). MASKED=False: every row sees every token.
    d_k comes as two power-of-two parts (``common.head_dim_parts``: 192 is 128 + 64, no padding):
    ka/kb, dka/dkb and the queries' qa/qb; BDB = 0: one part (kb, dkb unused)."""
    t_rel, head, ok = _tile_rows(t0, hi, g, H_PER_G, BT, BH)
    t = (bos + t_rel).to(tl.int64)
    qa, qb = load_dk(Q + t * sqt + head * sqh, ok, DK, BDA, BDB)
    do = load_2d(DO, t * sdot + head * sdoh, ok, DV, BDV)
    lse2 = tl.load(LSE + t * slt + head * slh, mask=ok, other=float("inf")) * LOG2E_C
    delta = tl.load(DELTA + t * slt + head * slh, mask=ok, other=0.0)
    st = dot_dk(ka, kb, qa, qb, BDB, PREC) * scale_log2          # key-major [BC, rows] (dkdv_update)
    if MASKED:
        st = tl.where(_visible(i[:, None], inb[:, None], t_rel[None, :], ok[None, :], CMP_LEN, CMP_STRIDE, WINDOW),
                      st, float("-inf"))
    return dkdv_update(dka, dkb, dv, st, v, qa, qb, do, lse2, delta, BDB, PREC)


@triton.jit
def _cmp_dkdv_kernel(Q, KC, VC, CU, CUC, DO, LSE, DELTA, PART_K, PART_V,
                     sqt, sqh, skt, skh, svt, svh, sdot, sdoh, slt, slh, scale_log2, NCH, q_end,
                     CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr, H_PER_G: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                     BC: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr,
                     NSPLIT: tl.constexpr):
    """Partial dk/dv of compressed tokens [c·BC, (c+1)·BC) of one sequence and KV head from split
    s of the queries that see them (t from c·BC·d + l − 1 to the end, or with a window until the
    chunk's last key leaves it, cut in NSPLIT equal runs of whole tiles): an fp32 scratch row per
    (chunk, split), summed in order by the reduce kernel; a PART_K row is [BC, BDA + BDB].
    The split keeps the long chunks (the first ones: every later query sees them) from running
    alone at the end of the grid. The programs running together read unrelated query tiles, but that
    traffic is hidden behind the products: runs that share tiles were slower, being less even
    (docs/decisions.md)."""
    c = tl.program_id(0) // NSPLIT
    split = tl.program_id(0) % NSPLIT
    g = tl.program_id(1)
    b = tl.program_id(2)
    bos, seq_len, cbos, n_seq = _seq(CU, CUC, b)
    seq_len = tl.minimum(seq_len, q_end)              # queries from q_end on are not this call's
    i0 = c * BC
    offs_c = tl.arange(0, BC)
    dka = tl.zeros([BC, BDA], tl.float32)
    dkb = dka
    if BDB > 0:
        dkb = tl.zeros([BC, BDB], tl.float32)
    dv = tl.zeros([BC, BDV], tl.float32)
    if i0 < n_seq:
        i = i0 + offs_c
        inb = i < n_seq
        kc = (cbos + i).to(tl.int64)
        ka, kb = load_dk(KC + kc * skt + g * skh, inb, DK, BDA, BDB)
        v = load_2d(VC, kc * svt + g * svh, inb, DV, BDV)
        t_first = i0 * CMP_STRIDE + CMP_LEN - 1
        t_end = seq_len
        if WINDOW > 0:          # the last query that sees the chunk's last key: its end + w − 1
            t_end = tl.minimum(seq_len, (tl.minimum(i0 + BC, n_seq) - 1) * CMP_STRIDE + CMP_LEN - 1 + WINDOW)
        run = tl.cdiv(tl.cdiv(t_end - t_first, BT), NSPLIT) * BT
        lo = t_first + split * run
        hi = tl.minimum(lo + run, t_end)
        # query tiles from t_all on see the whole chunk (its last token's span is complete) ...
        t_all = (i0 + BC - 1) * CMP_STRIDE + CMP_LEN - 1
        mid = tl.minimum(hi, lo + tl.cdiv(tl.maximum(t_all - lo, 0), BT) * BT)
        # ... and, with a window, until its first key leaves the window (t >= t_first + w)
        until = hi
        if WINDOW > 0:
            until = tl.maximum(mid, tl.minimum(hi, lo + tl.maximum(t_first + WINDOW - lo, 0) // BT * BT))
        for t0 in range(lo, mid, BT):
            dka, dkb, dv = _dkdv_tile(dka, dkb, dv, ka, kb, v, i, inb, t0, hi, bos, g, Q, DO, LSE, DELTA, sqt,
                                      sqh, sdot, sdoh, slt, slh, scale_log2, CMP_LEN, CMP_STRIDE, WINDOW,
                                      H_PER_G, DK, BDA, BDB, DV, BT, BH, BDV, PREC, True)
        for t0 in range(mid, until, BT):
            dka, dkb, dv = _dkdv_tile(dka, dkb, dv, ka, kb, v, i, inb, t0, hi, bos, g, Q, DO, LSE, DELTA, sqt,
                                      sqh, sdot, sdoh, slt, slh, scale_log2, CMP_LEN, CMP_STRIDE, WINDOW,
                                      H_PER_G, DK, BDA, BDB, DV, BT, BH, BDV, PREC, False)
        if WINDOW > 0:
            for t0 in range(until, hi, BT):
                dka, dkb, dv = _dkdv_tile(dka, dkb, dv, ka, kb, v, i, inb, t0, hi, bos, g, Q, DO, LSE, DELTA,
                                          sqt, sqh, sdot, sdoh, slt, slh, scale_log2, CMP_LEN, CMP_STRIDE,
                                          WINDOW, H_PER_G, DK, BDA, BDB, DV, BT, BH, BDV, PREC, True)
    # every scratch row is written (zeros for an empty split), so the reduce reads no garbage
    row = (((b * tl.num_programs(1) + g) * NCH + c) * NSPLIT + split).to(tl.int64)
    every = offs_c >= 0
    PK: tl.constexpr = BDA + BDB
    store_dk(PART_K, row * (BC * PK) + offs_c * PK, dka, dkb, every, PK, BDA, BDB)
    store_2d(PART_V, row * (BC * BDV) + offs_c * BDV, dv, every, BDV, BDV)


@triton.jit
def _cmp_dkdv_reduce_kernel(PART_K, PART_V, CUC, DKC, DVC, sdkt, sdkh, sdvt, sdvh, scale, NCH,
                            DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
                            PK: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, NSPLIT: tl.constexpr,
                            ACC: tl.constexpr):
    """dk/dv of BR compressed tokens of a chunk and one KV head: the chunk's splits summed in order
    (deterministic). A PART_K row holds PK columns (the dk/dv kernel's two d_k parts). ACC: added to
    what DKC/DVC hold. (A program per whole chunk of BC = 128 made too few programs: 32 at 16k, G=4,
    for the 16 splits' 67 MB; ``REDUCE_ROWS``.)"""
    c = tl.program_id(0) // (BC // BR)
    r0 = tl.program_id(0) % (BC // BR) * BR                                   # first row of the chunk taken
    g = tl.program_id(1)
    b = tl.program_id(2)
    cbos = tl.load(CUC + b)
    n_seq = tl.load(CUC + b + 1) - cbos
    if c * BC + r0 < n_seq:
        offs_c = r0 + tl.arange(0, BR)
        i = c * BC + offs_c
        inb = i < n_seq
        kc = (cbos + i).to(tl.int64)
        every = offs_c >= 0
        dk = tl.zeros([BR, BDK], tl.float32)
        dv = tl.zeros([BR, BDV], tl.float32)
        row0 = (((b * tl.num_programs(1) + g) * NCH + c) * NSPLIT).to(tl.int64)
        for split in tl.static_range(NSPLIT):
            dk += load_2d(PART_K, (row0 + split) * (BC * PK) + offs_c * PK, every, PK, BDK)
            dv += load_2d(PART_V, (row0 + split) * (BC * BDV) + offs_c * BDV, every, BDV, BDV)
        store_2d(DKC, kc * sdkt + g * sdkh, dk * scale, inb, DK, BDK, ACC)
        store_2d(DVC, kc * sdvt + g * sdvh, dv, inb, DV, BDV, ACC)


# -- launchers -----------------------------------------------------------------------------
Q_END_NONE = 2 ** 31 - 1        # q_end not given: every query


def _role(window: int, q_end: int | None) -> tuple[str, int]:
    """(the name a launch goes by in the dispatch log and launch settings, the kernels' q_end): the
    window branch, the selection's dense prefix (queries before ``q_end``) or compressed attention."""
    return ("win" if window else "cmp" if q_end is None else "prefix"), (Q_END_NONE if q_end is None else q_end)
# compressed tokens per program of the dk/dv reduce where a chunk has several splits (the window's one
# split keeps a program per chunk): a program per chunk of 128 was slower up to 32k (docs/decisions.md)
REDUCE_ROWS = 32


def launch_configs(kernel: str, h: int, BDK: int, BDV: int, itemsize: int = 2, window: bool = False,
                   mix: bool = False) -> list[dict]:
    """Tile sizes and warps per kernel ("fwd", "dq", "dkdv"): BT query tokens (× h heads = ``rows``
    of one dot), BC compressed tokens per inner step, NSPLIT query runs per dk/dv chunk; ``tma``:
    tiles loaded through tensor descriptors (dropped where they are not usable). The measured
    settings first, then smaller ones for a GPU with less shared memory per block
    (``common.launch_fitting`` runs the first that loads; the smallest: 16 rows, BC 16, one stage).

    The measured settings are the fastest of sweeps on an H100 at 64k, H=64 (h=16), G=4, bf16, for the compressed
    branch and the sliding window; dk/dv keeps pointer loads (its query tiles through descriptors were slower) and
    computes its scores key-major (docs/decisions.md). fp32 (the precision path) takes the smallest tiles where
    compiled (``fp32_compiled``); interpreted, its backward starts at the smaller settings."""
    BH = triton.next_power_of_2(h)
    wide = max(BDK, BDV) > 128
    bt = lambda rows: max(1, rows // BH)  # noqa: E731  (tokens per tile: rows of one dot / heads)
    tma = []
    if kernel == "fwd":          # fp32 tiles are twice the bytes: 256 rows do not fit in shared memory
        split = {}
        if itemsize == 2 and wide and window:
            tma = [{"BT": bt(64), "BC": 32, "num_warps": 4, "num_stages": 2}]
        elif itemsize == 2 and window and mix:
            tma = [{"BT": bt(64), "BC": 64, "num_warps": 4, "num_stages": 2}]
        elif itemsize == 2:
            tma = [{"BT": bt(256 if wide else 128), "BC": 64, "num_warps": 8 if wide else 4, "num_stages": 2}]
        measured = [{"BT": bt(256), "BC": 64, "num_warps": 8, "num_stages": 2},
                    {"BT": bt(128), "BC": 64, "num_warps": 4, "num_stages": 2}] if itemsize == 2 else \
                   [{"BT": bt(64), "BC": 64, "num_warps": 8, "num_stages": 2}]
    elif kernel == "dq":         # (fp32 at d_k=192: 128 rows do not fit in shared memory)
        split = {}
        big = wide and itemsize == 2
        measured = [{"BT": bt(128 if big else 64), "BC": 64, "num_warps": 8 if big else 4, "num_stages": 2}]
        tma = measured if itemsize == 2 else []
    else:                        # NSPLIT: the most query runs per chunk; split_len: the fewest queries a run gets
        split = {"NSPLIT": 16, "split_len": 1024}
        measured = [{"BT": bt(64), "BC": 128, **split, "num_warps": 8, "num_stages": 2 if wide else 3},
                    {"BT": bt(64), "BC": 64, **split, "num_warps": 4, "num_stages": 2}]
    smaller = [{"BT": bt(rows), "BC": bc, **split, "num_warps": 4, "num_stages": 1} for rows, bc in ((64, 32), (16, 16))]
    if fp32_compiled(itemsize):
        tma, measured, smaller = [], [], smaller[1:]
    elif itemsize == 4 and kernel != "fwd":    # interpreted: fp32's backward from the smaller settings
        measured = []
    configs = [{**c, "tma": True} for c in tma] + measured + smaller
    return [c for i, c in enumerate(configs) if c not in configs[:i]]


def _check(q, k_cmp, v_cmp, cu_seqlens, cu_cmp) -> tuple[int, int]:
    """Validate layouts; returns (G, h). Raises ValueError with a one-line reason."""
    if q.dim() != 3 or k_cmp.dim() != 3 or v_cmp.dim() != 3:
        raise ValueError(f"q, k_cmp, v_cmp must be packed [tokens, heads, dim]; got {tuple(q.shape)}, "
                         f"{tuple(k_cmp.shape)}, {tuple(v_cmp.shape)}")
    T, H, dk = q.shape
    N, G = k_cmp.shape[:2]
    if k_cmp.shape[2] != dk or v_cmp.shape[:2] != (N, G):
        raise ValueError(f"k_cmp must be [N, G, d_k={dk}] and v_cmp [N, G, d_v]; got {tuple(k_cmp.shape)}, {tuple(v_cmp.shape)}")
    if G == 0 or H % G:
        raise ValueError(f"query heads H={H} must be a multiple of KV heads G={G}")
    if not (q.dtype == k_cmp.dtype == v_cmp.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k_cmp, v_cmp must share one dtype of fp16/bf16/fp32; got {q.dtype}, {k_cmp.dtype}, {v_cmp.dtype}")
    for name, cu in (("cu_seqlens", cu_seqlens), ("cu_cmp", cu_cmp)):
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor; got {cu.dtype} {tuple(cu.shape)}")
    if cu_seqlens.shape != cu_cmp.shape:
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)} and cu_cmp {tuple(cu_cmp.shape)} must describe the same batch")
    for name, x in (("q", q), ("k_cmp", k_cmp), ("v_cmp", v_cmp)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    return G, H // G


def cmp_cu_seqlens(cu_seqlens: torch.Tensor, cmp_len: int, cmp_stride: int) -> torch.Tensor:
    """cu_cmp [B+1] int32: boundaries of each sequence's compressed tokens, from cu_seqlens (no sync)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n = torch.where(lens >= cmp_len, (lens - cmp_len) // cmp_stride + 1, 0)
    return torch.cat([cu_seqlens.new_zeros(1), torch.cumsum(n, 0).to(torch.int32)])


def _grid_sizes(cu, cmp_len, cmp_stride, max_seqlen):
    max_seqlen = max_seqlen if max_seqlen is not None else (
        int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0)
    max_cmp = (max_seqlen - cmp_len) // cmp_stride + 1 if max_seqlen >= cmp_len else 0
    return max_seqlen, max_cmp


def compressed_attention_fwd(q, k_cmp, v_cmp, cmp_len: int, cmp_stride: int, cu_seqlens, cu_cmp, *,
                             scale=None, max_seqlen: int | None = None, out=None, lse=None, with_o: bool = True,
                             window: int = 0, mix=None, keep_o: bool = True, q_end: int | None = None):
    """Forward launcher: returns (o [T, H, d_v], lse [T, H] fp32). ``out``/``lse`` may be given
    (e.g. NaN-poisoned buffers in tests); every row of both is written, except with ``q_end``: then
    only the queries at positions < q_end of each sequence are computed (the rows past it are
    neither read nor written). ``with_o=False``: the
    log-sum-exp alone (o is None; v_cmp is not read). ``window`` > 0: a query sees only the keys
    that ended within its last ``window`` positions (the sliding-window branch: ``kernels.window``).

    ``mix`` = (g [T, H, 3], o_a [T, H, d_v], o_b [T, H, d_v]): also the gated sum g₀·o_a + g₁·o_b
    + g₂·o in the same launch, as ``kernels.mix.mix_fwd(g, (o_a, o_b, o))`` computes it (fp32
    from the stored outputs, rounded once), without that pass re-reading o, o_a and o_b; returns
    (o, lse, the sum [T, H, d_v]). ``keep_o=False`` (with ``mix``): o is not stored (None)."""
    G, h = _check(q, k_cmp, v_cmp, cu_seqlens, cu_cmp)
    T, H, dk = q.shape
    dv = v_cmp.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(dk)
    max_seqlen, _ = _grid_sizes(cu_seqlens, cmp_len, cmp_stride, max_seqlen)
    name, q_end = _role(window, q_end)
    max_seqlen = min(max_seqlen, q_end)
    if mix is not None:
        g, o_a, o_b = mix
        if not with_o or g.shape != (T, H, 3) or o_a.shape != (T, H, dv) or o_b.shape != (T, H, dv):
            raise ValueError(f"mix needs the output and g [T, H, 3] = [{T}, {H}, 3] with two [{T}, {H}, {dv}] "
                             f"outputs; got g {tuple(g.shape)}, {tuple(o_a.shape)}, {tuple(o_b.shape)}")
        g, o_a, o_b = g.contiguous(), o_a.contiguous(), o_b.contiguous()
        o_mix = torch.empty_like(o_a)
        if out is not None and not out.is_contiguous():
            raise ValueError("out must be contiguous with mix")
    keep_o = keep_o or mix is None
    if with_o and keep_o and out is None:
        out = torch.empty(T, H, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(T, H, device=q.device, dtype=torch.float32) if lse is None else lse
    B = cu_seqlens.numel() - 1
    if T and B and max_seqlen:
        BDK, BDV = pow2(dk), pow2(dv)
        o_arg = out if with_o else lse                   # not touched without WITH_O
        tma = max(BDK, BDV) <= 256 and descriptors_usable(k_cmp, v_cmp)      # blocks: at most 256 a side

        BDA, BDB = head_dim_parts(dk)                   # d_k as two power-of-two parts (192: 128 + 64)

        def launch(lc):
            BT, use_tma = lc.pop("BT"), lc.pop("tma", False)
            kc, kcb, vc = k_cmp, k_cmp, v_cmp
            if use_tma:
                kc, kcb = descriptors_dk(k_cmp, lc["BC"], BDA, BDB)
                vc = descriptor(v_cmp, [lc["BC"], 1, BDV]) if with_o else kc
                dispatch.note("kernel", f"{name}_fwd@tma", "triton")
            grid = (triton.cdiv(max_seqlen, BT), G, B)
            common = dict(CMP_LEN=cmp_len, CMP_STRIDE=cmp_stride, WINDOW=window, H_PER_G=h, DK=dk, DV=dv, BT=BT,
                          BH=triton.next_power_of_2(h), BDA=BDA, BDB=BDB, BDV=BDV, PREC=precision(q.dtype), TMA=use_tma)
            if mix is None:
                (_cmp_fwd_kernel if name != "prefix" else _prefix_fwd_kernel)[grid](
                    q, kc, kcb, vc, cu_seqlens, cu_cmp, o_arg, lse,
                    q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), v_cmp.stride(0), v_cmp.stride(1),
                    o_arg.stride(0), o_arg.stride(1), lse.stride(0), lse.stride(1), scale * LOG2E, q_end,
                    WITH_O=with_o, **common, **lc)
            else:                 # o, o_a, o_b and the sum: contiguous [T, H, d_v], one set of strides
                _cmp_fwd_mix_kernel[grid](
                    q, kc, kcb, vc, cu_seqlens, cu_cmp, out if keep_o else o_mix, lse, g, o_a, o_b, o_mix,
                    q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), v_cmp.stride(0), v_cmp.stride(1),
                    H * dv, dv, lse.stride(0), lse.stride(1), 3 * H, 3, scale * LOG2E, q_end,
                    KEEP_O=keep_o, **common, **lc)
        launch_fitting(f"{name}_fwd" + ("+mix" if mix is not None else ""),
                       (q.device, q.dtype, h, dk, dv, with_o, tma, keep_o),
                       usable(launch_configs("fwd", h, BDK, BDV if with_o else 16, q.element_size(), window > 0,
                                             mix is not None), tma),
                       launch)
        dispatch.note("kernel", f"{name}_fwd", "triton")
        if mix is not None:
            dispatch.note("kernel", f"{name}_fwd+mix", "triton")
    if mix is not None:
        if not (T and B and max_seqlen):
            o_mix.zero_()
        return out, lse, o_mix
    return out, lse


def _dkdv_splits(most: int, split_len: int, max_seqlen: int, chunks: int, n_sm: int, window: int) -> int:
    """Query runs per chunk of the dk/dv kernel: as many as the longest sequence gives runs of at
    least ``split_len`` queries (at most ``most``), halved while the grid of ``chunks`` · runs
    programs holds more than 8 per SM. A window's chunks are seen by w queries: one run.

    Runs per chunk by sequence length, swept on an H100: docs/decisions.md."""
    if window:
        return 1
    n = max(1, min(most, max_seqlen // split_len))
    while n > 1 and chunks * n > 8 * n_sm:
        n //= 2
    return n


def compressed_attention_bwd(do, q, k_cmp, v_cmp, o, lse, cmp_len: int, cmp_stride: int, cu_seqlens, cu_cmp, *,
                             scale=None, max_seqlen: int | None = None, window: int = 0, gate=None, dgate=None,
                             dq=None, dk=None, dv=None, accumulate: bool = False, q_end: int | None = None):
    """Backward launcher: returns (dq [T, H, d_k], dk_cmp [N, G, d_k], dv_cmp [N, G, d_v]) in q's
    dtype; every row is written (zero where no query reached a compressed token). ``window``: as
    the forward's.

    Inside the fused layer backward (``kernels.branches``): ``gate`` [T, H] is this branch's gate
    column and ``do`` the gated mix's dO (the branch's dO is gate·do; the gate folds into each
    row's lse: ``common.gated_lse``), and ``dgate`` [T, H] (the same strides) receives
    rowsum(do ∘ o); ``dq``/``dk``/``dv`` may be given, and with ``accumulate`` the gradients are
    added to what the given ones hold (dq alone, or dk and dv together; buffers not given are
    written afresh).

    ``q_end``: only the queries at positions < q_end of each sequence contribute (the forward's
    ``q_end``); dq rows past it are left as they are where dq accumulates, else zero."""
    G, h = _check(q, k_cmp, v_cmp, cu_seqlens, cu_cmp)
    T, H, d_k = q.shape
    d_v = v_cmp.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(d_k)
    max_seqlen, _ = _grid_sizes(cu_seqlens, cmp_len, cmp_stride, max_seqlen)
    name, q_end = _role(window, q_end)
    # the queries (and so the compressed tokens they see) up to q_end
    max_seqlen, max_cmp = _grid_sizes(cu_seqlens, cmp_len, cmp_stride, min(max_seqlen, q_end))
    do, lse = do.contiguous(), lse.contiguous()
    acc_q, acc_kv = accumulate and dq is not None, accumulate and dk is not None and dv is not None
    dq = torch.empty_like(q) if dq is None else dq
    if q_end < Q_END_NONE:
        if not acc_q:
            dq.zero_()                  # the rows past q_end
        if not acc_kv:                  # the compressed tokens no query before q_end sees
            for x in (dk, dv):
                if x is not None:
                    x.zero_()
    # compressed tokens of no sequence (none in a packed batch) stay 0
    dk = torch.zeros_like(k_cmp) if dk is None else dk
    dv = torch.zeros_like(v_cmp) if dv is None else dv
    B = cu_seqlens.numel() - 1
    if not (T and B and max_seqlen):
        return (dq if acc_q else dq.zero_()), dk, dv
    GATE, DG, lse_g, sgt, sgh = gate_args(gate, dgate, lse)
    delta = torch.empty_like(lse)                                                  # written by _cmp_dq_kernel
    BDK, BDV, BH, prec = pow2(d_k), pow2(d_v), triton.next_power_of_2(h), precision(q.dtype)
    common = dict(CMP_LEN=cmp_len, CMP_STRIDE=cmp_stride, WINDOW=window, H_PER_G=h, DK=d_k, DV=d_v, BH=BH,
                  BDV=BDV, PREC=prec)
    BDA, BDB = head_dim_parts(d_k)                       # d_k as two power-of-two parts (192: 128 + 64)
    tma = max(BDK, BDV) <= 256 and descriptors_usable(k_cmp, v_cmp)      # blocks: at most 256 a side
    spec = (q.device, q.dtype, h, d_k, d_v, tma)

    def launch_dq(lc):
        BT, use_tma = lc.pop("BT"), lc.pop("tma", False)
        kc, kcb, vc = k_cmp, k_cmp, v_cmp
        if use_tma:
            (kc, kcb), vc = descriptors_dk(k_cmp, lc["BC"], BDA, BDB), descriptor(v_cmp, [lc["BC"], 1, BDV])
            dispatch.note("kernel", f"{name}_dq@tma", "triton")
        _cmp_dq_kernel[(triton.cdiv(max_seqlen, BT), G, B)](
            q, kc, kcb, vc, cu_seqlens, cu_cmp, o, do, lse, delta, dq, GATE, DG, lse_g,
            q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), v_cmp.stride(0), v_cmp.stride(1),
            o.stride(0), o.stride(1), do.stride(0), do.stride(1), lse.stride(0), lse.stride(1),
            dq.stride(0), dq.stride(1), sgt, sgh, scale, scale * LOG2E, q_end, BT=BT, BDA=BDA, BDB=BDB,
            TMA=use_tma, GATED=gate is not None, ACC=acc_q, **common, **lc)
    launch_fitting(f"{name}_dq", spec, usable(launch_configs("dq", h, BDK, BDV, q.element_size()), tma), launch_dq)

    def launch_dkdv(lc):
        BT, BC, nsplit, split_len = lc.pop("BT"), lc.pop("BC"), lc.pop("NSPLIT"), lc.pop("split_len")
        NCH = triton.cdiv(max_cmp, BC)
        nsplit = _dkdv_splits(nsplit, split_len, max_seqlen, NCH * G * B, sm_count(q.device), window)
        part_k = torch.empty(B * G * NCH * nsplit, BC, BDA + BDB, device=q.device, dtype=torch.float32)
        part_v = torch.empty(B * G * NCH * nsplit, BC, BDV, device=q.device, dtype=torch.float32)
        _cmp_dkdv_kernel[(NCH * nsplit, G, B)](
            q, k_cmp, v_cmp, cu_seqlens, cu_cmp, do, lse_g, delta, part_k, part_v,
            q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), v_cmp.stride(0), v_cmp.stride(1),
            do.stride(0), do.stride(1), lse.stride(0), lse.stride(1), scale * LOG2E, NCH, q_end,
            BT=BT, BC=BC, BDA=BDA, BDB=BDB, NSPLIT=nsplit, **common, **lc)
        BR = BC if nsplit == 1 else min(BC, REDUCE_ROWS)
        _cmp_dkdv_reduce_kernel[(NCH * (BC // BR), G, B)](
            part_k, part_v, cu_cmp, dk, dv, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), scale, NCH,
            DK=d_k, DV=d_v, BC=BC, BR=BR, PK=BDA + BDB, BDK=BDK, BDV=BDV, NSPLIT=nsplit, ACC=acc_kv, num_warps=4)
    if max_cmp:
        launch_fitting(f"{name}_dkdv", spec, launch_configs("dkdv", h, BDK, BDV, q.element_size()), launch_dkdv)
    dispatch.note("kernel", f"{name}_bwd", "triton")
    return dq, dk, dv


# -- autograd ------------------------------------------------------------------------------
class CompressedAttention(torch.autograd.Function):
    """The kernels as one differentiable op in q, k_cmp, v_cmp; ``window`` > 0 is the sliding
    window (``kernels.window``), 0 the compressed branch (``compressed_attention``)."""

    @staticmethod
    def forward(ctx, q, k_cmp, v_cmp, cmp_len, cmp_stride, cu_seqlens, cu_cmp, scale, max_seqlen, window):
        o, lse = compressed_attention_fwd(q, k_cmp, v_cmp, cmp_len, cmp_stride, cu_seqlens, cu_cmp,
                                          scale=scale, max_seqlen=max_seqlen, window=window)
        ctx.save_for_backward(q, k_cmp, v_cmp, o, lse, cu_seqlens, cu_cmp)
        ctx.args = (cmp_len, cmp_stride, scale, max_seqlen, window)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k_cmp, v_cmp, o, lse, cu_seqlens, cu_cmp = ctx.saved_tensors
        cmp_len, cmp_stride, scale, max_seqlen, window = ctx.args
        dq, dk, dv = compressed_attention_bwd(do, q, k_cmp, v_cmp, o, lse, cmp_len, cmp_stride, cu_seqlens, cu_cmp,
                                              scale=scale, max_seqlen=max_seqlen, window=window)
        return dq, dk, dv, None, None, None, None, None, None, None


def compressed_attention(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, cmp_len: int, cmp_stride: int,
                         cu_seqlens: torch.Tensor | None = None, cu_cmp: torch.Tensor | None = None, *,
                         scale: float | None = None, max_seqlen: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NSA compressed attention, differentiable in q, k_cmp and v_cmp.

    q [T, H, d_k] (packed sequences, fp16/bf16, or fp32); k_cmp [N, G, d_k], v_cmp [N, G, d_v]
    the compressed tokens of spans [i·cmp_stride, i·cmp_stride + cmp_len) of each sequence;
    cu_seqlens [B+1] int32 (None: one sequence of T tokens); cu_cmp [B+1] int32 (None: derived
    from cu_seqlens); scale defaults to 1/sqrt(d_k); max_seqlen (the longest sequence) avoids a
    device sync when given. Returns (o [T, H, d_v], lse [T, H] fp32, not differentiable).
    """
    cu_seqlens, one = cu_or_one(cu_seqlens, q.shape[0], q.device)
    max_seqlen = max_seqlen if max_seqlen is not None else one
    if cu_cmp is None:
        cu_cmp = cmp_cu_seqlens(cu_seqlens, cmp_len, cmp_stride)
    return CompressedAttention.apply(q, k_cmp, v_cmp, cmp_len, cmp_stride, cu_seqlens, cu_cmp, scale, max_seqlen, 0)
