"""Triton block scoring and top-n for NSA prefill: from q, the compressed keys and the compressed
branch's log-sum-exp straight to the ``block_idx`` the selection kernel takes.

For query t and KV head g the score of selection block j is Σ over the group's h heads and over the
compressed tokens i whose span [i·d, i·d + l) overlaps block [j·l', (j+1)·l') of
p_cmp[t, head, i] = exp(q·k_i·scale − lse[t, head]) (0 where i·d + l − 1 > t). Block 0 and the
two local blocks ⌊t/l'⌋, ⌊t/l'⌋ − 1 are forced; the remaining slots go to the highest-scoring
other causal blocks (j·l' <= t), ties to the lower index — the oracle's rule
(``nsa_core.reference.select_blocks``). Output ascending, −1 padded.

One program takes BT consecutive query tokens of one KV group and walks the causal blocks in
chunks of BB (BB·l'/d compressed tokens): it recomputes the chunk's probabilities head by head
and sums them over the group's h heads, maps the sum onto the chunk's blocks with one product by
a 0/1 overlap matrix (the mapping is linear, so once per chunk rather than once per head; a span
that runs into the next chunk's first block carries its share over), and moves the chunk's
candidates that beat the running list of the NS best (n rounded up to a power of two) into it (one
comparison when none does; the first chunk's best NS candidates are the list). Nothing of
size [T, N] or [T, NB] is ever written to memory: the scores live in registers one chunk at a time.

A candidate is a pair (the fp32 score's bits, its block j): non-negative floats order like their
bit patterns (a forced block gets +inf's); a higher score wins, and among equal scores the lower
block. Non-causal blocks never enter.

Needs l' a multiple of d with l'/d a power of two, and l <= l' + d (a span touches at most two
blocks); ``unavailable`` says so otherwise.

Layouts: q [T, H, d_k]; k_cmp [N, G, d_k] packed by cu_cmp; lse [T, H] fp32 (from
``kernels.compressed``, natural log, +inf for a row with no compressed token); cu_seqlens /
cu_cmp [B + 1] int32; block_idx [T, G, n] int32, numbered from the token's sequence start.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.common import (LOG2E, LOG2E_C, block_key, cu_or_one, descriptors_dk, descriptors_usable, dot_dk,
                            head_dim_parts, launch_fitting, pow2, precision, ranks_before, usable)
from kernels.compressed import _check as _check_cmp, _grid_sizes, _load_tile_dk, _n_cmp, _seq, cmp_cu_seqlens
from nsa_core import dispatch

NO_BLOCK: tl.constexpr = tl.constexpr(-2)       # a non-causal candidate's score bits: below real ones and empty slots
EMPTY_J: tl.constexpr = tl.constexpr(2 ** 30)   # empty slots' block numbers (+ slot): after every real block


@triton.jit
def _insert_top(ts, tj, cs, cj):
    """Move the candidates (score bits ``cs`` [BT, BB], blocks ``cj`` [1, BB]) that beat the worst entry of
    the running list (``ts``, ``tj``) [BT, NS] into it, best first, until none does. An entry beats
    another with a higher score, or the same score and a lower block (ties to the lower index); the
    pairs are distinct, so each step moves one per row; a chunk with nothing better costs one
    comparison (no sort). 32-bit pairs, not one int64 key: int64 max/min/select took ~1/3 of the
    kernel's instructions."""
    cmax, cjm, tmin, tjm = _best_and_worst(ts, tj, cs, cj)
    better = ranks_before(cmax, cjm, tmin, tjm)
    while tl.max(better.to(tl.int32), 0) > 0:
        slot = better[:, None] & (ts == tmin[:, None]) & (tj == tjm[:, None])
        ts = tl.where(slot, cmax[:, None], ts)
        tj = tl.where(slot, cjm[:, None], tj)
        cs = tl.where(better[:, None] & (cj == cjm[:, None]), NO_BLOCK, cs)
        cmax, cjm, tmin, tjm = _best_and_worst(ts, tj, cs, cj)
        better = ranks_before(cmax, cjm, tmin, tjm)
    return ts, tj


@triton.jit
def _best_and_worst(ts, tj, cs, cj):
    """Per row: the best candidate (highest score bits, then lowest block) and the list's worst
    entry (lowest score bits, then highest block): (cmax, its block, tmin, its block) [BT] each."""
    cmax = tl.max(cs, 1)
    cjm = tl.min(tl.where(cs == cmax[:, None], cj, 2 ** 31 - 1), 1)
    tmin = tl.min(ts, 1)
    tjm = tl.max(tl.where(ts == tmin[:, None], tj, -1), 1)
    return cmax, cjm, tmin, tjm


@triton.jit
def _first_half(x, BT: tl.constexpr, W: tl.constexpr):
    """Columns 0 .. W/2 − 1 of x [BT, W]."""
    a, _ = tl.split(tl.permute(tl.reshape(x, [BT, 2, W // 2]), [0, 2, 1]))
    return a


@triton.jit
def _score_chunk(ts, tj, carry, Q, QB, LSE, t, t0, bos, tok, tok_ok, cur, c, n_hi, cbos, g, ov, ov_next, KC, KCB,
                 sqt, sqh, skt, skh, slt, slh, scale_log2,
                 CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, H_PER_G: tl.constexpr, DK: tl.constexpr,
                 BT: tl.constexpr, BB: tl.constexpr, BCS: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr,
                 PREC: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr, NS: tl.constexpr):
    """Blocks [c·BB, (c+1)·BB) into the running top list: the probabilities of the chunk's BCS
    compressed tokens are summed over the group's heads first, then mapped onto blocks once
    (the mapping is linear). MASKED=False where every token of the tile sees the whole chunk.
    Rows past the sequence may hold anything (TMA loads the next sequence's queries there): rows
    never mix, and those are never stored."""
    i = c * BCS + tl.arange(0, BCS)
    inb = i < n_hi
    # keys past n_hi: masked out of psum below (MASKED), so they need no zeroing
    ka, kb = _load_tile_dk(KC, KCB, cbos + c * BCS, g, (cbos + i).to(tl.int64) * skt + g * skh, inb, DK, BDA, BDB, BCS,
                           TMA, False)
    if MASKED:
        vis = tok_ok[:, None] & inb[None, :] & (i[None, :] * CMP_STRIDE + CMP_LEN - 1 <= tok[:, None])
    psum = tl.zeros([BT, BCS], tl.float32)
    for hh in range(H_PER_G):
        # q is re-read for every chunk (a program's 64 tokens × h heads are 256 KB at d_k 128, more
        # than it can hold), and the ~2 programs per SM together hold more q than L2 does: at 64k on
        # the H100 the kernel read 17.5 GB from DRAM (ncu), about what re-reading q per chunk comes
        # to (17.3 GB). Heads go in ascending order on even chunks and descending on odd ones, so the
        # heads read last in one chunk come first in the next while still in L2: 14.5 GB, 7.81 ->
        # 7.29 ms at d_k 128 (d_k 192: 27.8 -> 26.9 GB, 10.93 -> 10.96-11.00 ms). Programs of 16 or
        # 32 tokens with 2-16 heads in the rows of one dot, so that q stays in L2, were slower
        # (11.1-27.8 vs 7.9 ms at d_k 128): summing the heads' rows costs a layout conversion
        head = g * H_PER_G + tl.where(c % 2 == 0, hh, H_PER_G - 1 - hh)
        qa, qb = _load_tile_dk(Q, QB, bos + t0, head, t * sqt + head * sqh, tok_ok, DK, BDA, BDB, BT, TMA, False)
        # rows past the sequence load lse = +inf: p = 0
        lse2 = tl.load(LSE + t * slt + head * slh, mask=tok_ok, other=float("inf")) * LOG2E_C
        s = dot_dk(qa, qb, ka, kb, BDB, PREC) * scale_log2
        if MASKED:
            psum += tl.where(vis, tl.exp2(tl.where(vis, s, 0.0) - lse2[:, None]), 0.0)
        else:
            psum += tl.exp2(s - lse2[:, None])
    blk = tl.dot(psum, ov, input_precision=PREC)                                     # [BT, BB]
    jb = tl.arange(0, BB)
    blk += tl.where(jb[None, :] == 0, carry[:, None], 0.0)
    carry = tl.sum(psum * ov_next[None, :], 1)
    j = c * BB + jb
    causal = tok_ok[:, None] & (j[None, :] <= cur[:, None])
    forced = (j[None, :] == 0) | (j[None, :] == cur[:, None]) | (j[None, :] == cur[:, None] - 1)
    bits = tl.where(forced, 0x7F800000, blk.to(tl.int32, bitcast=True))
    if c == 0:
        # the list is empty: it becomes the chunk's BB candidates, as the insert loop would leave it after BB
        # passes (every causal candidate beats an empty slot; a non-causal one leaves its slot empty).
        # H100, bf16, d 128, do_bench, rounds alternating with the loop, same blocks, ms: 8k 0.231-0.235 vs
        # 0.280-0.296, 16k 0.573-0.575 vs 0.670-0.672, 64k 7.04-8.16 vs 7.32-8.24. (Chunk 0 peeled out of the loops as
        # a constexpr case instead, four inlined copies of this function: 0.246 / 0.598 / 7.71-8.01 ms. Every later
        # chunk merged into the list by one sort of the 2·BB: 0.270 / 0.691 / 7.60-7.71; that sort only where more
        # than 3 candidates enter: 0.283 / 0.758 / 8.9-9.3.)
        if NS == BB:
            ts = tl.where(causal, bits, -1)
            tj = tl.where(causal, j[None, :], EMPTY_J + jb[None, :])
        else:
            # the list holds the NS best: the chunk's candidates sorted as (score bits, 2^31 − 1 − block)
            # keys, best first, and the first NS kept (an empty slot: -1, after every real block)
            key = _first_half(tl.sort(block_key(tl.where(causal, bits, -1), j[None, :]), 1, descending=True), BT, BB)
            if BB // NS == 4:           # BB / NS is 2 or 4: BB = max(32, NS) and NS >= 8 (the launcher)
                key = _first_half(key, BT, BB // 2)
            js = tl.arange(0, NS)
            ts = (key >> 32).to(tl.int32)
            tj = tl.where(ts == -1, EMPTY_J + js[None, :], 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32))
    else:
        ts, tj = _insert_top(ts, tj, tl.where(causal, bits, NO_BLOCK), j[None, :])
    return ts, tj, carry


@triton.jit
def _score_topn_kernel(Q, QB, KC, KCB, LSE, CU, CUC, IDX,
                       sqt, sqh, skt, skh, slt, slh, sit, sig, scale_log2,
                       CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, BLOCK: tl.constexpr, N_SEL: tl.constexpr,
                       H_PER_G: tl.constexpr, DK: tl.constexpr, BT: tl.constexpr,
                       BB: tl.constexpr, BCS: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr,
                       PREC: tl.constexpr, TMA: tl.constexpr, NS: tl.constexpr):
    g = tl.program_id(1)
    bos, seq_len, cbos, n_seq = _seq(CU, CUC, tl.program_id(2))
    # the last tiles (the most causal blocks) first, so that the longest programs do not make the grid's tail.
    # H100, bf16, d 128, do_bench, four rounds alternating, ms: 0.280 vs 0.296-0.298 at 8k; 64k 7.75-8.16 vs
    # 7.60-8.15 (a noisy machine: the layer's forward took 48.7-51.4 ms in the same run, 45.4-45.9 in others)
    t0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BT
    if t0 < seq_len:
        tok = t0 + tl.arange(0, BT)                                   # the tile's tokens (rows of the scores)
        tok_ok = tok < seq_len
        t = (bos + tok).to(tl.int64)
        cur = tok // BLOCK
        # overlap of the chunk's BCS spans with its BB blocks; the same for every chunk (chunks align to blocks)
        sp = tl.arange(0, BCS)
        jb = tl.arange(0, BB)
        start = sp * CMP_STRIDE
        ov = ((start[:, None] < (jb[None, :] + 1) * BLOCK) & (start[:, None] + CMP_LEN > jb[None, :] * BLOCK)).to(tl.float32)
        ov_next = (start + CMP_LEN > BB * BLOCK).to(tl.float32)     # runs into the next chunk's first block
        t_last = tl.minimum(t0 + BT, seq_len) - 1
        n_hi = tl.minimum(_n_cmp(t_last, CMP_LEN, CMP_STRIDE), n_seq)
        c_full = tl.minimum(_n_cmp(t0, CMP_LEN, CMP_STRIDE), n_seq) // BCS     # chunks every token sees whole
        # the running list holds the NS best entries only (NS: n rounded up to a power of two, at least 8; not
        # BB): a candidate enters when it beats the NS-th best, about half as often as the BB-th, and every
        # entry costs the insert loop a pass with a CTA-wide reduction. H100, bf16, do_bench, three rounds, ms, blocks
        # bit-identical, NS 16 vs BB 32: 8k 0.211-0.212 vs 0.232-0.234, 16k 0.513-0.518 vs 0.574-0.581, 64k
        # 6.86-7.01 vs 7.21-7.31, d_k 192 64k 10.15-10.30 vs 10.66-11.91. (With the insert loop replaced by an
        # elementwise max, outputs meaningless, the BB list's kernel took 5.95-6.03 ms at 64k vs 7.21-8.10.)
        js = tl.arange(0, NS)
        ts = tl.full([BT, NS], -1, tl.int32)                            # empty slots: below every real score,
        tj = EMPTY_J + js[None, :] + tl.zeros([BT, NS], tl.int32)       # distinct, after every real block
        carry = tl.zeros([BT], tl.float32)
        for c in range(0, c_full):
            ts, tj, carry = _score_chunk(ts, tj, carry, Q, QB, LSE, t, t0, bos, tok, tok_ok, cur, c, n_hi, cbos, g,
                                         ov, ov_next, KC, KCB, sqt, sqh, skt, skh, slt, slh, scale_log2, CMP_LEN,
                                         CMP_STRIDE, H_PER_G, DK, BT, BB, BCS, BDA, BDB, PREC, False, TMA, NS)
        for c in range(c_full, t_last // BLOCK // BB + 1):
            ts, tj, carry = _score_chunk(ts, tj, carry, Q, QB, LSE, t, t0, bos, tok, tok_ok, cur, c, n_hi, cbos, g,
                                         ov, ov_next, KC, KCB, sqt, sqh, skt, skh, slt, slh, scale_log2, CMP_LEN,
                                         CMP_STRIDE, H_PER_G, DK, BT, BB, BCS, BDA, BDB, PREC, True, TMA, NS)
        # the NS best, unordered: keep the N_SEL best (NS may be larger), written ascending, sorted once
        top = tl.sort(block_key(ts, tj), 1, descending=True)
        taken = (top >= 0) & (js[None, :] < N_SEL)
        blocks = tl.where(taken, 0x7FFFFFFF - top.to(tl.int32), 0x7FFFFFFF)      # the low word: the block
        blocks = tl.sort(blocks, 1)                                   # ascending, the padding last
        blocks = tl.where(blocks == 0x7FFFFFFF, -1, blocks)
        tl.store(IDX + t[:, None] * sit + g * sig + js[None, :], blocks,
                 mask=tok_ok[:, None] & (js[None, :] < N_SEL))


def unavailable(cmp_len: int, cmp_stride: int, block_size: int, n_selected: int) -> str | None:
    """Why the kernel cannot take this block geometry (None: it can)."""
    if block_size % cmp_stride:
        return f"selection block l'={block_size} is not a multiple of the compression stride d={cmp_stride}"
    r = block_size // cmp_stride
    if r & (r - 1):
        return f"l'/d = {r} is not a power of two"
    if cmp_len > block_size + cmp_stride:
        return f"a compressed span (l={cmp_len}) may touch more than two selection blocks (l' + d = {block_size + cmp_stride})"
    if n_selected > 64:
        return f"n={n_selected} selected blocks is more than the kernel's 64"
    return None


def launch_configs(h: int, BDK: int, n_selected: int, itemsize: int = 2) -> list[dict]:
    """BT query tokens per program (the rows of every dot, at least 16) and BB blocks per chunk
    (at least n: the running list of the n best is at most BB wide). The measured settings first, then smaller
    ones for a GPU with less shared memory per block (``common.launch_fitting`` runs the first that loads).

    From a sweep on the H100 at 64k, h=16, G=4, bf16 (BT × BB × warps × stages): d_k=128 BT 64 /
    BB 32 / 4 warps / 3 stages 8.9 ms (2 stages 9.4; 8 warps: 12.9; BT 128: 10.1-10.9; BT 32: 13.4;
    BB 16: 17.0-17.6; BB 64: 33.5); d_k=192
    (padded to 256) BT 128 / 8 warps 15.7 ms (BT 64: 15.9 with 3 stages, 21.2 with 4 warps). The
    kernel that mapped every head onto blocks before summing them took 15.4 and 21.5 ms. With q
    and the compressed keys loaded through tensor descriptors (``tma``): d_k=128 BT 64 / 4 warps /
    3 stages 8.2 ms vs 8.8 with pointer loads (2 stages 10.2; BT 128 / 8 warps 13.3); d_k=192 BT 64
    / 4 warps / 2 stages 13.9 ms vs 15.6 (BT 128 / 8 warps 16.8). With d_k=192 loaded as two
    power-of-two parts (128 + 64, two descriptors each for q and the keys) 3 stages fit: 11.1 ms
    vs 13.9 padded (2 stages 13.1; BT 128 / 8 warps 17.6; BT 64 / 8 warps 25.5); the same blocks.

    What the running top list costs (H100, d_k 128, descriptors): the same chunk loop storing each
    chunk's block scores [T, G, NB] instead took 7.72-7.84 ms at 64k vs 7.38-7.91 for this kernel
    (that loop with 8 warps 9.97; BT 128 / 8 warps 11.3; BB 16 11.6; BB 64 17.4), and 0.204 vs 0.297
    ms at 8k: a separate top-n could only pay off at short lengths, and only after its own pass. At 64k
    the time is the scores themselves: ncu there, 255 registers and 83 KB of shared memory per
    program (2 per SM, 12.5% occupancy), issue slots 35% busy, tensor pipe 34%, MUFU (exp2) 33%.
    Registers capped (``maxnreg``) for a third program per SM spill and were slower: 2 stages with
    200 / 168 / 128 registers 11.98-12.00 / 14.32-14.61 / 20.99-21.02 ms at 64k vs 7.50-7.94 (2
    stages uncapped 8.38-8.77; 3 stages with 168, 15.06-15.37); at 8k 0.39 / 0.44 / 0.65 vs 0.30.
    Also slower: programs laid out as the compressed forward's (BT tokens × the h heads in the rows of
    each dot, q loaded once a program, no re-read per chunk), each chunk's probabilities mapped onto
    blocks by one product per row before the head sum, so that the sum is over [rows, BB] rather than
    [rows, BCS]: H100, d_k 128, do_bench, ms, best setting (64 rows, BB 16, 4 warps, 2 stages, keys
    through descriptors) 0.443 / 1.24 / 12.3 at 8k / 16k / 64k vs 0.295 / 0.77 / 7.7-7.9 (128 rows
    0.53 / 1.51 / 15.2; 8 warps 0.50 / 1.40 / 14.0; BB 32 1.10 / 3.17 / 32.0); d_k 192 17.0 vs 11.1-11.5.
    Later, that layout with the heads summed first, by a reshape of p to [BT, h, BCS] (a token's heads are rows of
    one warp: register adds and shuffles, no layout conversion in Triton's IR), and the block sums by another ([BT,
    BB, l'/d], the overhang moved by ``tl.gather``, as the decode step's), no product: H100, bf16, d_k 128,
    do_bench, three rounds, ms, 128 rows / BB 16 / 4 warps / 2 stages (the best of 128 or 256 rows, BB 16 or 32, 4
    or 8 warps, 2 or 3 stages, pointer or descriptor keys) 0.276-0.282 / 0.825-0.830 / 9.37-9.47 at 8k / 16k / 64k
    vs 0.290-0.309 / 0.771-0.780 / 7.37-7.82; on random inputs ~1% of the rows chose other blocks than this kernel
    (near-ties; the `triton` suite's selection cases passed with it under the interpreter). At 64k with parts of it
    cut out (outputs then meaningless): without the running top list 6.8-7.3 ms, also without the block sums
    5.6-6.3, also without the head sum 5.0-5.3: the products and exp2 are cheaper than here, but with 8 tokens a
    program the per-token work after them (a list insert loop whose every pass is a CTA-wide reduction) costs more
    than it saves.
    And the head loop of a chunk (H100, do_bench, three rounds, 64k d_k 128 / 8k / 64k d_k 192, ms, vs 7.45-8.00 /
    0.297-0.298 / 11.1-11.5): unrolled by 2 (``loop_unroll_factor``) 8.0-8.5 / 0.296-0.298 / 15.4-15.5; fully unrolled
    (``static_range``) 12.4 / 0.50 / 20.3; its own 2 stages 8.25-8.35 / 0.306-0.307 / 11.9; 1 stage 9.7 / 0.35 / 15.6;
    warp-specialized: Triton 3.6's NVGPUWarpSpecialization pass fails on it. The lse of the program's h heads loaded
    once (a [BT, h] tile; each head's column picked in the loop) instead of per head and chunk (H100, do_bench, three
    rounds alternating, ms): 8k 0.229-0.236 vs 0.232-0.240, 16k 0.566-0.567 vs 0.575-0.578, 64k 7.21-7.42 vs
    7.12-7.35; the same blocks at 8k and 16k, not at 64k (the compiled arithmetic differs: near-ties went the other
    way): not taken. (Compiled for sm90 by Triton 3.9, the kernel waits for each chunk's keys as it loads them and
    for each head's product as it issues it; only the q loads run ahead. Not checked with the GPU's Triton 3.6. The
    head loop pipelined by hand, the next head's product issued before this head's exp2, compiled the same way, a
    wait right after each product, and spilled: not run.)
    Where the time goes at 64k (H100, d_k 128, do_bench, three rounds, ms; outputs meaningless where parts are cut):
    as shipped 6.96-7.65; every program reading the q of one tile (so that q stays in L2) 6.52-6.91; no exp2 (p = s −
    lse) 5.40-5.56; both 4.57-4.76. The exp2 costs more than the re-read q, yet moving half of them to the FMA pipes
    (the odd columns of each product by a degree-5 fit of 2^f after a round-to-nearest split, 2.3e-7 relative error;
    ``tl.split`` / ``tl.join`` kept the product's layout, no conversion in the head loop) was slower: 9.03-9.42 vs
    7.06-7.16 at 64k, 0.274 vs 0.238 at 8k, 0.705 vs 0.589 at 16k (blocks equal but for 2 of 262144 rows at 64k):
    the loop is bound by issue and latency, not by the MUFU's throughput. Chunks of 256 compressed tokens (BB 64,
    q re-read half as often) with 8 warps: 14.7-15.1 ms (ptxas: 255 registers, 176 bytes spilled).
    The head sum on the tensor cores instead of one fp32 add per element (each head's p rounded to q's dtype
    and multiplied by the overlap matrix, its last span's overhang as an extra column: one [BT, 2·BB] product,
    or a [BT, BB] and a [BT, 16] one; sm90 SASS per element one FFMA, one MUFU and half an F2FP instead of
    FFMA, MUFU and FADD): slower, H100, bf16, do_bench, three rounds, ms, 8.12-8.20 / 8.17-8.35 vs
    7.35-7.53 at 64k d_k 128, 0.248 / 0.257-0.258 vs 0.233-0.234 at 8k, 0.613-0.619 / 0.642-0.650 vs 0.575-0.590 at
    16k, d_k 192 64k 10.9-12.0 / 11.3-12.9 vs 10.7-11.3; 3.3% of the rows at 64k chose other blocks (p in
    bf16: near-ties). And exp2 on packed halves (``ex2.approx.f16x2`` / ``.bf16x2`` by inline asm, the head
    sum in ``add.f16x2``): ptxas for sm90 (Triton 3.9) issues one MUFU.EX2.F16 per half, as many MUFU ops as
    now plus the packing, so it was not run. The head loop software-pipelined by hand in Gluon (Triton 3.6's
    ``triton.experimental.gluon``: TMA loads into shared memory with mbarriers, head h+1's product issued as an
    async wgmma before head h's exp2, 255 registers; with the head loop not unrolled ptxas serialized the wgmmas),
    against the same work in plain Triton (the chunks every token of a tile sees whole, no masks, no top list;
    outputs within bf16 rounding of an fp32 reference): H100, do_bench, three rounds, ms, 64k 4.90-5.02 vs
    5.01-5.06, 16k 0.299-0.300 vs 0.301-0.326, 8k 0.097 both: no gain, not taken."""
    BB = max(32, triton.next_power_of_2(n_selected))
    smaller = [{"BT": 32, "BB": BB, "num_warps": 4, "num_stages": 1}, {"BT": 16, "BB": BB, "num_warps": 4, "num_stages": 1}]
    if itemsize > 2:      # fp32 tiles are twice the bytes: 64 tokens, 3 stages need 256 KiB of shared memory
        return smaller
    tma = [{"BT": 64, "BB": BB, "num_warps": 4, "num_stages": 3, "tma": True}]
    if BDK > 128:
        tma.append({"BT": 64, "BB": BB, "num_warps": 4, "num_stages": 2, "tma": True})
        measured = [{"BT": 128, "BB": BB, "num_warps": 8, "num_stages": 2},
                    {"BT": 64, "BB": BB, "num_warps": 4, "num_stages": 2}]
    else:
        measured = [{"BT": 64, "BB": BB, "num_warps": 4, "num_stages": 3},
                    {"BT": 64, "BB": BB, "num_warps": 4, "num_stages": 2}]
    return [*tma, *measured, *smaller]


def select_blocks(q: torch.Tensor, k_cmp: torch.Tensor, lse: torch.Tensor, cmp_len: int, cmp_stride: int,
                  block_size: int, n_selected: int, cu_seqlens: torch.Tensor | None = None,
                  cu_cmp: torch.Tensor | None = None, *, scale: float | None = None,
                  max_seqlen: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """NSA block selection for every query token: block_idx [T, G, n] int32, ascending, −1 padded.

    q [T, H, d_k]; k_cmp [N, G, d_k]; lse [T, H] fp32 the compressed branch's log-sum-exp over the
    same q and k_cmp (``kernels.compressed.compressed_attention``); cu_seqlens / cu_cmp [B+1]
    int32 (None: one sequence of T tokens; cu_cmp derived); max_seqlen avoids a device sync.
    ``out`` may be given (e.g. a NaN-poisoned buffer in tests); every row is written.
    """
    why = unavailable(cmp_len, cmp_stride, block_size, n_selected)
    if why:
        raise ValueError(why)
    T, H, dk = q.shape
    cu_seqlens, one = cu_or_one(cu_seqlens, T, q.device)
    max_seqlen = max_seqlen if max_seqlen is not None else one
    if cu_cmp is None:
        cu_cmp = cmp_cu_seqlens(cu_seqlens, cmp_len, cmp_stride)
    G, h = _check_cmp(q, k_cmp, k_cmp, cu_seqlens, cu_cmp)
    if lse.shape != (T, H) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be [T, H] = [{T}, {H}] fp32; got {tuple(lse.shape)} {lse.dtype}")
    scale = scale if scale is not None else 1.0 / math.sqrt(dk)
    max_seqlen, _ = _grid_sizes(cu_seqlens, cmp_len, cmp_stride, max_seqlen)
    out = torch.empty(T, G, n_selected, device=q.device, dtype=torch.int32) if out is None else out
    B = cu_seqlens.numel() - 1
    if T and B and max_seqlen:
        _Launch.apply(q, k_cmp, lse, cu_seqlens, cu_cmp, out, scale, max_seqlen, G, h,
                      cmp_len, cmp_stride, block_size, n_selected)
        dispatch.note("kernel", "select", "triton")
    return out


class _Launch(torch.autograd.Function):
    """The launch, run as an autograd Function only so that torch.profiler records an op around it:
    a bare Triton launch inside a ``record_function`` range is not attributed to that range (seen on
    the H100 with torch 2.11), and the suites prove from the range which kernel ran. Not
    differentiable (selection is discrete)."""

    @staticmethod
    def forward(ctx, q, k_cmp, lse, cu_seqlens, cu_cmp, out, scale, max_seqlen, G, h,
                cmp_len, cmp_stride, block_size, n_selected):
        B, dk = cu_seqlens.numel() - 1, q.shape[2]
        BDK = pow2(dk)
        configs = launch_configs(h, BDK, n_selected, q.element_size())
        # a descriptor's block is at most 256 per dimension
        tma = BDK <= 256 and all(c["BB"] * (block_size // cmp_stride) <= 256 for c in configs) and \
            descriptors_usable(q, k_cmp)

        BDA, BDB = head_dim_parts(dk)                   # d_k as two power-of-two parts (192: 128 + 64)

        def launch(lc):
            BT, BB, use_tma = lc.pop("BT"), lc.pop("BB"), lc.pop("tma", False)
            qa, qb, kc, kcb = q, q, k_cmp, k_cmp
            if use_tma:
                qa, qb = descriptors_dk(q, BT, BDA, BDB)
                kc, kcb = descriptors_dk(k_cmp, BB * (block_size // cmp_stride), BDA, BDB)
                dispatch.note("kernel", "select@tma", "triton")
            _score_topn_kernel[(triton.cdiv(max_seqlen, BT), G, B)](
                qa, qb, kc, kcb, lse, cu_seqlens, cu_cmp, out,
                q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), lse.stride(0), lse.stride(1),
                out.stride(0), out.stride(1), scale * LOG2E,
                CMP_LEN=cmp_len, CMP_STRIDE=cmp_stride, BLOCK=block_size, N_SEL=n_selected, H_PER_G=h, DK=dk,
                BT=BT, BB=BB, BCS=BB * (block_size // cmp_stride), BDA=BDA, BDB=BDB,
                PREC=precision(q.dtype), TMA=use_tma, NS=max(8, triton.next_power_of_2(n_selected)), **lc)
        launch_fitting("select", (q.device, q.dtype, h, dk, cmp_len, cmp_stride, block_size, n_selected, tma),
                       usable(configs, tma), launch)
        ctx.mark_dirty(out)                         # written in place (the caller's buffer)
        ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("block selection is not differentiable")
