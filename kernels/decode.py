"""Triton NSA decode step: selection for the new token, then all three branches for all h heads
of a KV group, split over the context (flash-decoding style), with no host synchronisation.

A step is five launches (four at few rows: item 2) over preallocated buffers (``LAUNCHES``), so it can
be captured in a CUDA graph (the position is a device tensor; no shape depends on it):

1. ``_cmp_partial_kernel`` over the compressed cache: one program per (batch row · KV head, chunk of
   compressed tokens). Given the new token's k/v (``DecodeStep``), it first writes them into the raw
   cache: this launch reads no raw token (an append launch of its own was slower: docs/decisions.md).
   Each program keeps an online softmax over its tiles and writes an unnormalised partial (max,
   sum, acc). For selection it also writes, per tile of BNC compressed tokens and
   head, the softmax's p = exp2(s − running max) summed onto the selection blocks its tokens'
   spans overlap (p reshaped to [h, blocks, l'/d] and summed where the geometry allows, ``SUMS_BY_RESHAPE``;
   else a product by a 0/1 overlap matrix), and that max: 17 + 1 numbers per head for 64 tokens, instead of the 64 logits
   themselves (those, written here and read back by the scorer, would make a DRAM round trip). They
   are stored evict_last, so that the cache streaming through L2 does not evict them before they are
   scored (docs/decisions.md).
2. ``_scores_kernel`` (one program per (batch row · KV head, 64 selection blocks)) merges the
   compressed partials into each head's softmax max M and normaliser L, rescales the tiles' block
   sums by exp2(their max − M) / L and sums them over the tiles that reach a block and over the h
   heads: the selection-block scores, turned into top-n keys (``_candidates``), of which each program
   keeps its best n; ``_topn_kernel`` (one program
   per (row · KV head)) takes the top n of those (block 0 and the two local blocks forced; ties to the
   lower index), written ascending and −1 padded: exactly docs/nsa.md. Under the early trigger at B·G up to
   ``TOPN_IN_SELECTION_ROWS`` there is no top-n launch: each selection program of launch 3 ranks its row's
   candidates itself (a step of four launches).
3. ``_winsel_partial_kernel`` over the window (positions max(0, t−w+1) .. t) and the selected blocks
   (positions j·l' .. min(j·l'+l', t+1)−1), in tiles of one selection block (two at B·G 9–16:
   ``TWO_BLOCK_TILES``).
4. ``_merge_kernel``: log-sum-exp merge of each branch's partials -> o per branch, the
   gate-weighted mix when a gate is given, and the tokens each branch's programs loaded.

On Hopper and later the step's kernels (a separate cache append included) are launched as programmatic
dependent launches: each is set up while the one before it runs and waits, first thing, until
that one has finished and its writes are visible (``_grid_dependency``; the merge reads the
compressed partials, written at least two launches back, before it waits: ``CMP_EARLY``), which takes the launch
gaps out of a small step (``PDL``). For few rows the
next launch is let go when a kernel starts; for many, when its programs' loops are done (``EARLY_TRIGGER_ROWS``),
except the top-n, which lets it go before its own wait. Where the step appends the new token itself (``DecodeStep``
given k_new/v_new) and runs all three branches, the window programs do not wait at all: they read nothing the step's
earlier launches write (the new token's k/v come from its own buffer; ``WIN_NOWAIT``), so the window streams while
the top-n ranks. (``LayerDecodeStep`` runs the step so too: its φ takes token t from the new token's row.) There,
above EARLY_TRIGGER_ROWS, the merge of a (row · KV head) starts as soon as that row's window + selection programs
have stored their partials, counted per row, rather than when the whole launch has finished (``ROW_SYNC``).

The grids are sized for the cache's capacity (a graph replays them at every position), the work for
the tokens held: the compressed launch splits the compressed tokens at position t as it would split a
full cache of t + 1 tokens (``_cmp_split``; its programs past them return at once), the scorer scores only
the blocks up to t's and the top-n ranks only the keys of the scoring programs that reach them, and the
merge reads only the partials written (the compressed ones in groups, where a plan has many: ``MERGE_GROUP``).
So a cache allocated with room to grow costs about what a full one does (docs/performance.md). A caller that knows
the position (``NSAAttention.decode`` does) plans for fewer tokens still: a step with a ``horizon`` serves the
positions below it only, and the layer step takes the next power of two above t (``horizon()``), so that a cache
with room to grow runs a full cache's plan, and changes plan as it fills.

Every program loads only the tokens docs/nsa.md counts (masked loads: a token outside its range is
never read) and counts them; those counts are the measured reads of the ``counters`` suite.
``branches=`` runs only the work of the named branches (selection belongs to ``sel``), so each
branch can be timed alone.

Layouts: q [B, H, d_k] (the new token, H = G·h, head g·h + j in group g); raw cache k/v
[B, T_max, G, d_k|d_v]; compressed cache k_cmp/v_cmp [B, N_max, G, d_k|d_v]; pos [B] int32 =
t, the new token's position (its k/v already in the cache). Entries past t (or past n_cmp(t)) may
hold anything, NaN included: they are never read.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.common import LOG2E, block_key, head_dim_parts, load_dk, ilog2, precision, sm_count, topk_of_runs
from nsa_core import dispatch
from nsa_core.config import BRANCHES, NSAConfig
# launch configuration, from sweeps of the graph-replayed step on an H100 (docs/decisions.md): partial programs of
# 4 warps (8 were slower; their stages: ``PARTIAL_STAGES``); top-n programs of 8 warps (4 the same, fewer slower); a
# merge program's d_v columns: ``_launch_shape``
PARTIAL_WARPS, SELECT_WARPS, MERGE_WARPS = 4, 8, 4
# ``DecodeStep``'s launches, in launch order (the decode suite labels Nsight Compute's per-kernel
# rows with them; at B·G up to TOPN_IN_SELECTION_ROWS on Hopper, all but the top-n), and which branches' cache
# tokens each launch reads
LAUNCHES = ("append + compressed partial (+ block sums)", "block scores", "top-n", "window + selection partial",
            "merge")
CACHE_READS = {"append + compressed partial (+ block sums)": ("cmp",), "window + selection partial": ("sel", "win")}
# software-pipelining stages of a partial program's tile loop: 3 on Hopper (sm90, where measured) for 16-bit caches,
# 2 elsewhere; the compressed programs take 3 only where the plan gives one DEEP_TILES tiles or more (the capacity's:
# ``_cmp_split`` may walk fewer). H200, B=16, 2x caches, 3 vs 2: 84.2 vs 93.6 us at 64k, 132.4 vs 158.2 at 128k;
# 4 stages or 8 warps were slower. The window + selection programs take 3 at any tiles (one loop, a pipeline of 90 KB
# of shared memory, two programs an SM; B=16 4k 38.2 vs 44.5 with 2), except the shallow ones (``SHALLOW_MIN_TILES``).
# fp32 tiles with 3 stages outgrow the shared memory (docs/decisions.md)
PARTIAL_STAGES, PARTIAL_STAGES_SM90, DEEP_TILES = 2, 3, 8
MAX_TILES = 16                 # tiles one window + selection program walks at most
# and one compressed program: 32, where that still leaves every SM a program (``_tiles_per_chunk``), so that a plan has
# half the compressed programs of 16 tiles: B=16 at 128k, B=32 at 64k and B=64 at 32k run their compressed launch as
# one wave of 256 programs, two an SM, rather than two waves of 512, 1-4 µs faster on the H200; the plans measured at
# fewer rows or shorter contexts split as before at run time (docs/decisions.md, session 77)
CMP_MAX_TILES = 32
# Shallow window + selection programs: where B·G is above EARLY_TRIGGER_ROWS and, at 2 stages (48 KB of shared memory),
# at least SHALLOW_MIN_TILES tiles a program give every SM two programs and all of them fit in one wave of three an
# SM, the launch takes those tiles and 2 stages rather than 3 stages at two programs an SM, where the kernel so
# compiled lets three programs share an SM (``_fits_per_sm``: 168 registers a thread under Triton 3.6 and 3.8, 179
# under 3.9, which keeps the deep launch). Faster on the H200 at B=16 and 32; slower at B=8 ((2, 2) tiles) and B=64
# 32k (512 programs): hence the bounds (docs/decisions.md, sessions 63 and 65)
SHALLOW_MIN_TILES, SHALLOW_PER_SM = 4, 3
# B·G range (inclusive) in which a window / selection tile holds two selection blocks (128 tokens in the paper
# config) rather than one: half the tile loop's iterations, each with its cross-warp reductions and barriers (ncu:
# that launch is latency-bound on them). Two blocks were faster at B·G 16, the same at 8, slower at 4, 32 and 64
# (docs/decisions.md)
TWO_BLOCK_TILES = (9, 16)
# The compressed programs' block sums without products, where the geometry allows (``Plan.sums_by_reshape``: l'/d a
# power of two dividing the tile, spans reaching at most the next block): p [h, tile tokens] seen as [h, blocks,
# l'/d] and summed over its last axis gives each token's own block; the overhang of the tokens whose span runs into
# the next block, summed the same way, is moved one block on (``tl.gather``), the last one into column TB: the same
# [h, NBT] rows as the products by the 0/1 overlap matrix (two tf32 products of p's split, see the kernel), in plain
# fp32 adds: faster than the products at every B measured, outputs bit-identical (docs/decisions.md)
SUMS_BY_RESHAPE = True
# The merge's compressed partials, where MERGE_GROUP chunks or more and B·G above EARLY_TRIGGER_ROWS: loaded and
# merged MERGE_GROUP chunks at a time, or half the chunks where they are exactly MERGE_GROUP (``merge_group``), only the
# groups that hold chunks in use at the position (``_merge_groups``). Loaded all at once, a cache with room to grow
# costs the merge the capacity's chunks (masked loads): B=16 128k on a 2x cache has 8 chunks of 32 tiles, of which 4
# in use, taken in groups of 4 (measured with the chunks of 16 tiles then: docs/decisions.md, session 68)
# Below EARLY_TRIGGER_ROWS the merge loads the compressed partials before its wait, beside the window + selection
# launch: one load of all, off the step's critical path (docs/decisions.md)
MERGE_GROUP = 8
SCORE_BLOCKS = 64              # selection blocks one scoring program covers
TOPN_CHUNK = 1024             # keys the top-n ranks at a time (``_topn_kernel``)
# compressed tokens per tile of the compressed partials (tiles of 128, of 32 with more stages, and the tile loop
# unrolled were slower: docs/decisions.md)
CMP_TILE = 64
# elements per piece of the append's row copy (``_copy``): 64 made the step slower (docs/decisions.md)
COPY_CHUNK: tl.constexpr = tl.constexpr(128)
# programmatic dependent launch (_grid_dependency) where the GPU has it; the next kernel's launch
# is triggered early only for few (row · KV head)s. It takes the launch gaps out of a small step (docs/decisions.md)
PDL = True
# B·G up to which the early trigger is used (faster up to 16, slower at 64). Above it, each program instead lets the
# next launch start once its own loop is done (``_grid_release``): the next kernel is launched when the last program
# of this one gets there, not when it has exited, and its programs take only the slots this one's finished programs
# freed; that closes the gap between one launch's last program and the next's first (docs/decisions.md)
EARLY_TRIGGER_ROWS = 16
# the merge's loads of the compressed partials moved ahead of its wait (``_grid_dependency``): under
# the early trigger they overlap the window + selection launch. Under the early trigger (GDC 2, up to
# EARLY_TRIGGER_ROWS) the merge also merges and stores the compressed branch (and its share of the gate mix) before
# its wait (``_merge_kernel``'s CMP_MERGE_EARLY), so that after it only the window's and selection's few partials
# remain. Under the late trigger (GDC 3) it merges after: the merge is launched only as the window + selection
# programs end, so there is no time before its wait to fill (docs/decisions.md); except under ``ROW_SYNC``, where it
# is launched as that launch starts and merges the compressed branch before polling its row's count
CMP_EARLY = True
# The window programs of the window + selection launch start without waiting (``_winsel_partial_kernel``'s
# WIN_NOWAIT, the new token read from its own buffer; where the step does the append: ``decode_attention``'s
# ``nowait``), and above EARLY_TRIGGER_ROWS the top-n launch lets that launch go before its own wait (GDC 4): the
# window streams while the top-n ranks (docs/decisions.md)
WIN_NOWAIT = True
# Where the window does not wait and above EARLY_TRIGGER_ROWS, the merge of a (row · KV head) starts as soon as that
# row's window + selection programs have stored their partials, not when the whole launch has finished: that launch
# lets the merge go at its start, each of its programs adds one to its row's count once its partials are stored (a
# barrier, then a release atomic), and the merge's programs, having merged the compressed partials meanwhile, poll
# their row's count (acquire) instead of waiting for the launch (the compressed launch zeroes the counts after its
# wait: by the chain in ``_grid_dependency`` it has finished before any window program starts). The merge's tail
# after the last window + selection program is then one row's, not the launch's (docs/decisions.md)
ROW_SYNC = True
# B·G up to which the step makes no top-n launch: under the early trigger each selection program ranks its row's
# candidates itself before its loop (``_winsel_partial_kernel``'s TOPN) and the window + selection launch follows the
# scores launch, one link fewer in a chain of latency-bound launches. Faster at B=1 and 2, slower at B=4 (B·G 16,
# two-block tiles) on the H200 (docs/decisions.md, session 69)
TOPN_IN_SELECTION_ROWS = 8
# A step for a known position is planned for the next power of two of tokens, not for the cache's capacity, down to
# 1/HORIZON_PARTS of it (``horizon``): on an H200 a 2x cache's capacity plan cost B=16 64k 0.7-1.0 us a step over a
# full cache's (the scorer's idle programs); the floor bounds a cache's plans, each a capture and on a cold Triton
# cache its compiles, to log2(HORIZON_PARTS) + 1 = 4 (docs/decisions.md, session 79)
HORIZON_PARTS = 8


@triton.jit
def _grid_dependency(GDC: tl.constexpr):
    """Programmatic dependent launch (Hopper; ``PDL``): with GDC >= 1 the kernel was launched
    before the previous one finished and waits here until it has (and its writes are visible),
    so nothing it reads can be stale; with GDC = 2 it also lets the next kernel of the step be
    launched now (its programs then wait in turn); GDC = 3 lets it at the end of the program
    (``_grid_release``); GDC = 4 lets it before waiting (the top-n launch above
    EARLY_TRIGGER_ROWS, so that the window programs after it start while it runs, and, the scores
    launch before it triggering after its wait there, while the scoring runs:
    ``_winsel_partial_kernel``'s WIN_NOWAIT). Every kernel of a step waits before it reads what the
    launch before it wrote, so the order is that of plain stream launches (the non-waiting window
    programs, which read nothing those launches write, aside; and under ``ROW_SYNC`` the merge, which
    waits on its row's count of window + selection programs instead).

    What a launch reads of launches further back may be read before the wait: launch N+1 starts
    only once every program of launch N has passed its own wait (a trigger with GDC 2 or 3 comes
    after it) or finished, so launch N−1 has finished and its writes are visible (``CMP_EARLY``).
    With GDC = 4 that holds one launch further back: the top-n's programs have all started, the
    scores launch before it has passed its waits, so the compressed launch has finished."""
    if GDC == 4:
        tl.extra.cuda.gdc_launch_dependents()
    if GDC >= 1:
        tl.extra.cuda.gdc_wait()
    if GDC == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _grid_release(GDC: tl.constexpr):
    """GDC = 3 (late trigger, ``EARLY_TRIGGER_ROWS``): this program's loop is done, so the next
    kernel of the step may be launched; it still waits for this one to finish before reading."""
    if GDC == 3:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _tile(qa, qb, kp, vp, valid, m_i, l_i, acc, scale_log2, offs_dv,
          DK: tl.constexpr, DV: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr,
          PREC: tl.constexpr, WANT_V: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) [BH], [BH, BN], [BH, BDV] with one tile of keys: l_i
    keeps the normaliser per key lane, summed over the lanes once a program (``_partial_store``), not once
    a tile (a sum over the tile's keys crosses warps: a barrier a tile; docs/decisions.md).
    qa [BH, BDA] / qb [BH, BDB]: the query's first BDA columns and the rest (d_k = 192 is 128 + 64:
    no tile padded to 256, so a program's K stages take 3/4 of the shared memory and more programs
    fit on an SM); kp/vp [BN] row pointers; valid [BN]. Returns the new state, and p = exp2(s − m)
    [BH, BN] with the running max m [BH] it is relative to (s: the tile's scores in log2 units;
    p = 0 where not valid). (v is loaded after the scores: loading it with k, for one memory round trip
    rather than two in a program of one tile, was slower or the same: docs/decisions.md.)"""
    ka, kb = load_dk(kp, valid, DK, BDA, BDB)
    s = tl.dot(qa, tl.trans(ka), input_precision=PREC)
    if BDB > 0:
        s += tl.dot(qb, tl.trans(kb), input_precision=PREC)
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)          # no key yet: keep exp2 finite
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha[:, None] + p
    if WANT_V:
        v = tl.load(vp[:, None] + offs_dv[None, :], mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc, p, m_safe


@triton.jit
def _held(offs, t, lo, hi):
    """lo <= t < hi, as a vector shaped like ``offs`` (the interpreter mistypes masks built from loaded scalars)."""
    return (lo + 0 * offs <= t) & (t < hi + 0 * offs)


@triton.jit
def _one_key(qa, qb, kp, vp, t, lo, hi, m_i, l_i, acc, cnt, scale_log2, DK: tl.constexpr, DV: tl.constexpr,
             BH: tl.constexpr, BN: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr):
    """``_tile``'s update with one key, k at kp [d_k] and v at vp [d_v], where lo <= t < hi (the key in lane 0 of
    l_i and cnt): its score and its share of acc in fp32 on the CUDA cores."""
    offs_a = tl.arange(0, BDA)
    offs_v = tl.arange(0, BDV)
    offs_n = tl.arange(0, BN)
    ka = tl.load(kp + offs_a, mask=(offs_a < DK) & _held(offs_a, t, lo, hi), other=0.0).to(tl.float32)
    s = tl.sum(qa.to(tl.float32) * ka[None, :], 1)
    if BDB > 0:
        offs_b = BDA + tl.arange(0, BDB)
        kb = tl.load(kp + offs_b, mask=(offs_b < DK) & _held(offs_b, t, lo, hi), other=0.0).to(tl.float32)
        s += tl.sum(qb.to(tl.float32) * kb[None, :], 1)
    v = tl.load(vp + offs_v, mask=(offs_v < DV) & _held(offs_v, t, lo, hi), other=0.0).to(tl.float32)
    s = tl.where(_held(tl.arange(0, BH), t, lo, hi), s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe)
    alpha = tl.exp2(m_i - m_safe)
    own = (offs_n == 0) & _held(offs_n, t, lo, hi)
    l_i = l_i * alpha[:, None] + tl.where(own[None, :], p[:, None], 0.0)
    acc = acc * alpha[:, None] + p[:, None] * v[None, :]
    return m_new, l_i, acc, cnt + own.to(tl.int32)


@triton.jit
def _block_sums(p, BH: tl.constexpr, TB: tl.constexpr, BLOCK: tl.constexpr, CMP_LEN: tl.constexpr,
                CMP_STRIDE: tl.constexpr):
    """A compressed tile's block sums by reshaping (``SUMS_BY_RESHAPE``): p [BH, TB · l'/d] (token i of the
    tile starts in block i // (l'/d) of it) -> (sums [BH, TB] over blocks 0..TB-1 of the tile, [BH] the
    overhang into block TB). A span reaches one block on at most (l <= l' + d)."""
    R: tl.constexpr = BLOCK // CMP_STRIDE
    p3 = tl.reshape(p, (BH, TB, R))
    r = tl.arange(0, R)
    own = tl.sum(p3, 2)
    over = tl.sum(tl.where((r * CMP_STRIDE + CMP_LEN > BLOCK)[None, None, :], p3, 0.0), 2)   # into the next block
    jb = tl.arange(0, TB)
    prev = tl.gather(over, tl.broadcast_to(tl.maximum(jb - 1, 0)[None, :], (BH, TB)), 1)
    return own + tl.where(jb[None, :] >= 1, prev, 0.0), tl.sum(tl.where(jb[None, :] == TB - 1, over, 0.0), 1)


@triton.jit
def _cmp_split(t, BG, n_sm, CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, BNC: tl.constexpr,
               CMP_TILES: tl.constexpr, HALVINGS: tl.constexpr, C_CMP):
    """How the compressed launch splits the compressed tokens held at position t -> (n_cmp, V tiles of
    BNC tokens that hold them, T tiles a program, chunks in use = cdiv(V, T)). From t, not from the
    cache's capacity, so that a cache with room to grow is split as a full one of t + 1 tokens: the
    ``_tiles_per_chunk`` rule on V (T halved from CMP_TILES, the capacity's, while fewer programs than
    SMs would run), and T at least V / C_CMP, so that the launch's C_CMP chunks cover V. The chunks
    past those in use return at once; the scorer and the merge read only those in use. BG: rows · KV heads."""
    # compressed token i is usable iff i·d + l − 1 <= t
    n_cmp = tl.where(t + 1 >= CMP_LEN, (t + 1 - CMP_LEN) // CMP_STRIDE + 1, 0)
    V = (n_cmp + BNC - 1) // BNC
    T = tl.full([], CMP_TILES, tl.int32)
    for _ in tl.static_range(HALVINGS):
        T = tl.where((T > 1) & ((V + T - 1) // T * BG < n_sm), T // 2, T)
    T = tl.maximum(T, (V + C_CMP - 1) // C_CMP)
    return n_cmp, V, T, (V + T - 1) // T


@triton.jit
def _partial_start(Q, b, g, sqb, sqh, H_PER_G: tl.constexpr, DK: tl.constexpr, BH: tl.constexpr,
                   BN: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr):
    """A partial program's query rows (qa [BH, BDA], qb [BH, BDB]) and empty state: m [BH], l [BH, BN]
    (per key lane, ``_tile``), acc [BH, BDV], and the tokens read per lane, cnt [BN] (summed once
    after the tile loop, not per tile: a sum over the tile's lanes crosses warps, a barrier a tile;
    docs/decisions.md)."""
    rows = tl.arange(0, BH)
    qa, qb = load_dk(Q + b * sqb + (g * H_PER_G + rows) * sqh, rows < H_PER_G, DK, BDA, BDB)
    return (qa, qb, tl.full([BH], float("-inf"), tl.float32), tl.zeros([BH, BN], tl.float32),
            tl.zeros([BH, BDV], tl.float32), tl.zeros([BN], tl.int32))


@triton.jit
def _partial_store(PM, PL, PACC, PCNT, out, m_i, l_i, acc, cnt, BH: tl.constexpr, BDV: tl.constexpr,
                   WANT_V: tl.constexpr):
    """Chunk ``out`` (= bg·NC + c) of the partials: max, normaliser, unnormalised acc, tokens read."""
    rows = tl.arange(0, BH)
    offs_dv = tl.arange(0, BDV)
    tl.store(PM + out * BH + rows, m_i)
    tl.store(PL + out * BH + rows, tl.sum(l_i, 1))
    if WANT_V:
        tl.store(PACC + (out * BH + rows)[:, None] * BDV + offs_dv[None, :], acc)
    tl.store(PCNT + out, tl.sum(cnt, 0))


@triton.jit
def _cmp_partial_kernel(Q, K, V, KC, VC, POS, PM, PL, PACC, PCNT, BSUM, BMAX, KN, VN, DONE,
                        sqb, sqh, skb, skt, skg, svb, svt, svg, skcb, skct, skcg, svcb, svct, svcg,
                        scale_log2, n_sm, C_CMP, NC, NT,
                        G: tl.constexpr, H_PER_G: tl.constexpr, BLOCK: tl.constexpr,
                        CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, CMP_TILES: tl.constexpr,
                        HALVINGS: tl.constexpr, TB: tl.constexpr, NBT: tl.constexpr, NBT_P: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                        BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr,
                        WANT_V: tl.constexpr, WRITE_SCORES: tl.constexpr, STAGES: tl.constexpr,
                        APPEND: tl.constexpr = False, GDC: tl.constexpr = 0, SUM_RESHAPE: tl.constexpr = False,
                        ROW_SYNC: tl.constexpr = False):
    """Launch 1: program (bg, c) over chunk c of the compressed tokens held (``_cmp_split``), BN a
    tile. C_CMP (chunks), NC (chunks of all branches) and NT (tiles) are plain arguments, not
    constexprs: steps over caches of different lengths can share a compile (Triton still
    specialises an integer of 1 and multiples of 16)."""
    _grid_dependency(GDC)
    bg = tl.program_id(0)
    c = tl.program_id(1)
    # 64-bit: the cache strides fit in int32, row b's offset b · (T_max · G · d) may not (B=44 at 64k, B=32 at 128k)
    b = (bg // G).to(tl.int64)
    g = bg % G
    t = tl.load(POS + b)
    if APPEND:
        # the compressed launch also writes the new token's k/v (KN/VN [B, G, d], contiguous) at t, one
        # program per (row, KV head): it reads no raw token, and the window/selection launch after it does
        if c == 0:
            _append_row(K, V, KN, VN, b, g, t.to(tl.int64), skb, skt, skg, svb, svt, svg, G, DK, DV)
    if ROW_SYNC:
        # the row's count of finished window + selection programs (``ROW_SYNC``), zeroed after the wait: the
        # previous step's merge, which polled it, has finished
        if c == 0:
            tl.store(DONE + bg, 0)
    # this program's tiles: [c·T, min(c·T + T, held)) of the tiles that hold tokens, none past them
    n_cmp, held, T, n_ch = _cmp_split(t, tl.num_programs(0), n_sm, CMP_LEN, CMP_STRIDE, BN, CMP_TILES, HALVINGS,
                                      C_CMP)
    if c >= n_ch:
        # a chunk past those in use (a cache with room to grow): no query loaded, no partial stored (the scorer and
        # the merge read only the chunks in use)
        return
    rows = tl.arange(0, BH)
    offs_n = tl.arange(0, BN)
    offs_dv = tl.arange(0, BDV)
    qa, qb, m_i, l_i, acc, cnt = _partial_start(Q, b, g, sqb, sqh, H_PER_G, DK, BH, BN, BDA, BDB, BDV)
    if WRITE_SCORES and not SUM_RESHAPE:
        # token i's span [i·d, i·d + l) overlaps block j iff i·d < (j+1)·l' and i·d + l > j·l'. Tiles
        # start on block boundaries, so the overlap of a tile's BN tokens with the NBT_P blocks from
        # its first is the same for every tile: built once (per tile it cost ~10% of the loop's instructions)
        jj = tl.arange(0, NBT_P)
        span = offs_n * CMP_STRIDE
        over = ((span[:, None] < (jj[None, :] + 1) * BLOCK) & (span[:, None] + CMP_LEN > jj[None, :] * BLOCK))
        over = over.to(tl.float32)
    if CMP_TILES == 1:      # T is 1 at every position: a loop of one, known to the compiler
        first, n_t = c, 1
    else:
        first, n_t = c * T, tl.minimum(c * T + T, held) - c * T
    # a tile is a run of BN compressed tokens: its row pointers are the run's first (a scalar a tile) plus offsets
    # computed once, its rows those below a scalar bound (as the window + selection programs')
    row_k = KC + b * skcb + g * skcg
    row_v = VC + b * svcb + g * svcg
    run_k = offs_n * skct
    run_v = offs_n * svct
    for i in tl.range(0, n_t, num_stages=STAGES):
        ti = first + i
        valid = offs_n < n_cmp - ti * BN
        kp = row_k + (ti * BN).to(tl.int64) * skct + run_k
        vp = row_v + (ti * BN).to(tl.int64) * svct + run_v
        m_i, l_i, acc, p, m_run = _tile(qa, qb, kp, vp, valid, m_i, l_i, acc, scale_log2, offs_dv,
                                        DK, DV, BDA, BDB, PREC, WANT_V)
        if WRITE_SCORES:
            # tile tau's tokens reach blocks tau·TB .. tau·TB + NBT − 1. The sums are of the
            # softmax's own p, relative to the running max m_run at this tile; rows of NBT floats back
            # to back: a tile's sums are one contiguous run of whole sectors
            at = (bg * NT + ti).to(tl.int64) * BH + rows
            if SUM_RESHAPE:
                bsum, bsum_next = _block_sums(p, BH, TB, BLOCK, CMP_LEN, CMP_STRIDE)
                jb = tl.arange(0, TB)
                tl.store(BSUM + at[:, None] * NBT + jb[None, :], bsum, eviction_policy="evict_last")
                tl.store(BSUM + at * NBT + TB, bsum_next, eviction_policy="evict_last")
            else:
                # other geometries: p by the 0/1 overlap matrix, fp32-accurate sums (the scores decide the
                # selection, which must be the oracle's) in two tf32 products: p's top 11 significant bits
                # (exact in tf32), then the rest. (tf32x3 makes a third, by over's low part: 0, over being
                # 0/1. Three bf16 products of p's exact bf16 split were no better: docs/decisions.md)
                p_hi = (p.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                bsum = tl.dot(p_hi, over, input_precision="tf32") + tl.dot(p - p_hi, over, input_precision="tf32")
                tl.store(BSUM + at[:, None] * NBT + jj[None, :], bsum, mask=jj[None, :] < NBT,
                         eviction_policy="evict_last")
            tl.store(BMAX + at, m_run, eviction_policy="evict_last")
        cnt += valid.to(tl.int32)
    _grid_release(GDC)
    _partial_store(PM, PL, PACC, PCNT, (bg * NC + c).to(tl.int64), m_i, l_i, acc, cnt, BH, BDV, WANT_V)


@triton.jit
def _winsel_partial_kernel(Q, K, V, KN, VN, IDX, POS, PM, PL, PACC, PCNT, DONE, CAND,
                           sqb, sqh, skb, skt, skg, svb, svt, svg, sib, sig, scale_log2, c_lo, C_CMP, C_WIN, NC,
                           G: tl.constexpr, H_PER_G: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
                           N_SEL: tl.constexpr, WIN_TILES: tl.constexpr, SEL_TILES: tl.constexpr,
                           DK: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                           BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr,
                           STAGES: tl.constexpr, GDC: tl.constexpr = 0, BPT: tl.constexpr = 1,
                           WIN_NOWAIT: tl.constexpr = False, ROW_SYNC: tl.constexpr = False,
                           TOPN: tl.constexpr = False, NSP: tl.constexpr = 0, BJ: tl.constexpr = 0,
                           KC: tl.constexpr = 0, NK: tl.constexpr = 0, CH: tl.constexpr = 0,
                           HALF: tl.constexpr = False):
    """Launch 4: program (bg, c − c_lo) over chunk c of the partials: the window's chunks C_CMP ..
    C_CMP + C_WIN − 1, then the selection's (c_lo = C_CMP + C_WIN when the window does not run).
    C_CMP, C_WIN and NC are plain arguments, as in ``_cmp_partial_kernel``. TOPN (``TOPN_IN_SELECTION_ROWS``):
    no top-n launch before this one; each selection program ranks its row's candidates CAND itself
    (``_topn_blocks``, with the top-n launch's NSP, BJ, KC, NK, CH, HALF) and the row's first one writes the
    blocks to IDX."""
    bg = tl.program_id(0)
    c = tl.program_id(1) + c_lo
    is_win = c < C_CMP + C_WIN
    if ROW_SYNC:
        # the merge may be launched now: its programs wait on their row's count, not on this launch (``ROW_SYNC``)
        tl.extra.cuda.gdc_launch_dependents()
    if WIN_NOWAIT:
        # a window program reads nothing an earlier launch of this step writes (the new token's k/v it
        # takes from KN/VN, not from the cache the compressed launch appends to): it starts without
        # waiting, beside the top-n. The selection programs wait, so the launch after still finds
        # every earlier one finished
        if is_win:
            if GDC == 2:
                tl.extra.cuda.gdc_launch_dependents()
        else:
            _grid_dependency(GDC)
    else:
        _grid_dependency(GDC)
    b = (bg // G).to(tl.int64)          # 64-bit row offsets (``_cmp_partial_kernel``)
    g = bg % G
    t = tl.load(POS + b)
    offs_n = tl.arange(0, BN)
    offs_dv = tl.arange(0, BDV)
    qa, qb, m_i, l_i, acc, cnt = _partial_start(Q, b, g, sqb, sqh, H_PER_G, DK, BH, BN, BDA, BDB, BDV)
    # One tile loop for both kinds of program, its keys chosen per tile: under Triton 3.6 two loops, each
    # software-pipelined, took a pipeline's shared memory each (170 KB a program: one program an SM; docs/decisions.md)
    lo = tl.maximum(t - WINDOW + 1, 0)
    w0 = lo + (c - C_CMP) * WIN_TILES * BN            # a window program's first token
    s0 = (c - C_CMP - C_WIN) * SEL_TILES              # a selection program's first slot
    # a window program reads no block number (under WIN_NOWAIT it does not wait for the top-n that writes them): it
    # reads its row's position in their place, the value unused (a pointer chosen, not a masked load: Triton 3.9's
    # interpreter rejects a scalar mask)
    sel_row = IDX + b * sib + g * sig
    # Under WIN_NOWAIT a window program takes token t's k/v from the new token's buffer, so that no read depends on
    # this step's append (by the chain in ``_grid_dependency`` the compressed launch has finished when this launch
    # starts, but a window program never waits to be shown its writes): its tile loop stops at t − 1, and token t is
    # one more key after it
    t_loop = t - 1 if WIN_NOWAIT else t
    # row b, KV head g of the caches. With one block a tile (BPT 1) a tile is a run of BN tokens from its first, so
    # its row pointers are the run's first (a scalar a tile) plus offsets computed once, and its rows are those up to
    # a scalar bound: a row pointer and mask computed per row cost about half the loop's instructions (docs/decisions.md)
    row_k = K + b * skb + g * skg
    row_v = V + b * svb + g * svg
    run_k = offs_n * skt
    run_v = offs_n * svt
    if TOPN:
        # the row's blocks ranked here (the window programs rank nothing: their block numbers stay unused), those of
        # this program's slots picked from them before the loop
        ar_s = tl.arange(0, SEL_TILES * BPT)
        j_all = tl.full([SEL_TILES * BPT], -1, tl.int32)
        if not is_win:
            blocks, n_take = _topn_blocks(CAND, bg, t, BLOCK, N_SEL, NSP, BJ, KC, NK, CH, HALF)
            r = tl.arange(0, blocks.shape[0])
            # slot s0·BPT + i holds blocks[s0·BPT + i] where taken, else −1 (a sum of one term, or of none: −1)
            j_all = tl.sum(tl.where((r[None, :] == s0 * BPT + ar_s[:, None]) & (r[None, :] < n_take),
                                    blocks[None, :] + 1, 0), 1) - 1
            if c == C_CMP + C_WIN:
                _topn_store(sel_row, blocks, n_take, N_SEL, NSP)
    elif BPT == 1:
        # the program's block numbers, loaded once before the loop: no tile's K/V addresses wait on a load inside it
        ar_s = tl.arange(0, SEL_TILES)
        win_s = c + 0 * ar_s < C_CMP + C_WIN
        j_all = tl.load(tl.where(win_s, POS + b, sel_row + tl.minimum(s0 + ar_s, N_SEL - 1)))
    for ti in tl.range(0, tl.where(is_win, WIN_TILES, SEL_TILES), num_stages=STAGES):
        if BPT == 1:
            # one block a tile: its block number a scalar, picked from those loaded before the loop
            slot = s0 + ti
            j = tl.sum(tl.where(ar_s == ti, j_all, 0), 0)
            first = tl.where(is_win, w0 + ti * BN, j * BLOCK)
            # rows 0 .. last are read: a window tile's up to t (t − 1 under WIN_NOWAIT), a selection tile's up to t and
            # within its block, none for an unused slot (j = −1) or past a ragged last chunk (slot >= n)
            last = tl.where(is_win, t_loop - first,
                            tl.where((j >= 0) & (slot < N_SEL), tl.minimum(t - first, BLOCK - 1), -1))
            valid = offs_n <= last
            kp = row_k + first.to(tl.int64) * skt + run_k
            vp = row_v + first.to(tl.int64) * svt + run_v
        else:
            # BPT blocks a tile (BN = BPT · l'): row r of the tile is token r mod l' of slot r // l'
            win_n = c + 0 * offs_n < C_CMP + C_WIN    # is_win as a vector (the interpreter: scalar masks)
            kw = w0 + ti * BN + offs_n
            slot = (s0 + ti) * BPT + offs_n // BLOCK
            if TOPN:
                j = tl.sum(tl.where(ar_s[None, :] == (slot - s0 * BPT)[:, None], j_all[None, :], 0), 1)
            else:
                j = tl.load(tl.where(is_win, POS + b, sel_row + tl.minimum(slot, N_SEL - 1)))
            ks = j * BLOCK + offs_n % BLOCK
            ok_s = (j >= 0) & (slot < N_SEL)
            kpos = tl.where(win_n, kw, ks)
            valid = (kpos <= tl.where(win_n, t_loop, t)) & (win_n | ok_s)
            kp = K + (b * skb + kpos.to(tl.int64) * skt + g * skg)
            vp = V + (b * svb + kpos.to(tl.int64) * svt + g * svg)
        m_i, l_i, acc, _, _ = _tile(qa, qb, kp, vp, valid, m_i, l_i, acc, scale_log2, offs_dv,
                                    DK, DV, BDA, BDB, PREC, True)
        cnt += valid.to(tl.int32)
    if WIN_NOWAIT:
        if is_win:
            # token t, in the window program whose run holds it: one more key, from KN/VN [B, G, d] (contiguous)
            m_i, l_i, acc, cnt = _one_key(qa, qb, KN + (b * G + g) * DK, VN + (b * G + g) * DV, t, w0,
                                          w0 + WIN_TILES * BN, m_i, l_i, acc, cnt, scale_log2, DK, DV, BH, BN, BDA,
                                          BDB, BDV)
    if not ROW_SYNC:
        _grid_release(GDC)
    _partial_store(PM, PL, PACC, PCNT, (bg * NC + c).to(tl.int64), m_i, l_i, acc, cnt, BH, BDV, True)
    if ROW_SYNC:
        # every thread's partial stored, then one more program of the row done (release: the merge that reads the
        # count with acquire sees the partials)
        tl.debug_barrier()
        tl.atomic_add(DONE + bg, 1, sem="release", scope="gpu")


@triton.jit
def _scores_kernel(PM, PL, BSUM, BMAX, CAND, POS, n_sm,
                   G: tl.constexpr, H_PER_G: tl.constexpr, BH: tl.constexpr, C_CMP: tl.constexpr,
                   CP: tl.constexpr, NC: tl.constexpr, NT: tl.constexpr, TB: tl.constexpr, NBT: tl.constexpr,
                   NBP: tl.constexpr, BJ: tl.constexpr, KC: tl.constexpr, OVT: tl.constexpr, BLOCK: tl.constexpr,
                   CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, BNC: tl.constexpr, CMP_TILES: tl.constexpr,
                   HALVINGS: tl.constexpr, GDC: tl.constexpr = 0, IDLE_EXIT: tl.constexpr = False):
    """Selection-block scores of blocks [grp·BJ, (grp+1)·BJ) of one (row · KV head), for the blocks up to
    the new token's, and the KC best of them as top-n keys (``_candidates``) -> CAND [BG, NBP / BJ · KC]
    (slots grp·KC ..): the top-n ranks those. A program past the new token's block does nothing. grp is
    pid1, or with IDLE_EXIT the groups from the last: the GPU dispatches the programs pid1 by pid1 (all rows'
    first, then their second, ...), so that the idle groups of a cache with room to grow, dispatched first,
    have come and gone while the compressed launch ends, and the live ones are not followed by the idle ones'
    dispatch (2,048 programs at B=16 128k on a 2x cache), which the top-n would wait for (docs/decisions.md)."""
    bg = tl.program_id(0)
    if IDLE_EXIT:
        grp = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        grp = tl.program_id(1)
    # the position is written by work that ended two launches back or more (``_grid_dependency``): read
    # while the compressed launch finishes
    t = tl.load(POS + bg // G)
    if IDLE_EXIT:
        # past the new token's block (a cache with room to grow): done before waiting, so that such programs
        # free their slots while the compressed launch still runs (they let the top-n go as they end). Only above
        # EARLY_TRIGGER_ROWS: at few rows this branch made the step slower even where no program takes it
        # (docs/decisions.md)
        if grp * BJ > t // BLOCK:
            return
    _grid_dependency(GDC)
    j = grp * BJ + tl.arange(0, BJ)
    # a program past the new token's block loads nothing and stores nothing (masks, not a branch: a
    # branch around the body made the step slower at B=1: docs/decisions.md)
    live = grp * BJ <= t // BLOCK
    # the same as masks of the loads and stores, written on vectors: the interpreter (Triton 3.9) mistypes masks
    # built from loaded scalars
    live_j = j - tl.arange(0, BJ) <= t // BLOCK
    live_k = grp * BJ + 0 * tl.arange(0, KC) <= t // BLOCK
    # the chunks and tiles the compressed launch wrote at this position (``_cmp_split``)
    _, held, _, n_ch = _cmp_split(t, tl.num_programs(0), n_sm, CMP_LEN, CMP_STRIDE, BNC, CMP_TILES, HALVINGS, C_CMP)
    rows = tl.arange(0, BH)
    # each head's softmax max M and normaliser L over all compressed tokens, from the chunk partials
    ch = tl.arange(0, CP)
    part = (bg * NC + ch)[:, None] * BH + rows[None, :]
    n_ch = tl.where(live, n_ch, 0)
    pm = tl.load(PM + part, mask=ch[:, None] < n_ch, other=float("-inf"))
    pl = tl.load(PL + part, mask=ch[:, None] < n_ch, other=0.0)
    M = tl.max(pm, 0)
    M = tl.where(M == float("-inf"), 0.0, M)
    L = tl.sum(tl.exp2(pm - M[None, :]) * pl, 0)
    inv_L = tl.where(L > 0, 1.0 / tl.where(L > 0, L, 1.0), 0.0)        # no compressed token: 0
    # block j: p_cmp of the tokens overlapping it = the block sums of the (at most OVT) tiles that
    # reach it, each rescaled from the max it was taken against to the head's M and divided by L
    score = tl.zeros([BJ], tl.float32)
    for hh in tl.static_range(H_PER_G):
        m_h = tl.sum(tl.where(rows == hh, M, 0.0), 0)
        inv_h = tl.sum(tl.where(rows == hh, inv_L, 0.0), 0)
        for o in tl.static_range(OVT):
            tau = j // TB - o
            local = j - tau * TB
            ok = (tau >= 0) & (tau < held) & (local < NBT) & live_j
            at = (bg * NT + tau).to(tl.int64) * BH + hh
            mt = tl.load(BMAX + at, mask=ok, other=float("-inf"))
            bs = tl.load(BSUM + at * NBT + local, mask=ok, other=0.0)
            score += bs * tl.exp2(mt - m_h) * inv_h
    cand = _candidates(score, j, t // BLOCK, BJ, KC)
    tl.store(CAND + (bg * tl.num_programs(1) + grp) * KC + tl.arange(0, KC), cand, mask=live_k)
    _grid_release(GDC)


@triton.jit
def _candidates(score, j, cur, BJ: tl.constexpr, KC: tl.constexpr):
    """The best KC top-n keys, best first, among blocks j [BJ] with scores ``score`` [BJ] (cur: the new
    token's block); all BJ keys where KC = BJ. A key: high word the score's bits mapped so that integers
    order as the floats do (negatives' magnitude bits flipped, −0 taken as +0, NaN as −inf), low word
    2^31 − 1 − j, so that equal scores go to the lower block (``ranks_before``'s order); a block that is
    not causal, or forced (0 and the two local ones), is the least int64. Keys are distinct, so the best
    n of every group's best n are the best n of all (``_topn_kernel``)."""
    BIG: tl.constexpr = 2147483647
    NONE: tl.constexpr = -9223372036854775807 - 1
    # a NaN score (from inputs that overflow) ranks lowest: every free block's key stays above NONE, so
    # the picks are always real blocks, never an empty key's (block 2^31 − 1)
    score = tl.where(score == score, score, float("-inf"))
    free = (j <= cur) & (j != 0) & (j != cur) & (j != cur - 1)          # causal and not forced
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    bits = bits ^ ((bits >> 31) & BIG)
    key = tl.where(free, block_key(bits, j), NONE)
    if KC < BJ:
        key = tl.topk(key, KC)
    return key


@triton.jit
def _topn_load(CAND, bg, j0, n_keys, NK: tl.constexpr, CH: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
               BJ: tl.constexpr):
    """The best KP, best first, of keys j0..j0+CH−1 of CAND's row bg (those from n_keys on: none). A group's KC
    keys are its best, stored best first, where it kept fewer than its BJ (``_candidates``): where KC is KP they
    are the runs a top-KP sorts first, so the even ones are loaded reversed (ascending) and the ranking starts
    from the runs (``topk_of_runs``; docs/decisions.md, session 83)."""
    RUNS: tl.constexpr = KC < BJ and KC == KP and KP < CH
    r = j0 + tl.arange(0, CH)
    if RUNS:
        r = tl.where((r // KC) % 2 == 0, r + (KC - 1) - 2 * (r % KC), r)      # a run reversed stays in its group
    key = tl.load(CAND + bg * NK + r, mask=r < n_keys, other=-9223372036854775807 - 1)
    if RUNS:
        return topk_of_runs(key, ilog2(CH), ilog2(KP), ilog2(KC))
    return tl.topk(key, KP)


@triton.jit
def _topn_chunks(CAND, bg, n_keys, NK: tl.constexpr, CH: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
                 BJ: tl.constexpr):
    """The best KP of keys 0..n_keys−1 of CAND's row bg, CH at a time."""
    top = tl.full([KP], -9223372036854775807 - 1, tl.int64)
    for j0 in tl.range(0, n_keys, CH):
        key = _topn_load(CAND, bg, j0, n_keys, NK, CH, KP, KC, BJ)
        if j0 == 0:
            top = key
        else:
            top = tl.topk(tl.reshape(tl.join(top, key), [2 * KP]), KP)
    return top


@triton.jit
def _topn_blocks(CAND, bg, t, BLOCK: tl.constexpr, N_SEL: tl.constexpr, NSP: tl.constexpr, BJ: tl.constexpr,
                 KC: tl.constexpr, NK: tl.constexpr, CH: tl.constexpr, HALF: tl.constexpr):
    """Top-n blocks of (row · KV head) bg for the token at t: forced block 0 and the two local blocks, then the
    highest scores among the other causal blocks, ties to the lower index. It ranks the keys the scorer kept
    (``_candidates``: KC of each group of BJ blocks, CAND [B·G, NK]) of the groups up to the new token's block, CH
    keys at a time, a bitonic top-KP of each chunk (from the groups' sorted runs: ``_topn_load``) kept with the
    best so far by a top-KP of the 2·KP: a cache with room to grow ranks only the groups its tokens reach. The
    picks and the forced blocks (the distinct ones) are then sorted ascending, a sort of 2·KP -> (blocks [2·KP]
    int32, ascending, 2^31 − 1 past the n_take taken; n_take)."""
    cur = t // BLOCK
    KP: tl.constexpr = NSP if NSP < CH else CH          # CH < NSP only where it is all the keys
    n_keys = (cur // BJ + 1) * KC
    if HALF:
        # a cache with room to grow: while the keys fit in half a chunk, a top-k of half the size (the chunk is
        # the capacity's where it holds fewer than TOPN_CHUNK keys)
        if n_keys <= CH // 2:
            top = _topn_load(CAND, bg, 0, n_keys, NK, CH // 2, KP, KC, BJ)
        else:
            top = _topn_chunks(CAND, bg, n_keys, NK, CH, KP, KC, BJ)
    else:
        top = _topn_chunks(CAND, bg, n_keys, NK, CH, KP, KC, BJ)
    n_take = tl.minimum(cur + 1, N_SEL)
    BIG: tl.constexpr = 2147483647
    n_forced = 1 + (cur >= 1).to(tl.int32) + (cur >= 2).to(tl.int32)
    s = tl.arange(0, KP)
    # there are at least n_take − n_forced free causal blocks: every pick below is a real block
    pick = tl.where(s < n_take - n_forced, BIG - (top & BIG).to(tl.int32), BIG)
    forced = tl.where(s == 0, 0, tl.where(((s == 1) & (cur >= 2)) | ((s == 2) & (cur >= 1)), cur - 2 + s, BIG))
    return tl.sort(tl.reshape(tl.join(pick, forced), [2 * KP]), 0), n_take


@triton.jit
def _topn_store(IDX, blocks, n_take, N_SEL: tl.constexpr, NSP: tl.constexpr):
    """``_topn_blocks``' blocks into one row of the index buffer (IDX: its first slot): ascending, −1 padded."""
    r = tl.arange(0, blocks.shape[0])
    tl.store(IDX + r, tl.where(r < n_take, blocks, -1), mask=r < N_SEL)
    if blocks.shape[0] < N_SEL:          # fewer than n/2 keys a chunk: the slots past the sort's are unused
        r2 = tl.arange(0, NSP)
        tl.store(IDX + r2, tl.full([NSP], -1, tl.int32), mask=(r2 >= blocks.shape[0]) & (r2 < N_SEL))


@triton.jit
def _topn_kernel(CAND, POS, IDX, sib, sig, G: tl.constexpr, BLOCK: tl.constexpr, N_SEL: tl.constexpr,
                 NSP: tl.constexpr, BJ: tl.constexpr, KC: tl.constexpr, NK: tl.constexpr, CH: tl.constexpr,
                 GDC: tl.constexpr = 0, HALF: tl.constexpr = False):
    """Top-n blocks of one (row · KV head) (``_topn_blocks``), written ascending, −1 padded: exactly docs/nsa.md."""
    # the position is written by work that ended two launches back or more (``_grid_dependency``)
    b = tl.program_id(0) // G
    t = tl.load(POS + b)
    _grid_dependency(GDC)
    bg = tl.program_id(0)
    blocks, n_take = _topn_blocks(CAND, bg, t, BLOCK, N_SEL, NSP, BJ, KC, NK, CH, HALF)
    _grid_release(GDC)
    _topn_store(IDX + b * sib + (bg % G) * sig, blocks, n_take, N_SEL, NSP)


@triton.jit
def _merge_load(PM, PL, PACC, PCNT, bg, rows, offs_dv, lo, hi, CP: tl.constexpr,
                NC: tl.constexpr, BH: tl.constexpr, BDV: tl.constexpr, L2_ONLY: tl.constexpr = False):
    """Chunks [lo, hi) of one (row · KV head), d_v columns offs_dv [BDV_S]: (m [CP, BH], l [CP, BH],
    acc [CP, BH, BDV_S], tokens read), all loaded at once. CP: at least hi − lo, a power of two."""
    ch = lo + tl.arange(0, CP)
    ok = ch < hi
    out = (bg * NC + ch).to(tl.int64)
    part = out[:, None] * BH + rows[None, :]                           # [CP, BH]
    # L2_ONLY: from L2, past this SM's L1 (partials a program of this launch saw stored only through a count it polled;
    # a row's compressed and window counts share sectors, so an earlier load may have brought stale lines into L1)
    mod: tl.constexpr = ".cg" if L2_ONLY else ""
    pm = tl.load(PM + part, mask=ok[:, None], other=float("-inf"), cache_modifier=mod)
    pl = tl.load(PL + part, mask=ok[:, None], other=0.0, cache_modifier=mod)
    acc = tl.load(PACC + part[:, :, None] * BDV + offs_dv[None, None, :], mask=ok[:, None, None], other=0.0,
                  cache_modifier=mod)
    return pm, pl, acc, tl.sum(tl.load(PCNT + out, mask=ok, other=0, cache_modifier=mod), 0)


@triton.jit
def _merge_groups(PM, PL, PACC, PCNT, bg, rows, offs_dv, hi, CG: tl.constexpr, NC: tl.constexpr, BH: tl.constexpr,
                  BDV: tl.constexpr, BDV_S: tl.constexpr):
    """Chunks [0, hi) as ``_merge_load``, CG at a time, each group merged into a running (max, normaliser, acc):
    the form of ``_merge_load``'s output for one chunk (m [1, BH], l [1, BH], acc [1, BH, BDV_S], tokens read).
    A program loads only the groups that hold chunks in use: in a cache with room to grow, not the capacity's."""
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BDV_S], tl.float32)
    cnt = tl.full([], 0, tl.int32)
    for lo in range(0, hi, CG):
        pm, pl, pa, pc = _merge_load(PM, PL, PACC, PCNT, bg, rows, offs_dv, lo, hi, CG, NC, BH, BDV)
        M = tl.maximum(m, tl.max(pm, 0))
        M0 = tl.where(M == float("-inf"), 0.0, M)
        a = tl.exp2(m - M0)                                               # no key yet: 0
        w = tl.exp2(pm - M0[None, :])
        l = l * a + tl.sum(w * pl, 0)
        acc = acc * a[:, None] + tl.sum(pa * w[:, :, None], 0)
        m = M
        cnt += pc
    return m[None, :], l[None, :], acc[None, :, :], cnt


@triton.jit
def _merge_finish(pm, pl, acc):
    """Log-sum-exp merge of ``_merge_load``'s chunks -> o [BH, BDV_S] (no key at all: exactly 0)."""
    M = tl.max(pm, 0)
    w = tl.exp2(pm - tl.where(M == float("-inf"), 0.0, M)[None, :])   # a chunk with no key: 0
    L = tl.sum(w * pl, 0)
    return tl.sum(acc * w[:, :, None], 0) / tl.where(L == 0, 1.0, L)[:, None]


@triton.jit
def _merge_store(pm, pl, acc, cnt, br: tl.constexpr, OUT, READS, plane, BG, ok, first, gate, mix,
                 HAS_GATE: tl.constexpr):
    """Branch ``br``'s merged o into OUT[br] and its tokens read into READS[br]; returns
    mix + gate·o (gate [BH]: the heads' gate of this branch)."""
    o = _merge_finish(pm, pl, acc)
    tl.store(OUT + br * plane, o.to(OUT.dtype.element_ty), mask=ok)
    tl.store(READS + br * BG, cnt, mask=first)
    if HAS_GATE:
        mix += gate[:, None] * o
    return mix


@triton.jit
def _gate_col(GATE, row, br: tl.constexpr, ok, HAS_GATE: tl.constexpr):
    """The heads' gate of branch ``br`` (GATE [B·H, 3], rows ``row`` [BH]) in fp32; 0 without a gate."""
    gate = tl.zeros(row.shape, tl.float32)
    if HAS_GATE:
        gate = tl.load(GATE + row * 3 + br, mask=ok, other=0.0).to(tl.float32)
    return gate


@triton.jit
def _merge_kernel(PM, PL, PACC, PCNT, GATE, OUT, MIX, READS, DONE, B, POS, n_sm, N_ROW,
                  G: tl.constexpr, H_PER_G: tl.constexpr, DV: tl.constexpr, C_CMP: tl.constexpr,
                  C_WIN: tl.constexpr, NC: tl.constexpr, CP_CMP: tl.constexpr, CP_WIN: tl.constexpr,
                  CP_SEL: tl.constexpr, BH: tl.constexpr, BDV: tl.constexpr, BDV_S: tl.constexpr,
                  DO_CMP: tl.constexpr, DO_SEL: tl.constexpr, DO_WIN: tl.constexpr, HAS_GATE: tl.constexpr,
                  CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, BNC: tl.constexpr, CMP_TILES: tl.constexpr,
                  HALVINGS: tl.constexpr, GDC: tl.constexpr = 0, CMP_EARLY: tl.constexpr = False,
                  CMP_MERGE_EARLY: tl.constexpr = False, CMP_GROUP: tl.constexpr = 0,
                  ROW_SYNC: tl.constexpr = False):
    bg = tl.program_id(0)
    part = tl.program_id(1)                                          # which BDV_S columns of d_v
    b = bg // G
    g = bg % G
    rows = tl.arange(0, BH)
    offs_dv = part * BDV_S + tl.arange(0, BDV_S)
    H: tl.constexpr = G * H_PER_G
    head = g * H_PER_G + rows
    ok = (rows[:, None] < H_PER_G) & (offs_dv[None, :] < DV)
    dst = (b * H + head)[:, None] * DV + offs_dv[None, :]
    plane = B * H * DV                                               # OUT is [3, B, H, d_v]
    first = part == 0                                                # one program writes the reads
    # every load first: each branch's merge would otherwise wait for its loads after the stores of
    # the one before (the compiler cannot move a load above a store; docs/decisions.md)
    row, head_ok = b * H + head, rows < H_PER_G
    # CMP_EARLY (only where the compressed launch is at least two back, the gate from before the step):
    # the compressed partials are read before the wait (``_grid_dependency``), so that under the early
    # trigger (small B) these, the most of the merge's loads, overlap the window + selection launch
    mix = tl.zeros([BH, BDV_S], tl.float32)
    out, reads = OUT + dst, READS + bg
    if not CMP_EARLY:
        _grid_dependency(GDC)
    if DO_CMP:
        # the compressed chunks in use at this position (``_cmp_split``); the rest were not written
        _, _, _, n_ch = _cmp_split(tl.load(POS + b), tl.num_programs(0), n_sm, CMP_LEN, CMP_STRIDE, BNC, CMP_TILES,
                                   HALVINGS, C_CMP)
        if CMP_GROUP == 0:
            m_c, l_c, a_c, n_c = _merge_load(PM, PL, PACC, PCNT, bg, rows, offs_dv, 0, n_ch, CP_CMP, NC, BH, BDV)
        else:
            m_c, l_c, a_c, n_c = _merge_groups(PM, PL, PACC, PCNT, bg, rows, offs_dv, n_ch, CMP_GROUP, NC, BH, BDV,
                                               BDV_S)
        g_c = _gate_col(GATE, row, 0, head_ok, HAS_GATE)
        if CMP_MERGE_EARLY:
            # merged and stored before the wait as well: no launch of the step before this one reads what it writes
            mix = _merge_store(m_c, l_c, a_c, n_c, 0, out, reads, plane, B * G, ok, first, g_c, mix, HAS_GATE)
    if ROW_SYNC:
        # this row's N_ROW window + selection programs have stored their partials (``ROW_SYNC``)
        done = tl.atomic_add(DONE + bg, 0, sem="acquire", scope="gpu")
        while done < N_ROW:
            done = tl.atomic_add(DONE + bg, 0, sem="acquire", scope="gpu")
    elif CMP_EARLY:
        _grid_dependency(GDC)
    if DO_SEL:
        m_s, l_s, a_s, n_s = _merge_load(PM, PL, PACC, PCNT, bg, rows, offs_dv, C_CMP + C_WIN, NC, CP_SEL, NC, BH,
                                         BDV, ROW_SYNC)
        g_s = _gate_col(GATE, row, 1, head_ok, HAS_GATE)
    if DO_WIN:
        m_w, l_w, a_w, n_w = _merge_load(PM, PL, PACC, PCNT, bg, rows, offs_dv, C_CMP, C_CMP + C_WIN, CP_WIN, NC,
                                         BH, BDV, ROW_SYNC)
        g_w = _gate_col(GATE, row, 2, head_ok, HAS_GATE)
    if DO_CMP and not CMP_MERGE_EARLY:
        mix = _merge_store(m_c, l_c, a_c, n_c, 0, out, reads, plane, B * G, ok, first, g_c, mix, HAS_GATE)
    if DO_SEL:
        mix = _merge_store(m_s, l_s, a_s, n_s, 1, out, reads, plane, B * G, ok, first, g_s, mix, HAS_GATE)
    if DO_WIN:
        mix = _merge_store(m_w, l_w, a_w, n_w, 2, out, reads, plane, B * G, ok, first, g_w, mix, HAS_GATE)
    if HAS_GATE:
        tl.store(MIX + dst, mix.to(MIX.dtype.element_ty), mask=ok)


@triton.jit
def _copy(DST, SRC, N: tl.constexpr):
    """DST[:N] = SRC[:N], in COPY_CHUNK-element pieces (no power-of-two padding of N needed)."""
    for o in tl.static_range(0, N, COPY_CHUNK):
        i = o + tl.arange(0, COPY_CHUNK)
        tl.store(DST + i, tl.load(SRC + i, mask=i < N), mask=i < N)


@triton.jit
def _append_row(K, V, KN, VN, b, g, t, skb, skt, skg, svb, svt, svg, G: tl.constexpr, DK: tl.constexpr,
                DV: tl.constexpr):
    """Copy row b, KV head g of the new token's k [B, G, d_k] / v [B, G, d_v] (contiguous) to position t."""
    b = b.to(tl.int64)
    _copy(K + b * skb + t * skt + g * skg, KN + (b * G + g) * DK, DK)
    _copy(V + b * svb + t * svt + g * svg, VN + (b * G + g) * DV, DV)


@triton.jit
def _append_kernel(K, V, KN, VN, POS, skb, skt, skg, svb, svt, svg, G: tl.constexpr, DK: tl.constexpr,
                   DV: tl.constexpr, GDC: tl.constexpr = 0):
    """The append as a launch of its own (``append_token``): program (b, g) writes row b, KV head g."""
    _grid_dependency(GDC)
    b = tl.program_id(0)
    _append_row(K, V, KN, VN, b, tl.program_id(1), tl.load(POS + b).to(tl.int64), skb, skt, skg, svb, svt, svg,
                G, DK, DV)


# -- launcher -----------------------------------------------------------------------------------
def _capability(device) -> tuple[int, int] | None:
    """The GPU's compute capability; None off a GPU."""
    dev = torch.device(device)
    return torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None


def _stages(device, dtype: torch.dtype, cmp_tiles: int) -> int:
    """A partial launch's pipeline stages (``PARTIAL_STAGES``) for a cache of ``dtype`` whose plan
    gives a compressed program ``cmp_tiles`` tiles (the window + selection launch: DEEP_TILES)."""
    cap = _capability(device)
    deep = cap is not None and cap[0] == 9 and dtype.itemsize == 2 and cmp_tiles >= DEEP_TILES
    return PARTIAL_STAGES_SM90 if deep else PARTIAL_STAGES


def _gdc(device, rows: int) -> int:
    """The kernels' GDC mode (``_grid_dependency``) for a step over ``rows`` = B·G: 0 where
    programmatic dependent launch does not exist (before sm90, the CPU) or ``PDL`` is off; the
    early trigger (2) up to ``EARLY_TRIGGER_ROWS``, the late one (3) above."""
    cap = _capability(device)
    if not PDL or cap is None or cap < (9, 0):
        return 0
    return 2 if rows <= EARLY_TRIGGER_ROWS else 3


def _topn_in_selection(gdc: int, rows: int) -> bool:
    """Whether a step over ``rows`` = B·G in GDC mode ``gdc`` (``_gdc``) makes no top-n launch, its selection
    programs ranking instead: under the early trigger, up to TOPN_IN_SELECTION_ROWS."""
    return gdc == 2 and rows <= TOPN_IN_SELECTION_ROWS


def _launch_shape(rows: int) -> tuple[int, int]:
    """(warps of a scoring program, d_v columns of a merge program) for a step over ``rows`` = B·G:
    fewer, wider programs for few rows (docs/decisions.md)."""
    return (4 if rows <= 4 else 2 if rows <= 16 else 1), (8 if rows < 16 else 16)


def _tiles_per_chunk(tile_counts: tuple[int, ...], programs_per_chunk: int, n_sm: int, most: int = MAX_TILES) -> int:
    """Tiles one program walks (a power of two, at most ``most``): as many as keep at least one
    program per SM in the launch (fewer chunks: fewer partials written and merged). Fewer programs than
    SMs, for fewer partials to score and merge at small B, was slower; so were more programs per SM
    (docs/decisions.md)."""
    t = min(most, triton.next_power_of_2(max(tile_counts)))
    while t > 1 and sum(triton.cdiv(n, t) for n in tile_counts) * programs_per_chunk < n_sm:
        t //= 2
    return t


@dataclass(frozen=True)
class Plan:
    """The static layout of a step: tile size, chunks per branch, padded sizes."""
    B: int
    G: int
    h: int
    d_k: int
    d_v: int
    n_max: int                 # compressed cache entries
    n_sel: int                 # selection slots n
    nbp: int                   # selection blocks of the cache, padded to a power of two
    BN: int                    # tokens per tile of the window / selection partials (>= bpt · l': bpt blocks a tile)
    BNC: int                   # compressed tokens per tile of the compressed partials
    BH: int
    BDA: int                   # d_k as two power-of-two parts: BDA + BDB >= d_k (BDB = 0: one part)
    BDB: int
    BDV: int
    cmp_tiles: int
    win_tiles: int
    sel_tiles: int
    C_CMP: int
    C_WIN: int
    C_SEL: int
    tb: int                    # selection blocks per tile of BNC compressed tokens (BNC·d / l')
    nbt: int                   # blocks a tile's tokens reach: tb plus the spans' overhang
    nbt_p: int                 # nbt padded to a power of two >= 16
    bpt: int                   # selection blocks per window/selection tile (BN = bpt · l'; ``TWO_BLOCK_TILES``)
    sums_by_reshape: bool      # the compressed programs' block sums by reshaping p (``SUMS_BY_RESHAPE``)
    gdc: int                   # the kernels' programmatic-dependent-launch mode (``_gdc``)
    score_warps: int           # warps of a scoring program (``_launch_shape``)
    merge_cols: int            # d_v columns of a merge program
    n_sm: int                  # the device's SMs (``_cmp_split`` splits for them at every position)
    stages: int                # software-pipelining stages of the compressed programs' tile loop (``PARTIAL_STAGES``)
    win_stages: int            # and of the window + selection programs' (3 on sm90 for 16-bit caches at any tiles)
    score_blocks: int          # selection blocks one scoring program scores (``SCORE_BLOCKS``)
    # top-n keys a scoring program keeps of its blocks' (``_candidates``): its best n, so the top-n ranks n a group
    # of blocks up to the new token's, not every block (at B=16 128k on a 2x cache 128.3 us against 132.0 keeping
    # all; docs/decisions.md)
    cands: int
    # compressed chunks the merge loads at a time (``_merge_groups``; 0: all C_CMP at once, ``MERGE_GROUP``)
    merge_group: int

    @property
    def topn_in_selection(self) -> bool:
        """No top-n launch: the selection programs rank (``TOPN_IN_SELECTION_ROWS``; a step running the selection)."""
        return _topn_in_selection(self.gdc, self.B * self.G)

    @property
    def n_cands(self) -> int:
        """Top-n keys the scorer keeps a row (· KV head): ``cands`` of each group of ``score_blocks`` blocks."""
        return self.nbp // self.score_blocks * self.cands

    @property
    def NC(self) -> int:
        return self.C_CMP + self.C_WIN + self.C_SEL

    @property
    def n_tiles(self) -> int:
        """Tiles of BNC compressed tokens the compressed partials cover."""
        return self.C_CMP * self.cmp_tiles


def plan(cfg: NSAConfig, B: int, t_max: int, n_max: int, device, dtype: torch.dtype) -> Plan:
    G, h = cfg.n_kv_heads, cfg.heads_per_group
    BN1 = max(16, triton.next_power_of_2(cfg.block_size))
    lo, hi = TWO_BLOCK_TILES
    bpt = 2 if BN1 == cfg.block_size and lo <= B * G <= hi else 1    # selection blocks per window/selection tile
    BN = BN1 * bpt
    # a compressed tile must start on a selection-block boundary (its block sums cover whole blocks)
    BNC = CMP_TILE if CMP_TILE * cfg.cmp_stride % cfg.block_size == 0 else BN1
    n_sm = sm_count(device)
    cmp_t, win_t, sel_t = triton.cdiv(max(n_max, 1), BNC), triton.cdiv(cfg.window, BN), triton.cdiv(cfg.n_selected, bpt)
    ct = _tiles_per_chunk((cmp_t,), B * G, n_sm, CMP_MAX_TILES)
    c_cmp = triton.cdiv(cmp_t, ct)
    wt = st = _tiles_per_chunk((win_t, sel_t), B * G, n_sm)             # one launch runs both
    tb = BNC * cfg.cmp_stride // cfg.block_size
    nbt = ((BNC - 1) * cfg.cmp_stride + cfg.cmp_len - 1) // cfg.block_size + 1
    BDA, BDB = head_dim_parts(cfg.d_k)
    r = cfg.block_size // cfg.cmp_stride            # compressed tokens starting in one block
    by_reshape = (SUMS_BY_RESHAPE and cfg.block_size % cfg.cmp_stride == 0 and r & (r - 1) == 0 and BNC == tb * r
                  and nbt == tb + 1)
    nbp = triton.next_power_of_2(triton.cdiv(t_max, cfg.block_size))
    bj = min(nbp, SCORE_BLOCKS)
    p = Plan(B, G, h, cfg.d_k, cfg.d_v, n_max, cfg.n_selected, nbp, BN, BNC,
             max(16, triton.next_power_of_2(h)), BDA, BDB, max(16, triton.next_power_of_2(cfg.d_v)),
             ct, wt, st, c_cmp, triton.cdiv(win_t, wt), triton.cdiv(sel_t, st),
             tb, nbt, max(16, triton.next_power_of_2(nbt)), bpt, by_reshape, _gdc(device, B * G),
             *_launch_shape(B * G), n_sm, _stages(device, dtype, ct), _stages(device, dtype, DEEP_TILES), bj,
             kept_keys(cfg, bj), merge_group(c_cmp, B * G))
    if p.win_stages == PARTIAL_STAGES_SM90 and B * G > EARLY_TRIGGER_ROWS:
        t = _tiles_per_chunk((win_t, sel_t), B * G, 2 * n_sm)
        c_win, c_sel = triton.cdiv(win_t, t), triton.cdiv(sel_t, t)
        if t >= SHALLOW_MIN_TILES and B * G * (c_win + c_sel) <= SHALLOW_PER_SM * n_sm:
            shallow = replace(p, win_tiles=t, sel_tiles=t, C_WIN=c_win, C_SEL=c_sel, win_stages=PARTIAL_STAGES)
            if _fits_per_sm(shallow, cfg, t_max, dtype, device, SHALLOW_PER_SM):
                p = shallow
    return p


_FITS: dict[tuple, bool] = {}


def fits(n_regs: int, n_spills: int, shared: int, warps: int, programs: int, regs_per_sm: int,
         shared_per_sm: int) -> bool:
    """Whether ``programs`` programs of ``warps`` warps, each thread with ``n_regs`` registers (allocated in eights)
    and the program ``shared`` bytes of shared memory (the driver reserves 1 KB more a program), share one SM of
    ``regs_per_sm`` registers and ``shared_per_sm`` bytes, with nothing spilled."""
    return (n_spills == 0 and programs * warps * 32 * (-(-n_regs // 8) * 8) <= regs_per_sm
            and programs * (shared + 1024) <= shared_per_sm)


def _probe_args(p: Plan, cfg: NSAConfig, t_max: int, dtype: torch.dtype) -> tuple[list, dict]:
    """The window + selection launch of a ``DecodeStep`` on ``p`` (it appends the token and runs every branch; q
    [B, H, d_k] and caches [B, t_max, G, d] contiguous, of ``dtype``) with dtypes for its tensors."""
    f32, i32 = torch.float32, torch.int32
    nowait = WIN_NOWAIT and p.gdc > 0
    return _winsel_args(p, cfg, (dtype,) * 5 + (i32, i32, f32, f32, f32, i32, i32, torch.int64),
                        (p.G * p.h * p.d_k, p.d_k, t_max * p.G * p.d_k, p.G * p.d_k, p.d_k,
                         t_max * p.G * p.d_v, p.G * p.d_v, p.d_v, p.G * p.n_sel, p.n_sel),
                        p.C_CMP, nowait, precision(dtype), _row_sync(p, nowait), p.topn_in_selection)


def _fits_per_sm(p: Plan, cfg: NSAConfig, t_max: int, dtype: torch.dtype, device, programs: int) -> bool:
    """Whether the window + selection kernel at ``p``'s settings, compiled by the Triton installed here, runs
    ``programs`` programs an SM (``fits``): the shallow launch's premise, which the register count decides and
    which changes with Triton's version. Compiled with the arguments a ``DecodeStep``'s launch takes (so that its
    first launch finds it compiled; ``_probe_args``) and loaded once a process, not run. A kernel that does not
    compile, load or report its registers here does not fit: the plan keeps the deep launch."""
    args, kw = _probe_args(p, cfg, t_max, dtype)
    dev = torch.device(device)
    key = (dev.type, dev.index if dev.index is not None else torch.cuda.current_device(), programs, *args,
           *sorted(kw.items()))
    if key not in _FITS:
        try:
            with torch.cuda.device(dev):
                kernel = _winsel_partial_kernel.warmup(*args, grid=(1,), **kw)
                kernel._init_handles()
                props = torch.cuda.get_device_properties(dev)
            _FITS[key] = fits(kernel.n_regs, kernel.n_spills, kernel.metadata.shared, PARTIAL_WARPS, programs,
                              getattr(props, "regs_per_multiprocessor", 65536),
                              getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))
        except Exception:                  # noqa: BLE001  (OutOfResources, an interpreter's warmup, an older Triton)
            _FITS[key] = False
    return _FITS[key]


def _partial_constexprs(p: Plan, cfg: NSAConfig, prec: str) -> dict:
    """What both partial launches take as constexprs (the chunk counts they take as plain arguments; the window +
    selection launch its own STAGES)."""
    return dict(G=p.G, H_PER_G=p.h, BLOCK=cfg.block_size, DK=p.d_k, DV=p.d_v, BH=p.BH, BDA=p.BDA, BDB=p.BDB,
                BDV=p.BDV, PREC=prec, STAGES=p.stages, num_warps=PARTIAL_WARPS, GDC=p.gdc, launch_pdl=p.gdc > 0)


def _row_sync(p: Plan, nowait: bool, cmp: bool = True) -> bool:
    """Whether a step on ``p`` merges each row as its window + selection programs end (``ROW_SYNC``): where the
    window does not wait, above EARLY_TRIGGER_ROWS (the late trigger) and with the compressed branch (``cmp``: else
    the merge has nothing to do before it polls). The counts' reset rests on the scores launch triggering after its
    wait there (``decode_attention``'s scores_pdl) and on its first program of a row never returning idle: then the
    compressed launch, which zeroes them, has finished before any window program starts."""
    return ROW_SYNC and nowait and p.gdc == 3 and cmp


def _winsel_args(p: Plan, cfg: NSAConfig, ptrs: tuple, strides: tuple, lo: int, nowait: bool,
                 prec: str, row_sync: bool, topn: bool) -> tuple[list, dict]:
    """The window + selection launch's arguments and settings: ``ptrs`` (q, k, v, k_new, v_new, idx, pos, pm, pl,
    pacc, pcnt, done, cand) as tensors, or as dtypes for a compile alone (``_fits_per_sm``); ``strides`` (q's two,
    k's three, v's three, idx's two); ``lo`` the first chunk (``_winsel_partial_kernel``'s c_lo); ``row_sync`` the
    step's ``_row_sync``; ``topn``: the selection programs rank, there being no top-n launch
    (``Plan.topn_in_selection``, where the step runs the selection)."""
    kw = dict(_partial_constexprs(p, cfg, prec), WINDOW=cfg.window, N_SEL=cfg.n_selected, WIN_TILES=p.win_tiles,
              SEL_TILES=p.sel_tiles, BN=p.BN, BPT=p.bpt, WIN_NOWAIT=nowait, STAGES=p.win_stages)
    if row_sync:
        kw.update(ROW_SYNC=True)
    if topn:
        kw.update(TOPN=True, **_topn_shape(cfg, p.n_cands, p.score_blocks, p.cands))
    return [*ptrs, *strides, cfg.scale * LOG2E, lo, p.C_CMP, p.C_WIN, p.NC], kw


def merge_group(c_cmp: int, rows: int) -> int:
    """Compressed chunks the merge loads at a time (``Plan.merge_group``) for ``c_cmp`` chunks over ``rows`` = B·G:
    above EARLY_TRIGGER_ROWS, MERGE_GROUP, or half the chunks' power of two where that is fewer, once they are
    MERGE_GROUP or more; else 0 (all at once)."""
    if rows <= EARLY_TRIGGER_ROWS or c_cmp < MERGE_GROUP:
        return 0
    return min(MERGE_GROUP, triton.next_power_of_2(c_cmp) // 2)


def kept_keys(cfg: NSAConfig, bj: int, all_keys: bool = False) -> int:
    """Top-n keys a scoring program of ``bj`` blocks keeps (``_candidates``): all of them, or its best n (a
    power of two; all where it has fewer blocks)."""
    return bj if all_keys else min(triton.next_power_of_2(cfg.n_selected), bj)


class Workspace:
    """Every buffer a step writes, allocated once (a CUDA graph needs fixed pointers)."""

    def __init__(self, p: Plan, dtype: torch.dtype, device) -> None:
        BG = p.B * p.G
        f32 = dict(device=device, dtype=torch.float32)
        self.pm = torch.empty(BG, p.NC, p.BH, **f32)
        self.pl = torch.empty(BG, p.NC, p.BH, **f32)
        self.pacc = torch.empty(BG, p.NC, p.BH, p.BDV, **f32)
        self.pcnt = torch.empty(BG, p.NC, device=device, dtype=torch.int32)
        self.bsum = torch.empty(BG, p.n_tiles, p.BH, p.nbt, **f32)   # per tile and head: block sums
        self.bmax = torch.empty(BG, p.n_tiles, p.BH, **f32)           # and the running max they are relative to
        self.idx = torch.empty(p.B, p.G, p.n_sel, device=device, dtype=torch.int32)
        self.cand = torch.empty(BG, p.n_cands, device=device, dtype=torch.int64)
        self.out = torch.zeros(3, p.B, p.G * p.h, p.d_v, device=device, dtype=dtype)
        self.mix = torch.zeros(p.B, p.G * p.h, p.d_v, device=device, dtype=dtype)
        self.reads = torch.zeros(3, p.B, p.G, device=device, dtype=torch.int32)
        self.done = torch.zeros(BG, device=device, dtype=torch.int32)   # per row: window + selection programs done



@dataclass
class StepOut:
    out: dict[str, torch.Tensor]     # branch -> o [B, H, d_v] (views into the workspace)
    reads: dict[str, torch.Tensor]   # branch -> tokens read [B, G] int32
    idx: torch.Tensor | None         # [B, G, n] int32 blocks selected (None when sel did not run)
    mixed: torch.Tensor | None       # [B, H, d_v]: Σ gate·o, when a gate was given


def decode_attention(q, k, v, k_cmp, v_cmp, pos, cfg: NSAConfig, *, branches=BRANCHES, gate=None,
                     ws: Workspace | None = None, p: Plan | None = None, phase: str = "decode",
                     append: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepOut:
    """One decode step's attention for the new token of every batch row (see the module docstring).

    q [B, H, d_k]; k/v [B, T_max, G, d]; k_cmp/v_cmp [B, N_max, G, d]; pos [B] int32 on the device;
    gate [B, H, 3] (cmp, sel, win) or None. ``ws``/``p`` from ``plan``/``Workspace`` make the call
    allocation-free (needed inside a CUDA graph); without them they are made here. ``append``: the
    new token's (k [B, G, d_k], v [B, G, d_v]), written into k/v at pos first (by the compressed
    launch, which reads no raw token: one launch fewer).
    """
    bad = set(branches) - set(BRANCHES)
    if bad or not branches:
        raise ValueError(f"branches must be a non-empty subset of {BRANCHES}, got {branches!r}")
    B = q.shape[0]
    p = p or plan(cfg, B, k.shape[1], k_cmp.shape[1], q.device, k.dtype)
    ws = ws or Workspace(p, q.dtype, q.device)
    want = set(branches)
    pdl = dict(GDC=p.gdc, launch_pdl=p.gdc > 0)
    # how the compressed launch splits the tokens held (``_cmp_split``): its kernel, the scorer and the merge agree
    # (C_CMP: a constexpr of the scorer and the merge, a plain argument of the compressed launch)
    split = dict(CMP_LEN=cfg.cmp_len, CMP_STRIDE=cfg.cmp_stride, CMP_TILES=p.cmp_tiles,
                 HALVINGS=p.cmp_tiles.bit_length() - 1)
    common = _partial_constexprs(p, cfg, precision(q.dtype))
    fused = append is not None and bool(want & {"cmp", "sel"})
    # The window programs start without waiting (WIN_NOWAIT) where the append is this step's (their token t from
    # the new token's buffer, of the cache's dtype, so that it is the value the cache holds: ``_winsel_partial_kernel``)
    # and selection programs of the same launch wait: the merge after it reads the compressed partials before its own
    # wait (CMP_EARLY). Only then does the top-n, above EARLY_TRIGGER_ROWS, let that launch go before its own wait
    # (GDC 4): otherwise its programs would only sit waiting.
    kn, vn = (a.contiguous() for a in append) if fused else (q, q)
    nowait = (WIN_NOWAIT and p.gdc > 0 and fused and "sel" in want and "win" in want
              and kn.dtype == k.dtype and vn.dtype == v.dtype)
    late_nowait = nowait and p.gdc == 3
    topn_pdl = dict(pdl, GDC=4 if late_nowait else p.gdc)
    # and the scores launch lets the top-n go once its programs have passed their wait (GDC 2, not at their end), so
    # that the window programs start under the scoring rather than under the top-n (H200, 2x caches: B=16 64k 77.7-77.9
    # against 78.5-78.6 us, 128k 124.6-124.9 against 125.9-126.2; docs/decisions.md, session 66)
    scores_pdl = dict(pdl, GDC=2 if late_nowait else p.gdc)
    row_sync = _row_sync(p, nowait, "cmp" in want)
    rs = dict(ROW_SYNC=True) if row_sync else {}
    if append is not None and not fused:
        append_token(k, v, *append, pos, cfg, p.gdc)
    qs, ks, vs = (q.stride(0), q.stride(1)), (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1),
                                                                                        v.stride(2))
    scale_log2 = cfg.scale * LOG2E
    n_sm = p.n_sm
    BG = B * p.G
    if want & {"cmp", "sel"}:
        _cmp_partial_kernel[(BG, p.C_CMP)](
            q, k, v, k_cmp, v_cmp, pos, ws.pm, ws.pl, ws.pacc, ws.pcnt, ws.bsum, ws.bmax, kn, vn, ws.done, *qs, *ks,
            *vs, k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2),
            scale_log2, n_sm, p.C_CMP, p.NC, p.n_tiles, **split, TB=p.tb, NBT=p.nbt, NBT_P=p.nbt_p, BN=p.BNC,
            WANT_V="cmp" in want, WRITE_SCORES="sel" in want, APPEND=fused, SUM_RESHAPE=p.sums_by_reshape,
            **common, **rs)
    if "sel" in want:
        NBP, BJ = p.nbp, p.score_blocks
        _scores_kernel[(BG, NBP // BJ)](ws.pm, ws.pl, ws.bsum, ws.bmax, ws.cand, pos, n_sm, G=p.G, H_PER_G=p.h,
                                        BH=p.BH, CP=triton.next_power_of_2(p.C_CMP), NC=p.NC,
                                        NT=p.n_tiles, TB=p.tb, NBT=p.nbt, NBP=NBP, BJ=BJ, KC=p.cands,
                                        BLOCK=cfg.block_size,
                                        BNC=p.BNC, OVT=triton.cdiv(p.nbt, p.tb), num_warps=p.score_warps, **split,
                                        C_CMP=p.C_CMP, IDLE_EXIT=p.gdc == 3, **scores_pdl)
        if not p.topn_in_selection:
            top_n(ws.cand, pos, ws.idx, cfg, BJ, p.cands, **topn_pdl)
    lo = p.C_CMP if "win" in want else p.C_CMP + p.C_WIN
    hi = p.NC if "sel" in want else p.C_CMP + p.C_WIN
    if want & {"win", "sel"}:
        args, kw = _winsel_args(p, cfg, (q, k, v, kn, vn, ws.idx, pos, ws.pm, ws.pl, ws.pacc, ws.pcnt, ws.done,
                                         ws.cand),
                                (*qs, *ks, *vs, ws.idx.stride(0), ws.idx.stride(1)), lo, nowait, precision(q.dtype),
                                row_sync, p.topn_in_selection and "sel" in want)
        _winsel_partial_kernel[(BG, hi - lo)](*args, **kw)
    BDV_S = min(p.BDV, p.merge_cols)
    cmp_early = CMP_EARLY and "cmp" in want and bool(want & {"sel", "win"})
    _merge_kernel[(BG, p.BDV // BDV_S)](ws.pm, ws.pl, ws.pacc, ws.pcnt, gate if gate is not None else ws.mix, ws.out,
                         ws.mix, ws.reads, ws.done, B, pos, n_sm, hi - lo, G=p.G, H_PER_G=p.h, DV=p.d_v,
                         C_WIN=p.C_WIN, NC=p.NC,
                         CP_CMP=triton.next_power_of_2(p.C_CMP), CP_WIN=triton.next_power_of_2(p.C_WIN),
                         CP_SEL=triton.next_power_of_2(p.C_SEL), BH=p.BH, BDV=p.BDV, BDV_S=BDV_S,
                         DO_CMP="cmp" in want, DO_SEL="sel" in want, DO_WIN="win" in want,
                         HAS_GATE=gate is not None, num_warps=MERGE_WARPS, C_CMP=p.C_CMP,
                         BNC=p.BNC, CMP_EARLY=cmp_early, CMP_MERGE_EARLY=cmp_early and (p.gdc != 3 or row_sync),
                         CMP_GROUP=p.merge_group, **split, **pdl, **rs)
    for br in branches:
        dispatch.note(phase, br, "triton")
    i = {br: BRANCHES.index(br) for br in branches}
    return StepOut({br: ws.out[n] for br, n in i.items()}, {br: ws.reads[n] for br, n in i.items()},
                   ws.idx if "sel" in want else None, ws.mix if gate is not None else None)


def _topn_shape(cfg: NSAConfig, nk: int, bj: int, kc: int) -> dict:
    """The top-n's ranking constexprs (``_topn_blocks``) over NK = ``nk`` keys, ``kc`` of each group of ``bj``
    blocks."""
    nsp = triton.next_power_of_2(cfg.n_selected)
    # at least 4 lanes (NSP >= 4 as n >= 3): the forced blocks' 3 slots sit beside the picks; a chunk holds n picks
    ch = min(max(nk, 4), max(TOPN_CHUNK, nsp))
    return dict(NSP=nsp, BJ=bj, KC=kc, NK=nk, CH=ch, HALF=ch // 2 > nsp)


def top_n(cand, pos, idx, cfg: NSAConfig, bj: int, kc: int, *, GDC: int = 0, launch_pdl: bool = False) -> None:
    """The step's top-n (``_topn_kernel``): cand [B·G, NK] int64, the keys the scorer kept, ``kc`` of each
    group of ``bj`` blocks (``_candidates``), pos [B] int32 -> idx [B, G, n] int32, the blocks selected for
    the token at pos, ascending, −1 padded."""
    BG, nk = cand.shape
    _topn_kernel[(BG,)](cand, pos, idx, idx.stride(0), idx.stride(1), G=idx.shape[1], BLOCK=cfg.block_size,
                        N_SEL=cfg.n_selected, **_topn_shape(cfg, nk, bj, kc), num_warps=SELECT_WARPS, GDC=GDC,
                        launch_pdl=launch_pdl)


@triton.jit
def _candidates_kernel(SCORE, POS, CAND, G: tl.constexpr, NBP: tl.constexpr, BLOCK: tl.constexpr, BJ: tl.constexpr,
                       KC: tl.constexpr):
    """The scorer's candidates (``_candidates``) from block scores given, SCORE [B·G, NBP] -> CAND (``top_n_of``)."""
    bg = tl.program_id(0)
    cur = tl.load(POS + bg // G) // BLOCK
    j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    cand = _candidates(tl.load(SCORE + bg * NBP + j), j, cur, BJ, KC)
    tl.store(CAND + (bg * tl.num_programs(1) + tl.program_id(1)) * KC + tl.arange(0, KC), cand,
             mask=tl.program_id(1) * BJ + 0 * tl.arange(0, KC) <= cur)    # (a vector: ``_scores_kernel``'s live_k)


def top_n_of(score, pos, idx, cfg: NSAConfig, *, keep_all: bool = False) -> None:
    """The step's block selection from block scores given (the tests rank scores they set): score [B·G, NBP]
    fp32 (NBP a power of two), pos [B] int32 -> idx [B, G, n] int32, ranked as the step ranks its own: each
    group of a scoring program's blocks (``SCORE_BLOCKS``) keeps its best keys (``_candidates``), as the step's,
    or all of them (``keep_all``: the top-n over every block), then ``top_n``."""
    BG, NBP = score.shape
    bj = min(NBP, SCORE_BLOCKS)
    kc = kept_keys(cfg, bj, keep_all)
    cand = torch.empty(BG, NBP // bj * kc, device=score.device, dtype=torch.int64)
    _candidates_kernel[(BG, NBP // bj)](score, pos, cand, G=idx.shape[1], NBP=NBP, BLOCK=cfg.block_size, BJ=bj,
                                        KC=kc)
    top_n(cand, pos, idx, cfg, bj, kc)


def horizon(cfg: NSAConfig, t: int, max_len: int) -> int:
    """The tokens a step for position t is planned for (``DecodeStep``'s ``horizon``): the next power of two above t,
    at least 1/HORIZON_PARTS of the cache's capacity ``max_len`` and one scoring program's blocks (``SCORE_BLOCKS``,
    below which a row has one scoring program whatever the plan), at most that capacity. Such a step serves every
    position below it, so that a caller who knows t (``NSAAttention.decode``: the host counts the tokens) runs the
    plan of a cache of about the tokens held, whatever room the cache has to grow: the scorer's programs, the top-n's
    keys and the compressed chunks of a full cache (``plan`` rounds the blocks up to a power of two anyway). The
    positions that map to one horizon form a range that ends at it, and a cache has at most log2(HORIZON_PARTS) + 1
    of them (each new plan a capture, and on a cold Triton cache its compiles)."""
    least = max(-(-max_len // HORIZON_PARTS), cfg.block_size * SCORE_BLOCKS)
    return min(max_len, triton.next_power_of_2(max(t + 1, least)))


def step_at(cfg: NSAConfig, cache, t: int, **kw) -> "DecodeStep":
    """The ``DecodeStep`` ``NSAAttention.decode`` runs for position t of ``cache``: planned for ``horizon`` of t (the
    benches, probes and parity cases time and check that step; ``kw``: ``DecodeStep``'s)."""
    return DecodeStep(cfg, cache, horizon=horizon(cfg, t, cache.max_len), **kw)


class DecodeStep:
    """A CUDA-graph-capturable decode step over a preallocated cache ``cache`` (nsa_core.DecodeCache):
    write the new token's k/v at position pos, then ``decode_attention``. Buffers are allocated
    here, once; a call allocates nothing and never syncs with the host.

    ``horizon``: the step serves positions below it (default: the cache's capacity, every position: what a CUDA
    graph replayed token after token needs); its plan is that of a cache of ``horizon`` tokens (``horizon()``). At a
    position at or past it the step would miss blocks and compressed chunks: nothing on the device checks, so a
    caller who gives one must know the position (``kernels.decode_layer.LayerDecodeStep`` does).

    call: q [B, H, d_k], k_new [B, G, d_k], v_new [B, G, d_v] (None: already in the cache), pos
    [B] int32 (device), gate [B, H, 3] or None -> StepOut (views into this step's workspace,
    overwritten by the next call). The compressed cache is updated by the caller when a span
    completes (once every d steps; ``NSAAttention.decode`` does it).

    ``held_by_cache``: the step is kept in ``cache.kernel_state`` (``kernels.routes``), and then holds
    the cache weakly, so that a cache dropped is freed at once with its steps and their CUDA graph
    rather than by Python's cyclic collector later, at any allocation: in the middle of a CUDA-graph
    capture, freeing a graph invalidates the capture (``nsa_core.cuda_graph``)."""

    def __init__(self, cfg: NSAConfig, cache, branches=BRANCHES, *, held_by_cache: bool = False,
                 horizon: int | None = None) -> None:
        self.cfg, self.branches = cfg, tuple(branches)
        self._cache = weakref.ref(cache) if held_by_cache else lambda: cache
        B, cap = cache.k.shape[:2]
        if horizon is not None and not 0 < horizon <= cap:
            raise ValueError(f"horizon {horizon} outside the cache's capacity 1..{cap}")
        self.horizon = horizon or cap
        n_max = cache.k_cmp.shape[1] if self.horizon == cap else max(cfg.n_cmp_total(self.horizon), 1)
        self.plan = plan(cfg, B, self.horizon, n_max, cache.k.device, cache.k.dtype)
        self.ws = Workspace(self.plan, cache.k.dtype, cache.k.device)
        assert cache.k.stride(2) == cfg.d_k and cache.v.stride(2) == cfg.d_v, "cache rows must be contiguous [G, d]"

    @property
    def cache(self):
        return self._cache()

    def __call__(self, q, k_new=None, v_new=None, *, pos, gate=None) -> StepOut:
        c = self.cache
        return decode_attention(q, c.k, c.v, c.k_cmp, c.v_cmp, pos, self.cfg, branches=self.branches,
                                gate=gate, ws=self.ws, p=self.plan,
                                append=None if k_new is None else (k_new, v_new))


def append_token(k, v, k_new, v_new, pos, cfg: NSAConfig, gdc: int = 0) -> None:
    """Write the new token's k_new [B, G, d_k] / v_new [B, G, d_v] into the caches k/v at pos (one launch)."""
    G = cfg.n_kv_heads
    _append_kernel[(k_new.shape[0], G)](k, v, k_new.contiguous(), v_new.contiguous(), pos, k.stride(0), k.stride(1),
                                        k.stride(2), v.stride(0), v.stride(1), v.stride(2), G=G, DK=cfg.d_k,
                                        DV=cfg.d_v, GDC=gdc, launch_pdl=gdc > 0)


@triton.jit
def _empty_kernel(X, GDC: tl.constexpr):
    """One launch of ``launch_floor``: waits on the launch before it as the step's kernels do, then
    writes one value."""
    _grid_dependency(GDC)
    tl.store(X + tl.program_id(0), 0)


def step_launches(device, rows: int) -> tuple[str, ...]:
    """The launches (``LAUNCHES``' names, in order) a ``DecodeStep`` running every branch over ``rows`` = B·G makes on
    ``device``: all but the top-n where its selection programs rank (``TOPN_IN_SELECTION_ROWS``)."""
    return tuple(n for n in LAUNCHES if n != "top-n" or not _topn_in_selection(_gdc(device, rows), rows))


def launch_floor(device, rows: int, launches: int | None = None):
    """A callable that launches ``launches`` kernels (default: as many as the step's, ``step_launches``) of one
    program doing nothing, chained as a step over ``rows`` = B·G chains its own (programmatic dependent launch where
    the step has it). Timed as the step is, it is a floor under any step of that many launches: the decode bench
    reports it beside the step (``floor_ms``; H100 figures: docs/decisions.md)."""
    launches = len(step_launches(device, rows)) if launches is None else launches
    gdc = 2 if _gdc(device, rows) else 0
    x = torch.zeros(1, dtype=torch.int32, device=device)

    def run():
        for _ in range(launches):
            _empty_kernel[(1,)](x, GDC=gdc, launch_pdl=gdc > 0, num_warps=1)
    return run
