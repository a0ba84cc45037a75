"""Triton selection attention (NSA's selected-block branch): forward and backward.

Group-centric, as in the paper: one program per (query token, KV head) loads all h query heads
of the GQA group and shares every fetch of a selected key/value block among them; the inner loop
runs over the n selected blocks. The backward pass is split in two deterministic kernels:

* ``_dq_kernel``   — query-centric like the forward (per token and KV head, loop over its blocks).
* ``_dkdv_kernel`` — key-centric: a program takes one (selection block, KV head) and a segment
  of at most ``SEGMENT`` of the queries that selected it (a reverse index built with a stable
  sort; block 0, which every query selects, is split over many programs instead of serialising
  the whole pass) and writes an fp32 partial sum; ``_dkdv_reduce_kernel`` adds a block's
  partials in segment order. No atomics anywhere: gradients are bit-identical run to run.

Layouts (packed variable length, like flash-attn's varlen API):
    q        [T, H, d_k]      H = G·h; head ``g*h + i`` belongs to KV head g
    k        [T, G, d_k]
    v        [T, G, d_v]      d_v may differ from d_k (the paper's 192/128)
    block_idx[T, G, n]        int32/int64 selection-block numbers relative to the token's own
                              sequence start; -1 marks an unused slot; distinct per row
    cu_seqlens [B + 1]        int32 sequence boundaries in T (empty sequences allowed)
    o        [T, H, d_v]      same dtype as q
    lse      [T, H]           fp32 natural-log sum of exp of the scaled scores (+inf for a
                              row with no key, whose output is 0)

Query t of a sequence attends to the tokens of its selected blocks at positions <= t. Memory is
O(T·n) (no T×T matrix anywhere); token offsets are 64-bit, so T·H·d may exceed 2^31.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.common import (LOG2E, LOG2E_C, cu_or_one, dkdv_update, dot_dk, dq_update, fp32_compiled, gate_args,
                            gated_lse, head_dim_parts, launch_fitting, load_dk, pow2, precision, store_2d, store_dk)
from nsa_core import dispatch


# -- kernels -------------------------------------------------------------------------------
@triton.jit
def _program_token(CU, t_from, H_PER_G: tl.constexpr, BH: tl.constexpr):
    """A (token, KV head, sequence) program's query token and heads: (t_rel in its sequence, the
    sequence's length, t the packed row (int64), the sequence's first row, g, the group's query
    heads [BH], which of them exist [BH]). Program i takes position t_from + i. The caller acts
    only where t_rel < the length."""
    t_rel = t_from + tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2)
    bos = tl.load(CU + b)
    seq_len = tl.load(CU + b + 1) - bos
    rows = tl.arange(0, BH)
    return t_rel, seq_len, (bos + t_rel).to(tl.int64), bos, g, g * H_PER_G + rows, rows < H_PER_G


@triton.jit
def _load_rows(P, t, heads, row_ok, st, sh, D: tl.constexpr, BD: tl.constexpr):
    """The h head rows of token t: [BH, BD] (zero past the group's heads and past D)."""
    offs = tl.arange(0, BD)
    return tl.load(P + t * st + heads[:, None] * sh + offs[None, :],
                   mask=row_ok[:, None] & (offs[None, :] < D), other=0.0)


@triton.jit
def _load_selected_block(K, V, IDX_ROW, s_i, bos, t_rel, g, skt, skh, svt, svh,
                         BLOCK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BN: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr):
    """Slot s_i of a query's block list: (ka [BN, BDA], kb [BN, BDB], v [BN, BDV], valid [BN]),
    d_k as two power-of-two parts (``common.head_dim_parts``; BDB = 0: kb unused). A sentinel slot
    (j = -1 gives kpos < 0), tokens past the query (causality) and tile padding read nothing."""
    offs_n = tl.arange(0, BN)
    offs_dv = tl.arange(0, BDV)
    j = tl.load(IDX_ROW + s_i)
    kpos = j * BLOCK + offs_n
    valid = (offs_n < BLOCK) & (kpos >= 0) & (kpos <= t_rel)
    kt = (bos + kpos).to(tl.int64)
    ka, kb = load_dk(K + kt * skt + g * skh, valid, DK, BDA, BDB)
    v = tl.load(V + kt[:, None] * svt + g * svh + offs_dv[None, :],
                mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
    return ka, kb, v, valid


@triton.jit
def _sel_fwd_kernel(Q, K, V, IDX, CU, O, LSE,
                    sqt, sqh, skt, skh, svt, svh, sit, sig, sot, soh, slt, slh,
                    scale_log2, t_from,
                    H_PER_G: tl.constexpr, N_SEL: tl.constexpr, BLOCK: tl.constexpr,
                    DK: tl.constexpr, DV: tl.constexpr,
                    BH: tl.constexpr, BN: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr,
                    PREC: tl.constexpr):
    t_rel, seq_len, t, bos, g, heads, row_ok = _program_token(CU, t_from, H_PER_G, BH)
    if t_rel < seq_len:
        offs_dv = tl.arange(0, BDV)
        qa, qb = load_dk(Q + t * sqt + heads * sqh, row_ok, DK, BDA, BDB)
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, BDV], tl.float32)
        for s_i in range(N_SEL):
            ka, kb, v, valid = _load_selected_block(K, V, IDX + t * sit + g * sig, s_i, bos, t_rel, g, skt, skh, svt,
                                                    svh, BLOCK, DK, DV, BN, BDA, BDB, BDV)
            s = dot_dk(qa, qb, ka, kb, BDB, PREC) * scale_log2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps m = -inf; shift by 0 instead (no inf - inf)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / LOG2E_C)
        tl.store(O + t * sot + heads[:, None] * soh + offs_dv[None, :], o.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(LSE + t * slt + heads * slh, lse, mask=row_ok)


@triton.jit
def _sel_dq_kernel(Q, K, V, IDX, CU, O, DO, LSE, DELTA, DQ, GATE, DG, LSEG,
                   sqt, sqh, skt, skh, svt, svh, sit, sig, sot, soh, sdot, sdoh, slt, slh, sdqt, sdqh, sgt, sgh,
                   scale, scale_log2, t_from,
                   H_PER_G: tl.constexpr, N_SEL: tl.constexpr, BLOCK: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr,
                   BH: tl.constexpr, BN: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr,
                   PREC: tl.constexpr, GATED: tl.constexpr, ACC: tl.constexpr):
    t_rel, seq_len, t, bos, g, heads, row_ok = _program_token(CU, t_from, H_PER_G, BH)
    if t_rel < seq_len:
        qa, qb = load_dk(Q + t * sqt + heads * sqh, row_ok, DK, BDA, BDB)
        do = _load_rows(DO, t, heads, row_ok, sdot, sdoh, DV, BDV)
        o = _load_rows(O, t, heads, row_ok, sot, soh, DV, BDV)
        lse = tl.load(LSE + t * slt + heads * slh, mask=row_ok, other=float("inf"))
        # delta = rowsum(dO ∘ O), also handed to the dk/dv kernel (launched after this one)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        tl.store(DELTA + t * slt + heads * slh, delta, mask=row_ok)
        if GATED:               # dO is the mix's: delta is the gate's gradient, the gate goes into lse
            tl.store(DG + t * sgt + heads * sgh, delta.to(DG.dtype.element_ty), mask=row_ok)
            lse = gated_lse(lse, GATE, t * sgt + heads * sgh, row_ok)
            tl.store(LSEG + t * slt + heads * slh, lse, mask=row_ok)     # for the dk/dv kernel
        lse2 = lse * LOG2E_C
        dqa = tl.zeros([BH, BDA], tl.float32)
        dqb = dqa
        if BDB > 0:
            dqb = tl.zeros([BH, BDB], tl.float32)
        for s_i in range(N_SEL):
            ka, kb, v, valid = _load_selected_block(K, V, IDX + t * sit + g * sig, s_i, bos, t_rel, g, skt, skh, svt,
                                                    svh, BLOCK, DK, DV, BN, BDA, BDB, BDV)
            s = tl.where(valid[None, :], dot_dk(qa, qb, ka, kb, BDB, PREC) * scale_log2, float("-inf"))
            dqa, dqb = dq_update(dqa, dqb, s, ka, kb, v, do, lse2, delta, BDB, PREC)
        store_dk(DQ, t * sdqt + heads * sdqh, dqa * scale, dqb * scale, row_ok, DK, BDA, BDB, ACC)


@triton.jit
def _sel_dkdv_kernel(Q, K, V, CU, DO, LSE, DELTA, PART_K, PART_V,
                     SEG_BUCKET, SEG_LO, SEG_HI, BLK_START, BLK_SEQ, QLIST, n_blk_slots,
                     sqt, sqh, skt, skh, svt, svh, sdot, sdoh, slt, slh,
                     scale_log2,
                     H_PER_G: tl.constexpr, BLOCK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     BHB: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr,
                     BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr):
    """Partial dk/dv of one selection block and KV head from one segment of the queries that
    selected it (QLIST[lo:hi]); written to the fp32 scratch row of this segment ([BN, BDA + BDB]
    for dk: d_k as two power-of-two parts, ``common.head_dim_parts``)."""
    seg = tl.program_id(0)
    bucket = tl.load(SEG_BUCKET + seg)     # g · n_blk_slots + global block slot; -1: unused segment
    if bucket >= 0:
        g = bucket // n_blk_slots
        gb = bucket % n_blk_slots
        start = tl.load(BLK_START + gb)
        b = tl.load(BLK_SEQ + gb)
        bos = tl.load(CU + b)
        eos = tl.load(CU + b + 1)
        offs_n = tl.arange(0, BN)
        offs_dv = tl.arange(0, BDV)
        kt = start.to(tl.int64) + offs_n
        kpos = (start - bos) + offs_n
        kvalid = (offs_n < BLOCK) & (kt < eos)   # the last block of a sequence may be partial
        ka, kb = load_dk(K + kt * skt + g * skh, kvalid, DK, BDA, BDB)
        v = tl.load(V + kt[:, None] * svt + g * svh + offs_dv[None, :],
                    mask=kvalid[:, None] & (offs_dv[None, :] < DV), other=0.0)
        dka = tl.zeros([BN, BDA], tl.float32)
        dkb = dka
        if BDB > 0:
            dkb = tl.zeros([BN, BDB], tl.float32)
        dv = tl.zeros([BN, BDV], tl.float32)
        lo = tl.load(SEG_LO + seg)
        hi = tl.load(SEG_HI + seg)
        r = tl.arange(0, BQ * BHB)
        hh = r % BHB
        for c in range(lo, hi, BQ):
            qi = c + r // BHB
            in_list = qi < hi
            tq = tl.load(QLIST + qi, mask=in_list, other=0).to(tl.int64)
            row_ok = in_list & (hh < H_PER_G)
            head = g * H_PER_G + hh
            qa, qb = load_dk(Q + tq * sqt + head * sqh, row_ok, DK, BDA, BDB)
            do = tl.load(DO + tq[:, None] * sdot + head[:, None] * sdoh + offs_dv[None, :],
                         mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            lse2 = tl.load(LSE + tq * slt + head * slh, mask=row_ok, other=float("inf")) * LOG2E_C
            delta = tl.load(DELTA + tq * slt + head * slh, mask=row_ok, other=0.0)
            qpos = tq - bos
            valid = kvalid[:, None] & row_ok[None, :] & (kpos[:, None] <= qpos[None, :])
            st = tl.where(valid, dot_dk(ka, kb, qa, qb, BDB, PREC) * scale_log2, float("-inf"))   # key-major
            dka, dkb, dv = dkdv_update(dka, dkb, dv, st, v, qa, qb, do, lse2, delta, BDB, PREC)
        seg64 = seg.to(tl.int64)
        PK: tl.constexpr = BDA + BDB
        store_dk(PART_K, seg64 * (BN * PK) + offs_n * PK, dka, dkb, offs_n >= 0, PK, BDA, BDB)
        tl.store(PART_V + seg64 * (BN * BDV) + offs_n[:, None] * BDV + offs_dv[None, :], dv)


@triton.jit
def _sel_dkdv_reduce_kernel(PART_K, PART_V, SEG_FIRST, CU, BLK_START, BLK_SEQ, DK_OUT, DV_OUT, n_blk_slots,
                            sdkt, sdkh, sdvt, sdvh, scale,
                            BLOCK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            BN: tl.constexpr, PK: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                            ACC: tl.constexpr):
    """dk/dv of one selection block and KV head: its segments summed in order (deterministic);
    zero where no query selected the block. A PART_K row holds PK (<= BDK) columns. ACC: added to
    what DK_OUT/DV_OUT hold."""
    gb = tl.program_id(0)
    g = tl.program_id(1)
    start = tl.load(BLK_START + gb)
    if start >= 0:
        eos = tl.load(CU + tl.load(BLK_SEQ + gb) + 1)
        offs_n = tl.arange(0, BN)
        offs_dk = tl.arange(0, BDK)
        offs_dv = tl.arange(0, BDV)
        kt = start.to(tl.int64) + offs_n
        kvalid = (offs_n < BLOCK) & (kt < eos)
        dk = tl.zeros([BN, BDK], tl.float32)
        dv = tl.zeros([BN, BDV], tl.float32)
        first = tl.load(SEG_FIRST + g * n_blk_slots + gb).to(tl.int64)
        last = tl.load(SEG_FIRST + g * n_blk_slots + gb + 1).to(tl.int64)
        for seg64 in range(first, last):
            dk += tl.load(PART_K + seg64 * (BN * PK) + offs_n[:, None] * PK + offs_dk[None, :],
                          mask=offs_dk[None, :] < PK, other=0.0)
            dv += tl.load(PART_V + seg64 * (BN * BDV) + offs_n[:, None] * BDV + offs_dv[None, :])
        store_2d(DK_OUT, kt * sdkt + g * sdkh, dk * scale, kvalid, DK, BDK, ACC)
        store_2d(DV_OUT, kt * sdvt + g * sdvh, dv, kvalid, DV, BDV, ACC)


# -- launchers -----------------------------------------------------------------------------
def launch_configs(kernel: str, BDK: int, BDV: int, itemsize: int = 2) -> list[dict]:
    """num_warps / num_stages per kernel ("fwd", "dq", "dkdv") and padded head dims: the measured
    settings first, then smaller ones for a GPU with less shared memory per block
    (``common.launch_fitting`` runs the first that loads).

    The measured settings are the fastest of the warps / stages sweeps at 64k; the sweeps and the other
    loads and program shapes compared are in docs/decisions.md.
    """
    wide = max(BDK, BDV) > 128
    # fwd and dq are L2-bandwidth-bound (the selected K/V blocks), not compute-bound: what was tried
    # on the loads is in docs/decisions.md
    if kernel == "dkdv":      # rows: query-head rows per inner step (segment: queries per program, fixed)
        smallest = [{"num_warps": 4, "rows": 16, "num_stages": 1}]
        if fp32_compiled(itemsize):           # (64 rows spilled 15 KB a thread)
            return smallest
        return [{"num_warps": 4, "rows": 32 if wide else 64}, {"num_warps": 4, "rows": 32, "num_stages": 1}, *smallest]
    return [{"num_warps": 2, "num_stages": 2}, {"num_warps": 2, "num_stages": 1}]


def _check(q, k, v, block_idx, cu_seqlens, block_size) -> tuple[int, int]:
    """Validate layouts; returns (G, h). Raises ValueError with a one-line reason."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be packed [T, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, H, dk = q.shape
    G = k.shape[1]
    if k.shape != (T, G, dk) or v.shape[:2] != (T, G):
        raise ValueError(f"k must be [T, G, d_k] and v [T, G, d_v] with T={T}, d_k={dk}; "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if H % G:
        raise ValueError(f"query heads H={H} must be a multiple of KV heads G={G}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype of fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if block_idx.dim() != 3 or block_idx.shape[:2] != (T, G):
        raise ValueError(f"block_idx must be [T, G, n] = [{T}, {G}, n]; got {tuple(block_idx.shape)}")
    if block_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_idx must be int32 or int64; got {block_idx.dtype}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor; got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two; got {block_size}")
    for name, x in (("q", q), ("k", k), ("v", v), ("block_idx", block_idx)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    return G, H // G


def selection_attention_fwd(q, k, v, block_idx, block_size: int, cu_seqlens=None, *, scale=None,
                            max_seqlen: int | None = None, out=None, lse=None, first_row: int = 0):
    """Forward launcher: returns (o [T, H, d_v], lse [T, H] fp32). ``out``/``lse`` may be given
    (e.g. NaN-poisoned buffers in tests); every valid row of both is written, except the rows at
    positions < ``first_row`` of each sequence: those are neither read nor written (``dense_prefix``)."""
    cu, ms = cu_or_one(cu_seqlens, q.shape[0], q.device)
    G, h = _check(q, k, v, block_idx, cu, block_size)
    T, H, dk = q.shape
    dv = v.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(dk)
    max_seqlen = max_seqlen or ms or int((cu[1:] - cu[:-1]).max().item() if cu.numel() > 1 else 0)
    out = torch.empty(T, H, dv, device=q.device, dtype=q.dtype) if out is None else out
    lse = torch.empty(T, H, device=q.device, dtype=torch.float32) if lse is None else lse
    B = cu.numel() - 1
    if T and B and max_seqlen > first_row:
        BDK, BDV = pow2(dk), pow2(dv)
        BDA, BDB = head_dim_parts(dk)

        def launch(lc):
            _sel_fwd_kernel[(max_seqlen - first_row, G, B)](
                q, k, v, block_idx, cu, out, lse,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                block_idx.stride(0), block_idx.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                scale * LOG2E, first_row,
                H_PER_G=h, N_SEL=block_idx.shape[2], BLOCK=block_size, DK=dk, DV=dv,
                BH=pow2(h), BN=pow2(block_size), BDA=BDA, BDB=BDB, BDV=BDV, PREC=precision(q.dtype), **lc)
        launch_fitting("sel_fwd", (q.device, q.dtype, h, dk, dv, block_size), launch_configs("fwd", BDK, BDV),
                       launch)
        dispatch.note("kernel", "sel_fwd", "triton")
    return out, lse


# queries per dk/dv program: a block every query selected (block 0) is split up; 1024 was close to the
# best of 256-2048 everywhere measured (docs/decisions.md, with the restructurings tried)
SEGMENT = 1024


def reverse_index(block_idx, cu_seqlens, block_size: int, segment: int = SEGMENT, first_row: int = 0) -> dict:
    """Which queries selected each (KV head, selection block), cut into segments; no host sync
    (no boolean indexing, no bincount: each of those waits for the GPU, and the backward's launches
    stalled behind them: docs/decisions.md).

    Buckets are ``g · NBU + global block slot`` with NBU = ⌈T/l'⌉ + B, an upper bound on the
    blocks of all sequences. Returns tensors (int32 unless noted):
      blk_start [NBU]  first token of each global block slot, -1 for an unused slot
      blk_seq   [NBU]  its sequence
      qlist     [E]    query tokens grouped by bucket, ascending within a bucket (stable sort)
      seg_first [G·NBU + 1]  segments of bucket i are seg_first[i] .. seg_first[i+1]-1
      seg_bucket, seg_lo, seg_hi [NSEG]  per segment: its bucket (-1: unused) and qlist range
    NSEG = ⌈E/segment⌉ + G·NBU bounds the segment count, so the grid needs no sync. Everything is
    a pure function of block_idx, so the gradients summed over it are the same on every run.
    Queries at positions < ``first_row`` of their sequence are left out.
    """
    T, G, n = block_idx.shape
    dev = block_idx.device
    B = cu_seqlens.numel() - 1
    NBU = -(-T // block_size) + B
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    blk_off = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    blk_off[1:] = torch.cumsum((lens + block_size - 1) // block_size, 0)
    # each global block slot's sequence and first token (slots past the last block: unused)
    slot = torch.arange(NBU, device=dev)
    slot_seq = torch.searchsorted(blk_off[1:], slot, right=True).clamp_(max=B - 1)
    used_slot = slot < blk_off[-1]
    blk_start = torch.where(used_slot, cu_seqlens[slot_seq] + (slot - blk_off[slot_seq]) * block_size, -1)
    blk_seq = torch.where(used_slot, slot_seq, 0)
    tok = torch.arange(T, device=dev, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens[1:], tok, right=True)                     # [T]
    bi = block_idx.long()
    key = torch.arange(G, device=dev)[None, :, None] * NBU + blk_off[seq][:, None, None] + bi
    listed = bi >= 0
    if first_row:
        listed &= (tok - cu_seqlens[seq] >= first_row)[:, None, None]
    key = torch.where(listed, key, G * NBU).flatten()                             # sentinels: bucket G·NBU
    if G * NBU < 2 ** 31 - 1:
        key = key.to(torch.int32)          # a 32-bit radix sort is about twice as fast
    skey, order = torch.sort(key, stable=True)
    qlist = (order // (G * n)).to(torch.int32)
    # bucket i holds qlist[offsets[i] : offsets[i+1]] (the sorted keys' first positions of each bucket)
    offsets = torch.searchsorted(skey, torch.arange(G * NBU + 1, device=dev, dtype=skey.dtype))
    counts = offsets[1:] - offsets[:-1]
    nseg = (counts + segment - 1) // segment
    seg_first = torch.zeros(G * NBU + 1, dtype=torch.int64, device=dev)
    seg_first[1:] = torch.cumsum(nseg, 0)
    NSEG = -(-key.numel() // segment) + G * NBU
    s = torch.arange(NSEG, device=dev)
    bucket = torch.searchsorted(seg_first, s, right=True) - 1                      # [NSEG]
    used = s < seg_first[-1]
    bucket = torch.where(used, bucket, 0)
    lo = offsets[bucket] + (s - seg_first[bucket]) * segment
    hi = torch.minimum(lo + segment, offsets[bucket + 1])
    i32 = lambda x: x.to(torch.int32)  # noqa: E731
    return {"blk_start": i32(blk_start), "blk_seq": i32(blk_seq), "qlist": qlist, "n_blk_slots": NBU,
            "seg_first": i32(seg_first), "seg_bucket": i32(torch.where(used, bucket, -1)),
            "seg_lo": i32(lo), "seg_hi": i32(hi)}


def selection_attention_bwd(do, q, k, v, o, lse, block_idx, block_size: int, cu_seqlens=None, *,
                            scale=None, max_seqlen: int | None = None, dq=None, dk=None, dv=None,
                            gate=None, dgate=None, accumulate: bool = False, first_row: int = 0):
    """Backward launcher: returns (dq [T, H, d_k], dk [T, G, d_k], dv [T, G, d_v]) in q's dtype.
    Every row of the three is written (zero where no query reached a key). ``gate``/``dgate``
    [T, H] and ``accumulate``: as ``compressed_attention_bwd``'s. ``first_row``: the forward's; the
    queries before it contribute nothing, and their dq rows are left as they are where dq
    accumulates, else zero."""
    cu, ms = cu_or_one(cu_seqlens, q.shape[0], q.device)
    G, h = _check(q, k, v, block_idx, cu, block_size)
    T, H, d_k = q.shape
    d_v = v.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(d_k)
    max_seqlen = max_seqlen or ms or int((cu[1:] - cu[:-1]).max().item() if cu.numel() > 1 else 0)
    do = do.contiguous()
    acc_q, acc_kv = accumulate and dq is not None, accumulate and dk is not None and dv is not None
    dq = torch.empty_like(q) if dq is None else dq
    if first_row and not acc_q:
        dq.zero_()                                                   # the rows before first_row
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    B = cu.numel() - 1
    if not (T and B and max_seqlen):
        return dq, dk, dv
    if max_seqlen <= first_row:          # no query of this call: nothing launched
        return dq, (dk if acc_kv else dk.zero_()), (dv if acc_kv else dv.zero_())
    lse = lse.contiguous()
    delta = torch.empty_like(lse)                                                  # written by _sel_dq_kernel
    GATE, DG, lse_g, sgt, sgh = gate_args(gate, dgate, lse)
    BDK, BDV, BN, prec = pow2(d_k), pow2(d_v), pow2(block_size), precision(q.dtype)
    BDA, BDB = head_dim_parts(d_k)
    spec = (q.device, q.dtype, h, d_k, d_v, block_size)

    def launch_dq(lc):
        _sel_dq_kernel[(max_seqlen - first_row, G, B)](
            q, k, v, block_idx, cu, o, do, lse, delta, dq, GATE, DG, lse_g,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            block_idx.stride(0), block_idx.stride(1), o.stride(0), o.stride(1), do.stride(0), do.stride(1),
            lse.stride(0), lse.stride(1), dq.stride(0), dq.stride(1), sgt, sgh, scale, scale * LOG2E, first_row,
            H_PER_G=h, N_SEL=block_idx.shape[2], BLOCK=block_size, DK=d_k, DV=d_v,
            BH=pow2(h), BN=BN, BDA=BDA, BDB=BDB, BDV=BDV, PREC=prec, GATED=gate is not None, ACC=acc_q, **lc)
    launch_fitting("sel_dq", spec, launch_configs("dq", BDK, BDV), launch_dq)
    ri = reverse_index(block_idx, cu, block_size, SEGMENT, first_row)
    NBU, NSEG = ri["n_blk_slots"], ri["seg_bucket"].numel()
    # fp32 partial sums of every segment; summed in segment order by the reduce kernel
    part_k = torch.empty(NSEG, BN, BDA + BDB, device=q.device, dtype=torch.float32)
    part_v = torch.empty(NSEG, BN, BDV, device=q.device, dtype=torch.float32)
    BHB = triton.next_power_of_2(h)

    def launch_dkdv(lc):
        rows = lc.pop("rows")
        _sel_dkdv_kernel[(NSEG,)](
            q, k, v, cu, do, lse_g, delta, part_k, part_v,
            ri["seg_bucket"], ri["seg_lo"], ri["seg_hi"], ri["blk_start"], ri["blk_seq"], ri["qlist"], NBU,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            do.stride(0), do.stride(1), lse.stride(0), lse.stride(1), scale * LOG2E,
            H_PER_G=h, BLOCK=block_size, DK=d_k, DV=d_v, BHB=BHB, BQ=max(1, rows // BHB), BN=BN,
            BDA=BDA, BDB=BDB, BDV=BDV, PREC=prec, **lc)
    launch_fitting("sel_dkdv", spec, launch_configs("dkdv", BDK, BDV, q.element_size()), launch_dkdv)
    _sel_dkdv_reduce_kernel[(NBU, G)](
        part_k, part_v, ri["seg_first"], cu, ri["blk_start"], ri["blk_seq"], dk, dv, NBU,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), scale,
        BLOCK=block_size, DK=d_k, DV=d_v, BN=BN, PK=BDA + BDB, BDK=BDK, BDV=BDV, ACC=acc_kv, num_warps=4)
    dispatch.note("kernel", "sel_bwd", "triton")
    return dq, dk, dv


# -- autograd ------------------------------------------------------------------------------
class _SelectionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_idx, block_size, cu_seqlens, scale, max_seqlen):
        o, lse = selection_attention_fwd(q, k, v, block_idx, block_size, cu_seqlens,
                                         scale=scale, max_seqlen=max_seqlen)
        ctx.save_for_backward(q, k, v, o, lse, block_idx, cu_seqlens)
        ctx.block_size, ctx.scale, ctx.max_seqlen = block_size, scale, max_seqlen
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, block_idx, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = selection_attention_bwd(do, q, k, v, o, lse, block_idx, ctx.block_size, cu_seqlens,
                                             scale=ctx.scale, max_seqlen=ctx.max_seqlen)
        return dq, dk, dv, None, None, None, None, None


def selection_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor,
                        block_size: int, cu_seqlens: torch.Tensor | None = None, *,
                        scale: float | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """NSA selected-block attention, differentiable in q, k and v.

    q [T, H, d_k], k [T, G, d_k], v [T, G, d_v] (packed sequences, fp16/bf16, or fp32);
    block_idx [T, G, n] selection blocks of ``block_size`` tokens per query token and KV head,
    numbered from the token's sequence start, -1 for unused slots; cu_seqlens [B+1] int32
    (None: one sequence of T tokens); scale defaults to 1/sqrt(d_k); max_seqlen (the longest
    sequence) avoids a device sync when given. Returns o [T, H, d_v].
    """
    cu, _ = cu_or_one(cu_seqlens, q.shape[0], q.device)
    return _SelectionAttention.apply(q, k, v, block_idx, block_size, cu, scale, max_seqlen)
