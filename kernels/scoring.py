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
                            fp32_compiled, head_dim_parts, launch_fitting, pow2, precision, ranks_before, usable)
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
        # than it can hold), and the ~2 programs per SM together hold more q than L2 does. Heads go in
        # ascending order on even chunks and descending on odd ones, so the heads read last in one chunk
        # come first in the next while still in L2 (less read from DRAM: docs/decisions.md)
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
        # passes (every causal candidate beats an empty slot; a non-causal one leaves its slot empty): faster than
        # running the loop (docs/decisions.md)
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
    # the last tiles (the most causal blocks) first, so that the longest programs do not make the grid's tail
    # (docs/decisions.md)
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
        # entry costs the insert loop a pass with a CTA-wide reduction (faster than a list of BB: docs/decisions.md)
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

    The measured settings are the fastest of sweeps on an H100 at 64k (q and the keys through tensor descriptors
    where usable, d_k = 192 as two power-of-two parts): docs/decisions.md."""
    BB = max(32, triton.next_power_of_2(n_selected))
    smaller = [{"BT": 32, "BB": BB, "num_warps": 4, "num_stages": 1}, {"BT": 16, "BB": BB, "num_warps": 4, "num_stages": 1}]
    # fp32 tiles are twice the bytes (64 tokens, 3 stages need 256 KiB of shared memory); compiled, the smallest
    # (``fp32_compiled``: 16 tokens spill less than 32 and compile faster)
    if itemsize > 2:
        return smaller[1:] if fp32_compiled(itemsize) else smaller
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
    a bare Triton launch inside a ``record_function`` range is not attributed to that range (where it
    was seen: docs/decisions.md), and the suites prove from the range which kernel ran. Not
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
