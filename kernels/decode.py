"""Triton NSA decode step: selection for the new token, then all three branches for all h heads
of a KV group, split over the context (flash-decoding style), with no host synchronisation.

A step is five launches over preallocated buffers (``LAUNCHES``), so it can be captured in a CUDA
graph (the position is a device tensor; no shape depends on it):

1. ``_partial_kernel`` over the compressed cache: one program per (batch row · KV head, chunk of
   compressed tokens). Given the new token's k/v (``DecodeStep``), it first writes them into the raw
   cache: this launch reads no raw token (H100, graph-replayed step at 64k with the append in a
   launch of its own vs here: B=1 33.4-33.7 vs 31.6-32.0 µs, B=16 120.1-122.8 vs 118.5-119.0).
   Each program keeps an online softmax over its tiles and writes an unnormalised partial (max,
   sum, acc). For selection it also writes, per tile of BNC compressed tokens and
   head, the softmax's p = exp2(s − running max) summed onto the selection blocks its tokens'
   spans overlap (p reshaped to [h, blocks, l'/d] and summed where the geometry allows, ``SUMS_BY_RESHAPE``;
   else a product by a 0/1 overlap matrix), and that max: 17 + 1 numbers per head for 64 tokens, instead of the 64 logits
   themselves (those made a 10% DRAM round trip at 128k: written here, read back by the scorer). They
   are stored evict_last, so that the cache streaming through L2 does not evict them before they are
   scored (measured: the record of the evict_last stores in the notes below).
2. ``_scores_kernel`` (one program per (batch row · KV head, 64 selection blocks)) merges the
   compressed partials into each head's softmax max M and normaliser L, rescales the tiles' block
   sums by exp2(their max − M) / L and sums them over the tiles that reach a block and over the h
   heads: the selection-block scores; ``_topn_kernel`` (one program per (row · KV head)) takes the
   top n (block 0 and the two local blocks forced; ties to the lower index), written ascending and
   −1 padded: exactly docs/nsa.md.
3. ``_partial_kernel`` over the window (positions max(0, t−w+1) .. t) and the selected blocks
   (positions j·l' .. min(j·l'+l', t+1)−1), in tiles of one selection block (two at B·G 9–16:
   ``TWO_BLOCK_TILES``).
4. ``_merge_kernel``: log-sum-exp merge of each branch's partials -> o per branch, the
   gate-weighted mix when a gate is given, and the tokens each branch's programs loaded.

On Hopper and later the step's kernels (a separate cache append included) are launched as programmatic
dependent launches: each is set up while the one before it runs and waits, first thing, until
that one has finished and its writes are visible (``_grid_dependency``; the merge reads the
compressed partials, written at least two launches back, before it waits: ``CMP_EARLY``), which takes the launch
gaps out of a small step (B=1, 64k on the H100: 38.6-39.2 -> 35.5-35.9 us, graph-replayed). For few rows the
next launch is let go when a kernel starts; for many, when its programs' loops are done (``EARLY_TRIGGER_ROWS``),
except the top-n, which lets it go before its own wait. Where the step appends the new token itself (``DecodeStep``
given k_new/v_new) and runs all three branches, the window programs do not wait at all: they read nothing the step's
earlier launches write (the new token's k/v come from its own buffer; ``WIN_NOWAIT``), so the window streams while
the top-n ranks. (``LayerDecodeStep`` runs the step so too: its φ takes token t from the new token's row.)

The grids are sized for the cache's capacity (a graph replays them at every position), the work for
the tokens held: the compressed launch splits the compressed tokens at position t as it would split a
full cache of t + 1 tokens (``_cmp_split``; its programs past them do nothing), the scorer scores and
the top-n ranks only the blocks up to t's, and the merge reads only the partials written. So a cache
allocated with room to grow costs what a full one does.

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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.common import LOG2E, block_key, head_dim_parts, load_dk, precision, sm_count
from nsa_core import dispatch
from nsa_core.config import BRANCHES, NSAConfig
# launch configuration, from sweeps of the graph-replayed step on an H100 (paper config, bf16, 64k;
# B=16 / B=1, ms): partial programs of 4 warps (8: 0.171-0.185 vs 0.136-0.138 at B=16), 2 stages
# (3 stages hold one program per SM: 0.137-0.160); compressed tiles of 64 tokens (32: 0.137-0.165,
# 16: 0.156-0.197 at B=16; later, 32 with 3 or 4 stages in the compressed launch alone, the same shared
# memory with more tiles in flight: 114.1-114.8 / 121.7-124.1 us vs 107.1-109.8 at B=16, 28.0 vs 23.1 at
# B=1, 186.2-186.8 / 202.8-206.8 vs 175.8-182.6 at B=16, 128k; replays back to back, L2 not flushed); merge programs of
# 8 d_v columns (B=1: 0.0402 vs 0.0434 with 32) below B·G = 16, 16 from there (``_launch_shape``). Top-n
# programs of 8 warps (4: the same; 2: B=1 36.0-36.2 vs 34.4-34.9 us; 1: 50.4-50.6 us at B=1, 145.4-145.7
# at B=16).
# Nsight Compute on the compressed partial (B=16, before the d_k split): 2 programs of 4 warps per
# SM (registers and shared memory each allow 2), schedulers idle 71% of cycles; capping registers
# for more programs per SM was slower (maxnreg 168 / 128: 76.3 / 83.7 us vs 72.8 us uncapped)
# Also measured no faster (H100, B=16 / B=1, 64k, eager kernel time of the compressed partials vs
# 72.9-73.6 / 6.4 us): the caches head-major [B, G, T, d] instead of token-major (step 126.2-127.2
# vs 126.7-128.0 us); the compressed tiles through tensor descriptors (TMA) 72.7-73.6 / 6.6 us, with
# 3 stages 82.2 us, with the loop warp-specialized 73.6 us (3 stages 82.1; 8 warps 90.5); 1 or 2
# warps with tiles of 16 / 32 / 64 tokens and 2-4 stages, step 129.2-223.6 vs 128.3-130.3 us. ncu
# on the TMA variant (B=16): 2 programs of 4 warps per SM (220 registers, 88 KB of shared memory
# each), 61% of DRAM peak, no eligible warp 74% of cycles. ncu on this code's eager step there: the
# compressed partial 67.8 us for 168 MB (DRAM 76.7% of peak; 198 registers, 88 KB of shared memory, 2
# programs per SM; long-scoreboard stalls 43%), the window + selection partial 30.2 us for 58 MB (59.8%;
# 192 programs of up to 8 tiles, 9.1% achieved occupancy)
PARTIAL_WARPS, SELECT_WARPS, MERGE_WARPS = 4, 8, 4
# ``DecodeStep``'s launches, in launch order (the decode suite labels Nsight Compute's per-kernel
# rows with them), and which branches' cache tokens each launch reads
LAUNCHES = ("append + compressed partial (+ block sums)", "block scores", "top-n", "window + selection partial",
            "merge")
CACHE_READS = {"append + compressed partial (+ block sums)": ("cmp",), "window + selection partial": ("sel", "win")}
# Where a step's time goes, per program (globaltimer at start, after the wait, at the end; H100, B=16 64k, the step
# graph-replayed after an L2 flush, waiting only above EARLY_TRIGGER_ROWS, us from the first program's start): the
# compressed partials 0-71.2 (programs end from 62.2, p50 67.6), block scores 72.2-74.8, top-n 75.8-80.6 (4.6-4.9 of
# work in each of its 64 programs), window + selection 81.7-109.1 (programs of 20-27.4 us; ends p10 104.2, p50
# 105.5), merge 110.1-112.6. B=1: 0-8.7, -11.0, -16.1, -22.0, -26.9, each launch waiting on the one before.
PARTIAL_STAGES = 2             # software-pipelining stages of a partial program's tile loop
# (Window + selection tiles of 32 tokens, half a selection block, from B·G = 16 on, measured slower: H100,
# `suite decode -k test_bench`, two rounds each on one machine, B=16 64k 118.3-118.4 vs 110.8-111.1 us. With 3
# stages for the window + selection launch, graph-replayed in a script, tiles of 32 / 16 tokens took 110.7-112.5 /
# 111.8-112.3 us and whole blocks 113.5-114.6: none clearly ahead of 2 stages (110.8-111.1 above). Later, the
# launch as one program per SM with deeper prefetch, its window in one program of 8 tiles and its 16 blocks in
# another (128 programs at B=16), graph-replayed, read flush, three rounds: B=16 64k 3 stages 108.5-108.6 us (8
# warps 109.7-109.8; 2 stages 115.7-117.4; 4 stages do not fit in shared memory) vs 104.7-106.2 as planned, 128k
# 174.2-175.4 vs 173.6-173.8; the planned tiles with 3 stages 110.0-110.4 / 178.0-178.2. Its programs in another order,
# a row's chunks adjacent or the selection chunks first (so that the second program on an SM is a window one):
# the same within run-to-run spread, B=16 64k 104.4-106.0 / 105.7-106.3 vs 104.6-107.2, 128k 171.8-173.3 /
# 169.2-173.0 vs 171.7-174.2, B=8 65.7-66.1 / 65.7-65.9 vs 65.2-65.4.)
MAX_TILES = 16                 # tiles one partial program walks at most
# B·G range (inclusive) in which a window / selection tile holds two selection blocks (128 tokens in the paper
# config) rather than one: half the tile loop's iterations, each with its cross-warp reductions and barriers (ncu:
# that launch is latency-bound on them). H100, graph-replayed step, read flush, three rounds, us, two blocks vs one:
# B·G 16 (B=4): 4k 27.8-28.7 vs 28.2-28.3, 16k 32.2-32.3 vs 33.3-33.4, 64k 45.5-46.1 vs 47.2-47.6, 128k
# 62.8-62.9 vs 63.8-64.0; B·G 8: 64k 35.0-37.9 vs 35.4-37.5, 16k 26.7 vs 26.7-26.8; slower at B·G 4 (64k 29.0-29.3
# vs 28.4-28.7), 32 (64k 68.7-69.0 vs 66.5-66.8, 128k 100.3-100.6 vs 97.9-98.4) and 64 (64k 112.2-113.2 vs
# 105.7-106.5 with 4 tiles a program, 113.0-113.1 with 2; 128k 177.9-181.6 vs 174.8-175.1). H200, the same script:
# B·G 16: 64k 42.7-44.8 vs 44.1-44.2, 16k 30.8-31.0 vs 31.9, 128k 60.2-60.4 vs 60.0-60.4; B·G 8 33.4-33.6 vs
# 33.5-33.6; slower at B·G 32 (64.5-64.8 vs 61.6-62.1) and 64 (102.2-102.7 vs 97.1-97.2)
TWO_BLOCK_TILES = (9, 16)
# Measured and not taken (same timing): partial programs computing 32 or 64 rows, the group's 16 heads padded (64: a
# Hopper wgmma, each warp holding whole rows, so the softmax's row reductions stay within a warp; ptxas: 9-13 rather
# than 15 barriers a tile, but 188 KB of shared memory for the compressed launch's programs): B=16 64k, window +
# selection programs of 64 rows 109.3-114.1 us (1 stage; 2 stages 118.3-118.5), of 32 rows 109.6-109.8, compressed
# programs of 64 rows 122.2-148.3, of 32 rows 144.5-145.1, vs 105.4-107.3; 128k 177.3-185.1 vs 174.3-174.9; B=1
# 28.4-35.1 vs 28.5-28.7.
# The compressed programs' block sums without products, where the geometry allows (``Plan.sums_by_reshape``: l'/d a
# power of two dividing the tile, spans reaching at most the next block): p [h, tile tokens] seen as [h, blocks,
# l'/d] and summed over its last axis gives each token's own block; the overhang of the tokens whose span runs into
# the next block, summed the same way, is moved one block on (``tl.gather``), the last one into column TB: the same
# [h, NBT] rows as the products by the 0/1 overlap matrix (two tf32 products of p's split, see the kernel), in plain
# fp32 adds. H100, paper config, graph-replayed, read flush, one workspace, six rounds alternating, us, outputs
# bit-identical, vs the products: B=16 64k 102.9-103.5 vs 104.4-105.1, 128k 169.0-169.8 vs 172.1-172.7, 16k
# 58.1-58.4 vs 58.7-59.5; B=32 64k 192.5-192.8 vs 194.6-196.0; B=8 63.0-63.5 vs 63.6-64.4; B=4 43.6-43.8 vs 43.8-44.3;
# B=1 64k 26.1-26.4 vs 26.5-26.8, 128k 34.0-34.3 vs 34.3-34.8. (The compressed kernel: 164 registers instead of
# 198. The overhang stored beside the own sums instead, [h, blocks, 2] a tile, 2 KB rather than 1.1, and added by
# the scorer: B=16 64k 105.9-106.4 us, B=32 201.8-202.6: at large B the stores, more than the products, cost. And
# the tile's max stored in its sums' row (rows of NBT + 1 floats, the overhang and the max as one [h, 2] store) rather
# than apart: slower, eight rounds, B=16 64k 103.2-104.8 vs 102.5-102.9, 128k 170.3-171.3 vs 167.9-169.1, B=1
# 26.4-26.8 vs 25.7-26.2, B=32 196.0-196.4 vs 194.5-195.0.)
SUMS_BY_RESHAPE = True
SCORE_BLOCKS = 64              # selection blocks one scoring program covers
TOPN_CHUNK = 1024             # selection blocks the top-n ranks at a time (``_topn_kernel``)
# compressed tokens per tile of the compressed partials. (128, half the tile loop's iterations and barriers per
# byte, measured slower: H100, graph-replayed, read flush, B=16 64k 126.1-126.4 us with 1 stage (80 KB of shared
# memory; 2 stages, one program per SM: 162.1-162.2) vs 105.7-107.3; 128k 208.6-209.1 vs 175.9-176.5; B=4 56.9-58.6
# vs 45.9-46.2; B=1 31.6-32.0 vs 28.7-28.8. 32 with 4 stages: 125.1-126.9 / 210.7-211.2 / 50.9-51.0 / 33.2-33.3.
# The tile loop unrolled by 2 / 4 (``tl.range(loop_unroll_factor=)``): B=16 64k 108.0-109.0 / 121.6-121.9 vs
# 105.5-106.8, 128k 174.9-175.5 / 195.5-197.0 vs 175.0-175.4, B=1 28.6-28.9 vs 28.5-28.6.)
CMP_TILE = 64
# elements per piece of the append's row copy (``_copy``): 64 made the step ~1 us slower on the H100
# (64k, B=1 32.2-32.7 vs 31.1-31.6 us, B=16 119.5 vs 118.4-118.5)
COPY_CHUNK: tl.constexpr = tl.constexpr(128)
# programmatic dependent launch (_grid_dependency) where the GPU has it; the next kernel's launch
# is triggered early only for few (row · KV head)s. H100, paper config, graph-replayed step, 64k:
# B=1 38.6-39.2 us without, 37.8-38.1 waiting only, 35.5-35.9 with the early trigger; B=16
# 131.0-131.6 / 129.5-130.2 / 130.6-131.1 us (128k: 203.4-204.2 / 202.5-203.5 / 204.2-205.7)
PDL = True
# B·G up to which the early trigger is used; H100, 64k, graph-replayed step, wait-only vs early trigger:
# B·G 4: 34.9-37.2 / 34.3-34.7 us, 8: 46.2-46.3 / 45.3-45.5, 16: 58.6-59.1 / 58.2-58.4, 32: 82.6-83.0 /
# 82.8-83.1, 64: 129.3-129.4 / 130.9-131.0. Above it, the early trigger in some launches only (each of
# the 15 subsets of the first four) gained at most ~1 us: B·G 64 116.3-116.5 (scores and top-n) vs
# 116.7-117.9 us, 128k 184.9-185.5 (top-n) vs 186.2-186.5, B·G 32 74.3-74.4 vs 75.4-75.6; in all four,
# 123.6 us at B·G 64. Above it, each program instead lets the next launch start once its own loop is done
# (``_grid_release``): the next kernel is launched when the last program of this one gets there, not when it has
# exited, and its programs take only the slots this one's finished programs freed. A graph-replayed step's
# timeline (globaltimer per program, H100, B=16 64k, waiting only) showed ~1 us between the last program of
# each launch ending and the first of the next starting, four times a step. H100, graph-replayed, read flush,
# three rounds alternating, us, late trigger vs waiting only (outputs bit-identical): B=16 64k 104.6-107.0 vs
# 105.9-107.7, 128k 173.7-174.6 vs 175.8-176.3, 16k 60.6-61.0 vs 61.4-61.9; B=8 64k 65.3-65.7 vs 66.7-66.9;
# B=32 64k 197.7-198.7 vs 198.2-199.1
EARLY_TRIGGER_ROWS = 16
# the merge's loads of the compressed partials moved ahead of its wait (``_grid_dependency``): under
# the early trigger they overlap the window + selection launch. H100, paper config, graph-replayed step,
# two rounds, harness flush / read-only flush (``timing``), us: 64k B=1 31.0-31.3 / 29.0-29.5 vs
# 31.4-31.9 / 29.8-30.6; 128k B=1 40.4 / 36.6 vs 40.6-40.8 / 37.4; B=4, 16, 32 unchanged (all
# outputs bit-identical). Not taken, same runs: the window programs of the window + selection launch
# starting without a wait (they read only what the compressed launch, three back, wrote; taken later with the top-n
# triggering first above EARLY_TRIGGER_ROWS: ``WIN_NOWAIT``): B=1 64k
# 31.5 / 30.2-30.4, B=4 52.0-52.4 / 49.8 vs 51.6 / 48.4-48.5; the early trigger at every B (with
# both): B=16 64k 122.0-122.7 vs 117.9-118.2, 128k 193.0-193.2 vs 186.7-187.0. And the step over
# batch halves (or quarters) as parallel streams of one graph, so that one half's scoring, top-n and
# merge run beside the other's partials: B=16 64k 115.7-116.5 vs 116.6-118.4 us, 128k 178.9 vs
# 185.5-186.8, B=32 207.3-208.0 vs 208.7-209.9, but B=8 80.1 vs 75.3 and B=4 60.6 vs 51.4; a half
# whose window launch goes first, before its compressed one, 125.0-127.3 at B=16 64k; quarters 134.1. (Halves as
# streams measured again with the step as it is since the early trigger and evict_last, each half its own plan:
# B=16 64k 127.5-130.6 vs 105.9-106.8 us, 128k 197.2-197.8 vs 173.8-175.2, B=32 212.9-213.8 vs 195.0-197.1, B=8
# 88.4-88.5 vs 66.6-67.1; planned as the whole batch, slower still.)
# Under the early trigger (GDC 2, up to EARLY_TRIGGER_ROWS) the merge also merges and stores the compressed branch
# (and its share of the gate mix) before its wait (``_merge_kernel``'s CMP_MERGE_EARLY), so that after it only the window's and selection's few partials
# remain. H100, paper config, graph-replayed, read flush, one workspace, eight rounds alternating, us, outputs
# bit-identical, with vs without: 64k B=1 26.5-27.5 vs 28.7-29.7, B=2 33.1-33.4 vs 35.0-35.2, B=4 43.6-44.2 vs
# 45.2-45.8; 128k B=1 34.5-34.8 vs 36.6-36.8; 16k B=1 23.1-23.4 vs 23.9-24.2. Under the late trigger (GDC 3) it was
# the same or slower (B=16 64k 104.3-104.8 vs 104.0-104.7, 128k 174.3-175.3 vs 173.9-174.5): the merge is launched
# only as the window + selection programs end, so there is no time before its wait to fill; there it merges after.
CMP_EARLY = True
# The window programs of the window + selection launch start without waiting (``_partial_kernel``'s WIN_NOWAIT, the new
# token read from its own buffer; where the step does the append: ``decode_attention``'s ``nowait``), and above
# EARLY_TRIGGER_ROWS the top-n launch lets that launch go before its own wait (GDC 4): the window's 21 MB (B=16, 64k) stream while the top-n ranks. The per-program timeline (globaltimer, H100,
# B=16 64k, three replays) has the window programs start at 76.0-77.3 us, ~1 us after the top-n's (75.0-76.3), instead
# of at 79.9-80.9 after it; the selection programs wait until 80.9-81.9 and end at 106.5-107.8 (window 102.7-103.4). H100, paper config, graph-replayed, read flush, three rounds alternating, us, outputs bit-identical, with
# vs without: B=16 64k 103.9-105.7 vs 105.8-108.1 (again: 104.3-105.7 vs 105.7-108.0), 128k 172.9-173.1 vs
# 173.6-173.8, 16k 59.6 vs 60.5-61.1; B=8 64k 64.5-64.8 vs 65.5-66.0, 128k 95.5-95.6 vs 97.1-97.3; B=32 64k the
# same (198.6-199.5 vs 198.9-199.4). Later, six rounds in alternating order (the earlier runs always timed the code
# before first): B=16 64k 105.8-107.0 vs 104.3-106.3 and, the same case again, 105.6-105.8 vs 106.1-106.9 (within
# the run-to-run spread: no gain shown there), 128k 172.0-172.9 vs 172.0-172.9, B=8 64k 64.0-64.3 vs 65.3-65.9. Below it (early trigger) the window alone not waiting: B=4 64k 44.9-45.1 vs
# 46.0-46.1, B=2 34.6-34.7 vs 35.2-35.3, B=1 64k / 128k unchanged (28.6-28.8 vs 28.8-28.9 / 36.6-36.9 vs
# 36.7-36.8); there the top-n triggering first as well gained nothing (B=2 34.7-34.9, B=4 46.0-46.3).
# Measured and not taken: the scores launch triggering first too, so that the window starts under the scoring (B=16
# 64k 104.1-104.8 us, but 128k 182.0-183.5: some top-n programs, launched early and waiting through the scoring, then
# took 15-17 us instead of 6-7, on SMs running nothing else; also with the window waiting); the compressed launch
# triggering early as well, so that the window fills its tail (B=16 64k 112.4-113.5, 128k 180.8-181.1); the window
# and selection programs shorter once the window overlaps (window / selection tiles a program 4/4, 2/4, 2/8, 4/8, 1/4,
# 2/2, 8/6, 8/5, 8/4, 4/6, 8/3 vs 8/8): at B=16 64k none faster (105.1-109.8 vs 103.9-105.7), 128k 171.4-171.5 with
# 8/6 vs 171.6-172.4, B=8 only 2/2 (61.2-61.5 vs 63.5-64.4) and slower at B=4 and B=32. With this change in, four
# rounds in alternating order: B=8 2/2 / 1/2 64k 64.0-64.6 / 63.3-63.6 vs 64.6-64.9 (the plan's 4/4), 128k 93.4-93.7 /
# 93.6-94.9 vs 95.2-95.6, 16k 41.0-41.3 / 41.3-41.9 vs 40.6-41.0; B=16 64k 4/4 and 2/2 108.1-108.7 vs 105.2-106.0;
# B=32 64k 8/8, 4/4, 8/16 196.0-197.7 vs 197.1-197.2. And the selection loop alone with 3 stages (the window's 2;
# the kernel's shared memory 90 KB rather than 88, so still 2 programs per SM): selection programs 21.2-22.5 us
# instead of 22.8-23.6, window programs 27.1-29.4 instead of 23.8-25.1 (B=16, timeline); steps over three inputs, four
# rounds alternating: B=16 128k 170.3-172.9 vs 172.1-174.0, 64k 104.1-106.6 vs 104.3-106.3, B=8 64k 63.7-64.1 vs
# 64.1-64.7, 128k 97.0-97.1 vs 95.7-96.0, B=32 64k 199.4-200.0 vs 197.0-197.7, 16k 60.2-60.6 vs 59.4-59.8.
WIN_NOWAIT = True
# Measured, shipped from 16bb9f0, and taken out again (the scores-first trigger): where the window does not wait
# (WIN_NOWAIT) above EARLY_TRIGGER_ROWS and the block-scores launch has at most 1024 programs, that launch let the top-n
# go at its start (GDC 2, after its wait) rather than at the end of its programs (GDC 3): the top-n, which lets the
# window + selection launch go first (GDC 4), is then launched while the scores run, and the window streams from the
# scores' end rather than from the top-n's start. Per-program timeline (globaltimer, H100, B=16 64k, three replays):
# window programs start at 73.0-74.2 us instead of 76.0-76.8, the selection programs' wait ends at 79.1-80.6 instead of
# 80.9-81.4. H100, paper config, graph-replayed, read flush, eight rounds rotating the order, one workspace shared by
# the variants, us, outputs bit-identical, with vs without: B=16 64k 105.2-105.8 vs 105.8-106.8, 16k 58.7-59.0 vs
# 59.6-60.3; B=8 64k 63.7-64.1 vs 64.4-64.6, 128k (1024 programs) 95.8-96.4 vs 95.8-96.4. Over 1024 programs it was
# slower (each variant its own workspace, which alone moves a step by up to 5 us: see docs/method.md): B=16 128k (2048
# programs) 179.7-182.8 vs 172.5-173.1, B=32 64k 200.5-201.2 vs 198.0-198.9; in the 128k timeline some top-n programs,
# their wait over, took 16-17 us instead of 7, and the selection waited for them.
# (Scoring programs of 128 blocks, so that those two have 1024 programs and take this too: 185.2-190.1 vs 171.9-172.8
# us and 207.5-208.9 vs 198.7-199.5.)
# Measured and not taken, the same shared-workspace runs: the selection programs reading the forced blocks (0 and the
# two local ones, known from t) before their wait, token t from the new token's buffer, the top-n's picks after it
# (outputs within rounding of these, blocks and reads equal): B=8 64k 63.2-63.8 vs 64.4-64.6, B=1 64k 28.0-28.3 vs
# 28.6-28.7, but B=16 64k 106.6-107.0 vs 105.8-106.8, 128k 173.2-174.1 vs 172.8-173.2, B=32 64k 199.0-199.6 vs
# 196.6-197.5 and B=4 (two-block tiles) 51.8-52.2 vs 45.0-45.4. Its timeline (B=16 64k): the selection programs that
# start before the top-n ends read their forced blocks then, but those dispatched last start as it ends and read them
# after, when the bandwidth is already taken: the last selection program ends no earlier.
# Why the scores-first trigger went: the step's time with it depends on a state of the GPU (docs/method.md, Decode
# bench: after eager steps the top-n took 14.7-14.9 us instead of 7.2) and without it far less. H100, one variant per
# process (the state never showed in processes that had captured several), three workspaces, each a graph of 20
# [read flush, step] replayed 15 times, three rounds each after ~3 ms of 1 GiB copies and after 50 ms of eager
# steps, us, with / without: B=16 64k 99.9-100.0 / 101.0-101.3 after copies, 105.4-105.8 / 99.9-100.2 after eager
# steps; B=8 64k 60.6-60.8 / 61.5-61.9 and 63.7-63.9 / 60.9-61.0; B=8 128k 91.8-92.3 / 92.0-92.4 and 92.2-92.3 /
# 92.3-92.4; B=16 16k 56.7-57.0 / 57.0-57.1 and 56.6-56.7 / 56.8-57.0. (Another run, B=16 64k: 99.9-100.1 / 100.9-101.2
# after copies, 105.4-106.3 / 99.8-100.2 after eager steps; the window waiting instead, 102.0-102.2 and 100.4-100.7.)
# Without it the worst of the two states is 4.5 us lower at B=16 64k and 2 us at B=8 64k, for 1 us more in the better.
# The compressed launch stores its block sums and maxima (the scores launch's input) with evict_last: the
# compressed cache streaming through L2 then does not evict them (written back to DRAM mid-launch and read back
# from there by the scores launch) before they are scored. H100, `suite decode -k test_bench` alternating with
# the code before (the stores plain), two rounds: B=16 64k 107.7 / 107.5 vs 111.1 / 111.0 us, B=1 31.8 / 31.6 vs
# 31.8 / 31.8 (outputs bit-identical). Part of that is write-back moved past the step: lines left dirty when it
# ends are written back in the harness's flush (untimed) or by whatever runs next. Timed with what runs next (the
# step and a 128 MB read sweep as one graph, replayed back to back without a flush; sweep alone 51.7 us): 64k
# B=16 158.4-158.8 vs 160.6-162.1 us (the step alone, read flush: 106.3-106.6 vs 110.0-110.1), 128k 225.2-225.8
# vs 231.2-232.8 (173.1-173.6 vs 178.1-178.8): of the step's gain, 2-3 of 3.5 us are kept at 64k, all at 128k.
# What the block sums cost the compressed launch alone (graph-replayed, B=16 64k, stores plain): 68.5-68.8 us
# with them, 62.2-62.5 without, 64.6-64.7 with their products but one store per program, 66.1-66.3 with the
# stores and no products. Measured and not taken: dropping the lines from L2 unwritten once scored
# (discard.global.L2 in the window + selection launch): the same times (step + sweep 158.7-158.8 us at 64k,
# 225.7-225.8 at 128k), and Nsight Compute (application replay, one step then a 1 GiB read sweep) counted the
# same DRAM writes with and without it (9.6-9.7 vs 9.2-9.5 MB); in the top-n launch it also cost B=1 ~1 us.
# Where the block sums and maxima land decides part of the step's time: ten workspaces of one step (H100, B=16 128k,
# graph-replayed) took 169.6-172.7 us; the slowest with the fastest one's bsum took 170.7-170.8 instead of 172.5-172.6,
# with its bmax 171.4-171.5, with any other buffer of it unchanged (and the fastest with the slowest's bsum / bmax
# 171.1-171.2 / 170.7-171.0 instead of 169.0-169.5). It is not their offset in an allocation (bsum placed at 0-1792 KB
# in steps of 256 KB in three allocations: within ~1 us in each, the allocations 171.1 / 171.9 / 172.7 on average), so
# the bench reports the range over workspaces (docs/method.md). Also measured and not taken: the cache's K/V loads
# evict_first (compressed launch, or both partial launches), so that the stream leaves the block sums alone: the
# same times and the same spread over three workspaces (B=16 128k 172.0-173.9 vs 170.7-173.9 us, 64k 104.2-104.9 vs
# 104.4-105.1, B=32 64k 194.2-199.0 vs 195.1-198.4, B=1 64k 28.5-29.0 vs 28.5-28.7).
# Measured and not taken: no merge launch from B·G = 32 on, each row's last window + selection program to finish
# (a per-row counter, release / acquire atomics) merging the row's partials, all d_v columns 32 at a time. H100,
# `suite decode --level full -k "test_bench and (S65536 or S131072)"`, two rounds alternating with this code: B=16
# 64k 112.2 / 112.3 vs 107.5 / 107.7 us, 128k 186.6 / 186.3 vs 173.9 / 173.8 (the window + selection kernel
# carrying the merge's code); B=1 unchanged (not fused there). And below it (early trigger), the merge launch kept but
# waiting on its own row only: each window + selection program adding one to a per-row count once its partials are
# stored (a barrier, then a release atomic), the merge's programs polling the count (acquire) instead of waiting for
# the whole launch to finish (the compressed launch reset the count after its wait). Outputs bit-identical, 2000
# graph replays each at B=1 / 4 64k and B=2 16k without a difference, but slower (H100, graph-replayed, read flush,
# one workspace, four rounds alternating, us): 64k B=1 25.6 vs 25.2-25.4, B=2 32.1-32.4 vs 31.0-31.3, B=4 42.5-42.7
# vs 42.1-42.3; 128k B=1 32.9 vs 32.6-32.7; 16k B=1 23.4-23.5 vs 22.8.
# Measured and not taken (H100, paper config, graph-replayed, read flush, three rounds each, us; outputs checked against
# this code's): the window walked by the compressed launch's programs (compressed program c also walking window chunk c,
# token t's k/v read from the new token's buffer) and the selection alone in the second partial launch, its tiles per
# program swept: 64k B=16 108.7-108.9 (4 tiles; 2 / 8 / 16: 110.7-111.1 / 111.8-112.0 / 123.2-123.5) vs 105.5-107.1;
# B=8 70.3-71.7 vs 66.2-66.5; B=4 50.9-51.5 vs 47.0-47.2; B=1 32.6-32.8 vs 28.7-28.9; 128k B=16 183.7-183.8 vs
# 174.2-174.8; only B=32 64k gained, 196.8-197.1 (8 tiles) vs 197.8. And the window's k/v lines prefetched into L2
# (PTX prefetch.global.L2, from the scoring programs, before the window + selection launch reads them): 64k B=16
# 107.6-107.9 (evict_last: 113.0-113.3) vs 104.9-106.4, 128k 177.0-177.4 vs 174.5-175.1, B=1 29.3-29.5 vs 28.7-28.9.
# Measured and not taken: the whole step as ONE persistent launch (2 programs per SM, all resident, taking the
# step's items in an order where every item depends only on earlier ones: per (row · KV head) its compressed
# chunks (the first appending the token), window chunks, scoring slices, top-n, selection chunks, merge slices; an
# item waits on per-row stage counters, written with release atomics and polled with acquire atomics or ld.acquire
# + nanosleep, the same; outputs bit-identical to these launches). H100, paper config, graph-replayed, read flush,
# us: 64k B=1 41.8 (items every P-th), 32.2-32.9 with the compressed and window chunks merged by items of their
# own as soon as they finish (items taken next from a counter: the same), 33.5 / 38.0 with the rows in 2 / 4
# software-pipelined groups, vs 28.6-31.4; 64k B=16 130.5, from a counter 124.7 (selection chunks of 8 tiles; 4
# tiles 121.8-123.6, 2 tiles 125.2; groups 2 / 4 / 8: 135.1 / 168.5-177.6 / 170.6) vs 110.1-111.4; B=4 and 128k
# B=16 (items every P-th, no merge items) 59.3 vs 48.3 and 205.4 vs 179.0. Its item timeline (globaltimer) shows
# why: at B=1 the chain is as long as the launches' (compressed chunks of one tile end at 8.4, scoring 11.7, top-n
# 17.5 (5.4 of work), selection 22.4 (one tile: 3.9), merge 25.4), with ~7 us outside the items (a 255-register
# kernel); at B=16 a program's bandwidth is latency-bound, so every program that waits on a counter is bandwidth
# lost: selection chunks of 2 tiles took 14.4 us, of 8 tiles 20.6, and grouping the rows left most programs
# waiting while few read.
# Measured and not taken: the partial programs asking L2 for the tiles PF ahead of the one they load (PTX
# prefetch.global.L2 per 128-byte line, or cp.async.bulk.prefetch.L2 per row, predicated on the rows the step may
# read), so that programs whose tile loop waits on memory keep more bytes in flight. H100, paper config,
# graph-replayed, read flush, one workspace, three rounds rotating the order, us, outputs bit-identical; per line,
# compressed launch PF 1 / 2 / 4: B=16 64k 107.1-107.8 / 118.3-118.4 / 129.6-130.0 vs 104.4-105.0, 128k
# 178.4-178.8 / 206.5-207.4 / 224.1-224.6 vs 171.6-172.7, B=32 64k 202.5-203.0 / 231.9-232.8 / 249.5-249.8 vs
# 197.2-197.4, B=1 and B=4 the same within 1 us (B=4 PF 4 42.7-43.3 vs 43.9-44.1); window + selection launch PF
# 1 / 2 / 4: B=16 64k 105.5-105.6 / 108.1-108.4 / 110.2-110.7, 128k 171.7-172.5 / 175.2-175.6 / 177.1-177.4,
# B=32 197.5-197.7 / 204.3-205.1 / 214.5-215.2, B=1 28.0-28.3 vs 26.7-26.8. Per row (bulk): slower still (B=16
# 64k compressed PF 1 109.7-111.0, window + selection PF 1 113.3-113.7).
# Measured and not taken: the window + selection tiles as 2 or 4 runs of keys with an online softmax each, in
# batched products ([runs, h, keys]: meant to keep a run's rows and keys in one warp, so that the softmax's
# reductions cross no warps), merged once a program. Triton 3.6 compiled it to more barriers, not fewer (76 bar.sync
# vs 36 in the PTX), 255 registers (164), 48 KB of shared memory (88): H100, graph-replayed, read flush, one workspace, us, 2 / 4 runs vs
# one: B=16 64k 196.7-197.3 / 208.5-210.5 vs 104.3, 128k 273.8-275.7 / 278.4-280.1 vs 172.1-173.4, B=1 64k
# 46.0-46.4 vs 26.5-26.6.
# Measured and not taken: each scoring program ranking its own 64 blocks (packed (score bits, 2^31 - 1 - j) keys, a
# block's rank = how many of the program's keys exceed its own) and writing its 16 best as candidates; the top-n
# ranking those candidates (256 at 64k, 512 at 128k) against each other in chunks, the forced blocks added, the set
# sorted: the same blocks and outputs (bit-identical), but the ranking made the scoring programs slower (B=16 64k,
# eager: 9.2 vs 4.3 us with one warp; with 4 warps, B=1, ptxas kept 32 registers and spilled 4282 bytes: 366 us).
# H100, graph-replayed, read flush, one workspace, us: B=16 64k 107.1-108.4 vs 104.1-104.4, 16k 57.9-58.6 vs
# 58.5-59.1, 128k 204.6-396.3 vs 171.6-172.5, B=32 64k 197.9-199.5 vs 196.4-196.8, B=1 64k 472.7-476.9 vs 26.5-26.7.
# Also not taken, the same shape with the candidates by passes instead of ranks: each scoring program taking its 16 best
# by eight best-two reductions (the top-n's passes of then), the top-n running its passes over those (256 at 64k) instead of over every block,
# the set written, read back and sorted. Blocks and outputs bit-identical; H100, graph-replayed, read flush, one
# workspace, six rounds, us: B=16 64k 104.4-104.7 vs 102.5-103.2, 128k 181.3-183.2 vs 168.7-169.6, B=1 64k 29.3-29.7
# vs 26.1-26.5, B=4 46.5-46.9 vs 43.5-44.0, B=32 197.5-199.1 vs 194.8-195.6.
# Measured and not taken: the block sums kept in registers over a compressed program's tiles ([h, tiles, blocks a
# tile], rescaled with the softmax's max like acc, the overhang into the next tile added there) and stored once a
# program, relative to the max the partial stores (the per-tile stores cost the compressed launch ~4 us at B=16 64k:
# see the evict_last record after WIN_NOWAIT). The same blocks and outputs, but 255 registers with 76-114 bytes
# spilled (198 without): H100, graph-replayed, read flush, one workspace, six rounds, us: B=4 64k 57.7-58.0 vs
# 43.5-43.8, B=8 89.3-89.8 vs 63.2-63.8, B=32 323.5-324.9 vs 195.3-196.1, B=16 16k 78.4-78.7 vs 58.6-59.3.
# Measured and not taken: the block sums without products (p as [h, blocks, l'/d tokens] summed over its last axis:
# a token's own block; its overhang into the next block summed apart over the tokens whose span reaches it), both
# stored per tile interleaved ([h, blocks, 2]: 2 KB a tile instead of 1.1) and added by the scorer: exact fp32 sums,
# the same blocks. H100, graph-replayed, read flush, one workspace, six rounds, us: B=1 64k 26.1-26.5 vs 26.3-26.6,
# 128k 34.1-34.2 vs 34.4-34.7, B=4 43.0-43.5 vs 43.7-44.0, B=8 63.2-63.5 vs 63.5-64.0, but B=16 64k 105.9-106.4 vs
# 104.3-104.6, 128k 177.5-178.1 vs 173.5-174.0, B=32 201.8-202.6 vs 196.3-196.6: at large B the stores, not the
# products, are what the sums cost.


@triton.jit
def _grid_dependency(GDC: tl.constexpr):
    """Programmatic dependent launch (Hopper; ``PDL``): with GDC >= 1 the kernel was launched
    before the previous one finished and waits here until it has (and its writes are visible),
    so nothing it reads can be stale; with GDC = 2 it also lets the next kernel of the step be
    launched now (its programs then wait in turn); GDC = 3 lets it at the end of the program
    (``_grid_release``); GDC = 4 lets it before waiting (the top-n launch above
    EARLY_TRIGGER_ROWS, so that the window programs after it start while it runs:
    ``_partial_kernel``'s WIN_NOWAIT). Every kernel of a step waits before it reads what the
    launch before it wrote, so the order is that of plain stream launches (the non-waiting window
    programs, which read nothing those launches write, aside).

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
    keeps the normaliser per key lane, summed over the lanes once a program (``_partial_kernel``), not once
    a tile (a sum over the tile's keys crosses warps: a barrier a tile; H100, graph-replayed, read flush, one
    workspace, eight rounds, us, outputs within rounding: B=16 128k 166.4-167.3 vs 167.6-168.4, 64k 101.1-106.3
    vs 102.1-106.0, B=32 64k 189.9-190.4 vs 191.1-191.6, B=8 61.2-61.5 vs 62.0-62.4, B=1 128k 33.1-33.3 vs
    33.8-34.1; PTX barriers 39 -> 33 in the compressed kernel, 33 -> 27 in the window + selection one).
    qa [BH, BDA] / qb [BH, BDB]: the query's first BDA columns and the rest (d_k = 192 is 128 + 64:
    no tile padded to 256, so a program's K stages take 3/4 of the shared memory and more programs
    fit on an SM); kp/vp [BN] row pointers; valid [BN]. Returns the new state, and p = exp2(s − m)
    [BH, BN] with the running max m [BH] it is relative to (s: the tile's scores in log2 units;
    p = 0 where not valid). (v loaded before the scores, with k, so that a program of one tile makes one
    memory round trip rather than two, measured slower or the same: H100, graph-replayed, shared
    workspace, six rounds, us: in programs of one tile B=1 64k 27.5-28.7 vs 26.4-27.2, 16k 23.6-23.8 vs
    23.3-23.5, B=4 64k 43.8-44.2 vs 44.1-44.6; in every program B=16 64k 104.4-105.2 vs 104.0-104.5.)"""
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
               CMP_TILES: tl.constexpr, HALVINGS: tl.constexpr, C_CMP: tl.constexpr):
    """How the compressed launch splits the compressed tokens held at position t -> (n_cmp, V tiles of
    BNC tokens that hold them, T tiles a program, chunks in use = cdiv(V, T)). From t, not from the
    cache's capacity, so that a cache with room to grow is split as a full one of t + 1 tokens: the
    ``_tiles_per_chunk`` rule on V (T halved from CMP_TILES, the capacity's, while fewer programs than
    SMs would run), and T at least V / C_CMP, so that the launch's C_CMP chunks cover V. The chunks
    past those in use do nothing; the scorer and the merge read only those in use. BG: rows · KV heads."""
    # compressed token i is usable iff i·d + l − 1 <= t
    n_cmp = tl.where(t + 1 >= CMP_LEN, (t + 1 - CMP_LEN) // CMP_STRIDE + 1, 0)
    V = (n_cmp + BNC - 1) // BNC
    T = tl.full([], CMP_TILES, tl.int32)
    for _ in tl.static_range(HALVINGS):
        T = tl.where((T > 1) & ((V + T - 1) // T * BG < n_sm), T // 2, T)
    T = tl.maximum(T, (V + C_CMP - 1) // C_CMP)
    return n_cmp, V, T, (V + T - 1) // T


@triton.jit
def _partial_kernel(Q, K, V, KC, VC, IDX, POS, PM, PL, PACC, PCNT, BSUM, BMAX, KN, VN,
                    sqb, sqh, skb, skt, skg, svb, svt, svg, skcb, skct, skcg, svcb, svct, svcg, sib, sig,
                    scale_log2, c_lo, n_sm,
                    G: tl.constexpr, H_PER_G: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
                    CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, N_SEL: tl.constexpr,
                    C_CMP: tl.constexpr, C_WIN: tl.constexpr, NC: tl.constexpr,
                    CMP_TILES: tl.constexpr, WIN_TILES: tl.constexpr, SEL_TILES: tl.constexpr,
                    NT: tl.constexpr, TB: tl.constexpr, NBT: tl.constexpr, NBT_P: tl.constexpr,
                    DK: tl.constexpr, DV: tl.constexpr,
                    BH: tl.constexpr, BN: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr,
                    BDV: tl.constexpr, PREC: tl.constexpr, WANT_V: tl.constexpr, WRITE_SCORES: tl.constexpr,
                    STAGES: tl.constexpr, APPEND: tl.constexpr = False, GDC: tl.constexpr = 0, BPT: tl.constexpr = 1,
                    WIN_NOWAIT: tl.constexpr = False, SUM_RESHAPE: tl.constexpr = False,
                    HALVINGS: tl.constexpr = 0):
    bg = tl.program_id(0)
    c = tl.program_id(1) + c_lo
    if WIN_NOWAIT:
        # a window program reads nothing an earlier launch of this step writes (the new token's k/v it
        # takes from KN/VN, not from the cache the compressed launch appends to): it starts without
        # waiting, beside the top-n. The selection programs wait, so the launch after still finds
        # every earlier one finished
        if (c >= C_CMP) & (c < C_CMP + C_WIN):
            if GDC == 2:
                tl.extra.cuda.gdc_launch_dependents()
        else:
            _grid_dependency(GDC)
    else:
        _grid_dependency(GDC)
    # 64-bit: the cache strides fit in int32, row b's offset b · (T_max · G · d) may not (B=44 at 64k, B=32 at 128k)
    b = (bg // G).to(tl.int64)
    g = bg % G
    t = tl.load(POS + b)
    if APPEND:
        # the compressed launch also writes the new token's k/v (KN/VN [B, G, d], contiguous) at t, one
        # program per (row, KV head): it reads no raw token, and the window/selection launch after it does
        if c == c_lo:
            _append_row(K, V, KN, VN, b, g, t.to(tl.int64), skb, skt, skg, svb, svt, svg, G, DK, DV)
    rows = tl.arange(0, BH)
    offs_n = tl.arange(0, BN)
    offs_dv = tl.arange(0, BDV)
    qa, qb = load_dk(Q + b * sqb + (g * H_PER_G + rows) * sqh, rows < H_PER_G, DK, BDA, BDB)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH, BN], tl.float32)                             # per key lane (``_tile``)
    acc = tl.zeros([BH, BDV], tl.float32)
    # tokens read, lane by lane: summed once after the tile loop, not per tile (a sum over the tile's lanes
    # crosses warps: a barrier a tile. H100, graph-replayed, read flush, one workspace, ten rounds, us, outputs
    # bit-identical, vs per tile: B=16 64k median 102.1 vs 102.8 (101.8-102.3 and one 105.8, vs 102.4-103.1), 128k
    # 168.0-168.4 vs 169.1-169.6; six rounds: B=32 64k 191.1-191.8 vs 192.2-193.0, B=8 62.0-62.3 vs 62.6-63.0, 16k
    # 57.6-57.9 vs 58.2-59.0, B=1 and B=4 the same within 0.4; PTX barriers 43 -> 39 (compressed), 36 -> 33)
    cnt = tl.zeros([BN], tl.int32)
    if c < C_CMP:
        # this program's tiles: [c·T, min(c·T + T, held)) of the tiles that hold tokens, none past them
        n_cmp, held, T, _ = _cmp_split(t, tl.num_programs(0), n_sm, CMP_LEN, CMP_STRIDE, BN, CMP_TILES, HALVINGS, C_CMP)
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
        for i in tl.range(0, n_t, num_stages=STAGES):
            ti = first + i
            kpos = ti * BN + offs_n
            valid = kpos < n_cmp
            kp = KC + b * skcb + kpos.to(tl.int64) * skct + g * skcg
            vp = VC + b * svcb + kpos.to(tl.int64) * svct + g * svcg
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
                    # 0/1. Three bf16 products of p's exact bf16 split, sharing the first with p·v, measured no
                    # better on the H100: step B=16 64k 120.9-121.3 vs 121.5-122.1 us, but B=1 128k 43.5 vs
                    # 42.1-42.2.)
                    p_hi = (p.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                    bsum = tl.dot(p_hi, over, input_precision="tf32") + tl.dot(p - p_hi, over, input_precision="tf32")
                    tl.store(BSUM + at[:, None] * NBT + jj[None, :], bsum, mask=jj[None, :] < NBT,
                             eviction_policy="evict_last")
                tl.store(BMAX + at, m_run, eviction_policy="evict_last")
            cnt += valid.to(tl.int32)
    elif c < C_CMP + C_WIN:
        lo = tl.maximum(t - WINDOW + 1, 0)
        for ti in tl.range(WIN_TILES, num_stages=STAGES):
            kpos = lo + ((c - C_CMP) * WIN_TILES + ti) * BN + offs_n
            valid = kpos <= t
            kp = K + b * skb + kpos.to(tl.int64) * skt + g * skg
            vp = V + b * svb + kpos.to(tl.int64) * svt + g * svg
            if WIN_NOWAIT:
                # token t's k/v from the new token's buffer, so that no read depends on this step's append.
                # (By the chain in ``_grid_dependency`` the compressed launch has finished when this launch
                # starts, but this program never waits to be shown its writes.)
                kp = tl.where(kpos == t, KN + (b * G + g) * DK, kp)
                vp = tl.where(kpos == t, VN + (b * G + g) * DV, vp)
            m_i, l_i, acc, _, _ = _tile(qa, qb, kp, vp, valid, m_i, l_i, acc, scale_log2, offs_dv,
                                        DK, DV, BDA, BDB, PREC, True)
            cnt += valid.to(tl.int32)
    else:
        # (loading the chunk's block numbers as one vector before the loop, so that no K/V address waits
        # on a load inside it, measured the same on the H100: 27.8 vs 28.4 µs at B=16, 64k)
        for ti in tl.range(SEL_TILES, num_stages=STAGES):
            # Two forms: one block a tile loads its block number once (a scalar); the general form, written for
            # both, loads it per row and was ~1 us slower at B=16 64k on the H100 (106.6-108.3 vs 105.8-107.0,
            # four rounds, outputs bit-identical; B=1 and 128k the same)
            if BPT == 1:
                slot = (c - C_CMP - C_WIN) * SEL_TILES + ti
                j = tl.load(IDX + b * sib + g * sig + tl.minimum(slot, N_SEL - 1))
                kpos = j * BLOCK + offs_n
                # j = −1 (an unused slot) <=> kpos < offs_n; slot >= n: past a ragged last chunk.
                # (Written on vectors: the interpreter mistypes masks built from loaded scalars.)
                valid = (offs_n < BLOCK) & (kpos >= offs_n) & (kpos <= t) & (offs_n + slot < offs_n + N_SEL)
            else:
                # BPT blocks a tile (BN = BPT · l'): row r of the tile is token r mod l' of slot r // l'
                slot = ((c - C_CMP - C_WIN) * SEL_TILES + ti) * BPT + offs_n // BLOCK
                j = tl.load(IDX + b * sib + g * sig + tl.minimum(slot, N_SEL - 1))
                kpos = j * BLOCK + offs_n % BLOCK
                valid = (j >= 0) & (kpos <= t) & (slot < N_SEL)
            kp = K + b * skb + kpos.to(tl.int64) * skt + g * skg
            vp = V + b * svb + kpos.to(tl.int64) * svt + g * svg
            m_i, l_i, acc, _, _ = _tile(qa, qb, kp, vp, valid, m_i, l_i, acc, scale_log2, offs_dv,
                                        DK, DV, BDA, BDB, PREC, True)
            cnt += valid.to(tl.int32)
    _grid_release(GDC)
    out = (bg * NC + c).to(tl.int64)
    tl.store(PM + out * BH + rows, m_i)
    tl.store(PL + out * BH + rows, tl.sum(l_i, 1))
    if WANT_V:
        tl.store(PACC + (out * BH + rows)[:, None] * BDV + offs_dv[None, :], acc)
    tl.store(PCNT + out, tl.sum(cnt, 0))


@triton.jit
def _scores_kernel(PM, PL, BSUM, BMAX, SCORE, POS, n_sm,
                   G: tl.constexpr, H_PER_G: tl.constexpr, BH: tl.constexpr, C_CMP: tl.constexpr,
                   CP: tl.constexpr, NC: tl.constexpr, NT: tl.constexpr, TB: tl.constexpr, NBT: tl.constexpr,
                   NBP: tl.constexpr, BJ: tl.constexpr, OVT: tl.constexpr, BLOCK: tl.constexpr,
                   CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, BNC: tl.constexpr, CMP_TILES: tl.constexpr,
                   HALVINGS: tl.constexpr, GDC: tl.constexpr = 0, IDLE_EXIT: tl.constexpr = False):
    """Selection-block scores of blocks [pid1·BJ, (pid1+1)·BJ) of one (row · KV head) -> SCORE [BG, NBP],
    for the blocks up to the new token's (the top-n ranks no other; a program past them does nothing)."""
    bg = tl.program_id(0)
    # the position is written by work that ended two launches back or more (``_grid_dependency``): read
    # while the compressed launch finishes
    t = tl.load(POS + bg // G)
    if IDLE_EXIT:
        # past the new token's block (a cache with room to grow): done before waiting, so that such programs
        # free their slots while the compressed launch still runs. Only under the late trigger: at few rows
        # (GDC 2) this branch made the step slower even where no program takes it (docs/decisions.md)
        if tl.program_id(1) * BJ > t // BLOCK:
            return
    _grid_dependency(GDC)
    j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    # a program past the new token's block loads nothing and stores nothing (masks, not a branch: a
    # branch around the body made the step 4 us slower at B=1, docs/decisions.md)
    live = tl.program_id(1) * BJ <= t // BLOCK
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
            ok = (tau >= 0) & (tau < held) & (local < NBT) & live
            at = (bg * NT + tau).to(tl.int64) * BH + hh
            mt = tl.load(BMAX + at, mask=ok, other=0.0)
            bs = tl.load(BSUM + at * NBT + local, mask=ok, other=0.0)
            score += bs * tl.exp2(mt - m_h) * inv_h
    tl.store(SCORE + bg * NBP + j, score, mask=live)
    _grid_release(GDC)


@triton.jit
def _topn_keys(SCORE, bg, cur, j0, NBP: tl.constexpr, CH: tl.constexpr, KP: tl.constexpr):
    """The best KP keys, best first, among the free causal blocks j0..j0+CH−1 of SCORE's row bg (cur:
    the new token's block). A key: high word the score's bits mapped so that integers order as the
    floats do (negatives' magnitude bits flipped, −0 taken as +0, NaN as −inf), low word 2^31 − 1 − j,
    so that equal scores go to the lower block (``ranks_before``'s order); no free block: the least int64."""
    BIG: tl.constexpr = 2147483647
    NONE: tl.constexpr = -9223372036854775807 - 1
    j = j0 + tl.arange(0, CH)
    score = tl.load(SCORE + bg * NBP + j, mask=(j <= cur) & (j < NBP), other=0.0)
    # a NaN score (from inputs that overflow) ranks lowest: every free block's key stays above NONE, so
    # the picks are always real blocks, never an empty key's (block 2^31 − 1)
    score = tl.where(score == score, score, float("-inf"))
    free = (j <= cur) & (j != 0) & (j != cur) & (j != cur - 1)          # causal and not forced
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    bits = bits ^ ((bits >> 31) & BIG)
    return tl.topk(tl.where(free, block_key(bits, j), NONE), KP)


@triton.jit
def _topn_chunks(SCORE, bg, cur, NBP: tl.constexpr, CH: tl.constexpr, KP: tl.constexpr):
    """The best KP keys among the free causal blocks 0..cur of row bg, CH blocks at a time."""
    top = tl.full([KP], -9223372036854775807 - 1, tl.int64)
    for j0 in tl.range(0, cur + 1, CH):
        key = _topn_keys(SCORE, bg, cur, j0, NBP, CH, KP)
        if j0 == 0:
            top = key
        else:
            top = tl.topk(tl.reshape(tl.join(top, key), [2 * KP]), KP)
    return top


@triton.jit
def _topn_kernel(SCORE, POS, IDX, sib, sig, G: tl.constexpr, BLOCK: tl.constexpr, N_SEL: tl.constexpr,
                 NSP: tl.constexpr, NBP: tl.constexpr, CH: tl.constexpr, GDC: tl.constexpr = 0,
                 HALF: tl.constexpr = False):
    """Top-n blocks of one (row · KV head): forced block 0 and the two local blocks, then the highest
    scores among the other causal blocks (``_topn_keys``), ties to the lower index; written ascending,
    −1 padded. The causal blocks 0..t//l' are ranked CH at a time, a bitonic top-KP (``tl.topk``) of each
    chunk, kept with the best so far by a top-KP of the 2·KP: a cache with room to grow ranks only the
    chunks its tokens reach. The picks and the forced blocks (the distinct ones) are then sorted
    ascending, a sort of 2·KP."""
    # the position is written by work that ended two launches back or more (``_grid_dependency``)
    b = tl.program_id(0) // G
    t = tl.load(POS + b)
    _grid_dependency(GDC)
    bg = tl.program_id(0)
    g = bg % G
    cur = t // BLOCK
    KP: tl.constexpr = NSP if NSP < CH else CH          # CH < NSP only where it is all the blocks
    n_take = tl.minimum(cur + 1, N_SEL)
    BIG: tl.constexpr = 2147483647
    if HALF:
        # a cache with room to grow: while the causal blocks fit in half a chunk, a top-k of half the size
        # (the chunk is the capacity's where it holds fewer than TOPN_CHUNK blocks)
        if cur < CH // 2:
            top = _topn_keys(SCORE, bg, cur, 0, NBP, CH // 2, KP)
        else:
            top = _topn_chunks(SCORE, bg, cur, NBP, CH, KP)
    else:
        top = _topn_chunks(SCORE, bg, cur, NBP, CH, KP)
    n_forced = 1 + (cur >= 1).to(tl.int32) + (cur >= 2).to(tl.int32)
    s = tl.arange(0, KP)
    # there are at least n_take − n_forced free causal blocks: every pick below is a real block
    pick = tl.where(s < n_take - n_forced, BIG - (top & BIG).to(tl.int32), BIG)
    forced = tl.where(s == 0, 0, tl.where(((s == 1) & (cur >= 2)) | ((s == 2) & (cur >= 1)), cur - 2 + s, BIG))
    blocks = tl.sort(tl.reshape(tl.join(pick, forced), [2 * KP]), 0)     # ascending, BIG last
    _grid_release(GDC)
    dst = IDX + b * sib + g * sig
    r = tl.arange(0, 2 * KP)
    tl.store(dst + r, tl.where(r < n_take, blocks, -1), mask=r < N_SEL)
    if 2 * KP < N_SEL:          # a cache of fewer than n/2 blocks: the slots past the sort's are unused
        r2 = tl.arange(0, NSP)
        tl.store(dst + r2, tl.full([NSP], -1, tl.int32), mask=(r2 >= 2 * KP) & (r2 < N_SEL))


@triton.jit
def _merge_load(PM, PL, PACC, PCNT, bg, rows, offs_dv, lo: tl.constexpr, hi, CP: tl.constexpr,
                NC: tl.constexpr, BH: tl.constexpr, BDV: tl.constexpr):
    """Chunks [lo, hi) of one (row · KV head), d_v columns offs_dv [BDV_S]: (m [CP, BH], l [CP, BH],
    acc [CP, BH, BDV_S], tokens read), all loaded at once. CP: at least hi − lo, a power of two."""
    ch = lo + tl.arange(0, CP)
    ok = ch < hi
    out = (bg * NC + ch).to(tl.int64)
    part = out[:, None] * BH + rows[None, :]                           # [CP, BH]
    pm = tl.load(PM + part, mask=ok[:, None], other=float("-inf"))
    pl = tl.load(PL + part, mask=ok[:, None], other=0.0)
    acc = tl.load(PACC + part[:, :, None] * BDV + offs_dv[None, None, :], mask=ok[:, None, None], other=0.0)
    return pm, pl, acc, tl.sum(tl.load(PCNT + out, mask=ok, other=0), 0)


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
def _merge_kernel(PM, PL, PACC, PCNT, GATE, OUT, MIX, READS, B, POS, n_sm,
                  G: tl.constexpr, H_PER_G: tl.constexpr, DV: tl.constexpr, C_CMP: tl.constexpr,
                  C_WIN: tl.constexpr, NC: tl.constexpr, CP_CMP: tl.constexpr, CP_WIN: tl.constexpr,
                  CP_SEL: tl.constexpr, BH: tl.constexpr, BDV: tl.constexpr, BDV_S: tl.constexpr,
                  DO_CMP: tl.constexpr, DO_SEL: tl.constexpr, DO_WIN: tl.constexpr, HAS_GATE: tl.constexpr,
                  CMP_LEN: tl.constexpr, CMP_STRIDE: tl.constexpr, BNC: tl.constexpr, CMP_TILES: tl.constexpr,
                  HALVINGS: tl.constexpr, GDC: tl.constexpr = 0, CMP_EARLY: tl.constexpr = False,
                  CMP_MERGE_EARLY: tl.constexpr = False):
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
    # the one before (the compiler cannot move a load above a store). H100, 64k, eager kernel time:
    # B=1 6.1 vs 6.9 µs, B=16 4.0-4.1 vs 4.5-4.7 µs. (The compressed partials' maxima and sums first,
    # then their accumulators 4-32 chunks at a time, instead of all 256 at once at B=1: 6.5 vs 6.0 µs;
    # graph-replayed step 64k B=1 23.0-25.4 vs 23.2 µs, B=16 110.7-111.6 vs 109.6.)
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
        m_c, l_c, a_c, n_c = _merge_load(PM, PL, PACC, PCNT, bg, rows, offs_dv, 0, n_ch, CP_CMP, NC, BH, BDV)
        g_c = _gate_col(GATE, row, 0, head_ok, HAS_GATE)
        if CMP_MERGE_EARLY:
            # merged and stored before the wait as well: no launch of the step before this one reads what it writes
            mix = _merge_store(m_c, l_c, a_c, n_c, 0, out, reads, plane, B * G, ok, first, g_c, mix, HAS_GATE)
    if CMP_EARLY:
        _grid_dependency(GDC)
    if DO_SEL:
        m_s, l_s, a_s, n_s = _merge_load(PM, PL, PACC, PCNT, bg, rows, offs_dv, C_CMP + C_WIN, NC, CP_SEL, NC, BH,
                                         BDV)
        g_s = _gate_col(GATE, row, 1, head_ok, HAS_GATE)
    if DO_WIN:
        m_w, l_w, a_w, n_w = _merge_load(PM, PL, PACC, PCNT, bg, rows, offs_dv, C_CMP, C_CMP + C_WIN, CP_WIN, NC,
                                         BH, BDV)
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
def _gdc(device, rows: int) -> int:
    """The kernels' GDC mode (``_grid_dependency``) for a step over ``rows`` = B·G: 0 where
    programmatic dependent launch does not exist (before sm90, the CPU) or ``PDL`` is off; the
    early trigger (2) up to ``EARLY_TRIGGER_ROWS``, the late one (3) above."""
    dev = torch.device(device)
    if not PDL or dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (9, 0):
        return 0
    return 2 if rows <= EARLY_TRIGGER_ROWS else 3


def _launch_shape(rows: int) -> tuple[int, int]:
    """(warps of a scoring program, d_v columns of a merge program) for a step over ``rows`` = B·G:
    fewer, wider programs for few rows. H100, paper config, 64k, graph-replayed step (us), scoring
    warps 4 / 2 / 1: B·G 4: 33.7-33.9 / 34.5-34.6 / 34.9-35.1; 16: 58.1 / 57.9-58.2 / 59.4-59.5;
    64: 128.5-128.9 / 126.0-126.9 / 125.7-126.1 (128k: 200.2-200.6 / 197.2-197.6 / 195.9-196.9);
    merge columns 8 / 16: B·G 4: 33.7-33.9 / 34.8-34.9; 16: 58.1 / 57.1-57.2; 64: 128.5-128.9 /
    127.5-128.0 (128k: 200.2-200.6 / 199.7-200.0). (Scoring programs of 32 or 128 blocks instead
    of 64, or 16 with 1 warp, were no faster at any B; merge programs of 4 columns or of 8 warps
    gained under 1 us where they gained: B·G 4 31.6 (8 columns, 8 warps) vs 32.1-32.2 us, at 128k
    40.0-40.3 (4 columns) vs 41.0; B·G 16 51.7-51.9 (16, 8 warps) vs 52.2; none at B·G 64.)"""
    return (4 if rows <= 4 else 2 if rows <= 16 else 1), (8 if rows < 16 else 16)


def _tiles_per_chunk(tile_counts: tuple[int, ...], programs_per_chunk: int, n_sm: int) -> int:
    """Tiles one program walks (a power of two, at most MAX_TILES): as many as keep at least one
    program per SM in the launch (fewer chunks: fewer partials written and merged; an H100 sweep at
    B=16, 64k, d_k split 128 + 64: at most 16 tiles 0.1315 ms, 8 tiles 0.1342 ms; before the split,
    8 tiles 0.1381 ms, 4 tiles 0.1475 ms; for the window + selection launch, graph-replayed step at
    B=16 / 4 / 1 with 8 / 2 / 1 tiles (the choice) 128.1-129.6 / 58.2-58.4 / 34.3-34.4 us, with 4
    tiles 130.1 / 59.4 / 38.7, 2 tiles 134.8 at B=16, and 1 stage instead of 2, for more programs per
    SM, 136.7-140.2 / 58.9-75.9 / 34.5-54.2; uneven splits, window / selection tiles 8 / 6, 8 / 5,
    6 / 6, 4 / 6, no faster at B=16: 124.7-130.3 vs 125.3-125.6 us at 64k). Fewer programs than
    SMs, for fewer partials to score and merge at small B, was slower (H100, 64k, graph-replayed
    step: B=1 37.2 / 41.5 / 76.3 us with half / a quarter / an eighth as many vs 35.5 us; B=4 64.6
    vs 58.6 us). Also measured and not taken: window + selection programs of equal length, a row's
    8 window tiles and 16 selected blocks as one list (a program's tiles running from the window into
    the selection, an online softmax per branch, a partial per branch it holds), as many programs as
    fill one wave of 2 per SM: at B=16, 64k 4 programs of 6 tiles per row (256) instead of 3 of at
    most 8 (192). H100, `suite decode -k test_bench`, two rounds alternating with this code: B=16 64k
    112.4 / 112.4 vs 111.0 / 110.9 us (the window alone 25.0-25.1 vs 26.4-26.6, the selection alone
    86.8-87.0 vs 87.8), B=1 31.3-31.4 vs 31.9-32.0 (the same 1-tile programs there). Nsight Compute on that
    launch (B=16, 64k) shows its programs latency-bound on instructions, not on DRAM: 1.5 programs per SM (two fit),
    a warp issuing every 8 cycles, 82% of scheduler cycles with no eligible warp, 56% of DRAM peak. More programs per
    SM were slower still (H100, graph-replayed, read flush, B=16 64k, vs 105.8-106.9 us with 2 stages, 4 warps, 8
    tiles): 1 stage (4, 3, 2 or 8 tiles) 112.5-118.2; 1 stage with registers capped at 128 (4 programs per SM)
    110.5-114.7; 2 stages, 4 tiles 109.4-109.9; 2 warps 109.8-113.2; at 128k B=16 175.0-185.4 vs 174.0-174.1."""
    t = min(MAX_TILES, triton.next_power_of_2(max(tile_counts)))
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

    @property
    def NC(self) -> int:
        return self.C_CMP + self.C_WIN + self.C_SEL

    @property
    def n_tiles(self) -> int:
        """Tiles of BNC compressed tokens the compressed partials cover."""
        return self.C_CMP * self.cmp_tiles


def plan(cfg: NSAConfig, B: int, t_max: int, n_max: int, device) -> Plan:
    G, h = cfg.n_kv_heads, cfg.heads_per_group
    BN1 = max(16, triton.next_power_of_2(cfg.block_size))
    lo, hi = TWO_BLOCK_TILES
    bpt = 2 if BN1 == cfg.block_size and lo <= B * G <= hi else 1    # selection blocks per window/selection tile
    BN = BN1 * bpt
    # a compressed tile must start on a selection-block boundary (its block sums cover whole blocks)
    BNC = CMP_TILE if CMP_TILE * cfg.cmp_stride % cfg.block_size == 0 else BN1
    n_sm = sm_count(device)
    cmp_t, win_t, sel_t = triton.cdiv(max(n_max, 1), BNC), triton.cdiv(cfg.window, BN), triton.cdiv(cfg.n_selected, bpt)
    ct = _tiles_per_chunk((cmp_t,), B * G, n_sm)
    wt = st = _tiles_per_chunk((win_t, sel_t), B * G, n_sm)             # one launch runs both
    tb = BNC * cfg.cmp_stride // cfg.block_size
    nbt = ((BNC - 1) * cfg.cmp_stride + cfg.cmp_len - 1) // cfg.block_size + 1
    BDA, BDB = head_dim_parts(cfg.d_k)
    r = cfg.block_size // cfg.cmp_stride            # compressed tokens starting in one block
    by_reshape = (SUMS_BY_RESHAPE and cfg.block_size % cfg.cmp_stride == 0 and r & (r - 1) == 0 and BNC == tb * r
                  and nbt == tb + 1)
    return Plan(B, G, h, cfg.d_k, cfg.d_v, n_max, cfg.n_selected,
                triton.next_power_of_2(triton.cdiv(t_max, cfg.block_size)), BN, BNC,
                max(16, triton.next_power_of_2(h)), BDA, BDB, max(16, triton.next_power_of_2(cfg.d_v)),
                ct, wt, st, triton.cdiv(cmp_t, ct), triton.cdiv(win_t, wt), triton.cdiv(sel_t, st),
                tb, nbt, max(16, triton.next_power_of_2(nbt)), bpt, by_reshape, _gdc(device, B * G),
                *_launch_shape(B * G), n_sm)


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
        self.score = torch.empty(BG, p.nbp, **f32)
        self.out = torch.zeros(3, p.B, p.G * p.h, p.d_v, device=device, dtype=dtype)
        self.mix = torch.zeros(p.B, p.G * p.h, p.d_v, device=device, dtype=dtype)
        self.reads = torch.zeros(3, p.B, p.G, device=device, dtype=torch.int32)



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
    p = p or plan(cfg, B, k.shape[1], k_cmp.shape[1], q.device)
    ws = ws or Workspace(p, q.dtype, q.device)
    want = set(branches)
    pdl = dict(GDC=p.gdc, launch_pdl=p.gdc > 0)
    # how the compressed launch splits the tokens held (``_cmp_split``): its kernel, the scorer and the merge agree
    split = dict(CMP_LEN=cfg.cmp_len, CMP_STRIDE=cfg.cmp_stride, CMP_TILES=p.cmp_tiles,
                 HALVINGS=p.cmp_tiles.bit_length() - 1, C_CMP=p.C_CMP)
    common = dict(G=p.G, H_PER_G=p.h, BLOCK=cfg.block_size, WINDOW=cfg.window, N_SEL=cfg.n_selected, C_WIN=p.C_WIN,
                  NC=p.NC, WIN_TILES=p.win_tiles, SEL_TILES=p.sel_tiles, **split,
                  NT=p.n_tiles, TB=p.tb, NBT=p.nbt, NBT_P=p.nbt_p,
                  DK=p.d_k, DV=p.d_v, BH=p.BH, BDA=p.BDA, BDB=p.BDB, BDV=p.BDV,
                  PREC=precision(q.dtype), STAGES=PARTIAL_STAGES,
                  num_warps=PARTIAL_WARPS, **pdl)
    fused = append is not None and bool(want & {"cmp", "sel"})
    # The window programs start without waiting (WIN_NOWAIT) where the append is this step's (their token t from
    # the new token's buffer, of the cache's dtype) and selection programs of the same launch wait: the merge after
    # it reads the compressed partials before its own wait (CMP_EARLY). Only then does the top-n, above
    # EARLY_TRIGGER_ROWS, let that launch go before its own wait (GDC 4): otherwise its programs would only sit waiting.
    nowait = (WIN_NOWAIT and p.gdc > 0 and fused and "sel" in want and "win" in want
              and append[0].dtype == k.dtype and append[1].dtype == v.dtype)
    topn_pdl = dict(pdl, GDC=4 if nowait and p.gdc == 3 else p.gdc)
    if append is not None and not fused:
        append_token(k, v, *append, pos, cfg, p.gdc)
    kn, vn = (a.contiguous() for a in append) if fused else (q, q)
    args = (q, k, v, k_cmp, v_cmp, ws.idx, pos, ws.pm, ws.pl, ws.pacc, ws.pcnt, ws.bsum, ws.bmax, kn, vn,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1),
            v_cmp.stride(2), ws.idx.stride(0), ws.idx.stride(1), cfg.scale * LOG2E)
    n_sm = p.n_sm
    BG = B * p.G
    if want & {"cmp", "sel"}:
        _partial_kernel[(BG, p.C_CMP)](*args, 0, n_sm, BN=p.BNC, WANT_V="cmp" in want, WRITE_SCORES="sel" in want,
                                      APPEND=fused, SUM_RESHAPE=p.sums_by_reshape, **common)
    if "sel" in want:
        NBP = p.nbp
        BJ = min(NBP, SCORE_BLOCKS)
        _scores_kernel[(BG, NBP // BJ)](ws.pm, ws.pl, ws.bsum, ws.bmax, ws.score, pos, n_sm, G=p.G, H_PER_G=p.h,
                                        BH=p.BH, CP=triton.next_power_of_2(p.C_CMP), NC=p.NC,
                                        NT=p.n_tiles, TB=p.tb, NBT=p.nbt, NBP=NBP, BJ=BJ, BLOCK=cfg.block_size,
                                        BNC=p.BNC, OVT=triton.cdiv(p.nbt, p.tb), num_warps=p.score_warps, **split,
                                        IDLE_EXIT=p.gdc == 3, **pdl)
        top_n(ws.score, pos, ws.idx, cfg, **topn_pdl)
    lo = p.C_CMP if "win" in want else p.C_CMP + p.C_WIN
    hi = p.NC if "sel" in want else p.C_CMP + p.C_WIN
    if want & {"win", "sel"}:
        _partial_kernel[(BG, hi - lo)](*args, lo, n_sm, BN=p.BN, WANT_V=True, WRITE_SCORES=False, BPT=p.bpt,
                                       WIN_NOWAIT=nowait, **common)
    BDV_S = min(p.BDV, p.merge_cols)
    cmp_early = CMP_EARLY and "cmp" in want and bool(want & {"sel", "win"})
    _merge_kernel[(BG, p.BDV // BDV_S)](ws.pm, ws.pl, ws.pacc, ws.pcnt, gate if gate is not None else ws.mix, ws.out,
                         ws.mix, ws.reads, B, pos, n_sm, G=p.G, H_PER_G=p.h, DV=p.d_v, C_WIN=p.C_WIN, NC=p.NC,
                         CP_CMP=triton.next_power_of_2(p.C_CMP), CP_WIN=triton.next_power_of_2(p.C_WIN),
                         CP_SEL=triton.next_power_of_2(p.C_SEL), BH=p.BH, BDV=p.BDV, BDV_S=BDV_S,
                         DO_CMP="cmp" in want, DO_SEL="sel" in want, DO_WIN="win" in want,
                         HAS_GATE=gate is not None, num_warps=MERGE_WARPS,
                         BNC=p.BNC, CMP_EARLY=cmp_early, CMP_MERGE_EARLY=cmp_early and p.gdc != 3, **split, **pdl)
    for br in branches:
        dispatch.note(phase, br, "triton")
    i = {br: BRANCHES.index(br) for br in branches}
    return StepOut({br: ws.out[n] for br, n in i.items()}, {br: ws.reads[n] for br, n in i.items()},
                   ws.idx if "sel" in want else None, ws.mix if gate is not None else None)


def top_n(score, pos, idx, cfg: NSAConfig, *, GDC: int = 0, launch_pdl: bool = False) -> None:
    """The step's top-n (``_topn_kernel``): score [B·G, NBP] fp32 block scores (NBP a power of two),
    pos [B] int32 -> idx [B, G, n] int32, the blocks selected for the token at pos, ascending, −1 padded."""
    BG, NBP = score.shape
    nsp = triton.next_power_of_2(cfg.n_selected)
    # at least 4 lanes (NSP >= 4 as n >= 3): the forced blocks' 3 slots sit beside the picks; a chunk holds n picks
    ch = min(max(NBP, 4), max(TOPN_CHUNK, nsp))
    _topn_kernel[(BG,)](score, pos, idx, idx.stride(0), idx.stride(1), G=idx.shape[1], BLOCK=cfg.block_size,
                        N_SEL=cfg.n_selected, NSP=nsp, NBP=NBP, CH=ch,
                        num_warps=SELECT_WARPS, GDC=GDC, launch_pdl=launch_pdl, HALF=ch // 2 > nsp)


class DecodeStep:
    """A CUDA-graph-capturable decode step over a preallocated cache ``cache`` (nsa_core.DecodeCache):
    write the new token's k/v at position pos, then ``decode_attention``. Buffers are allocated
    here, once; a call allocates nothing and never syncs with the host.

    call: q [B, H, d_k], k_new [B, G, d_k], v_new [B, G, d_v] (None: already in the cache), pos
    [B] int32 (device), gate [B, H, 3] or None -> StepOut (views into this step's workspace,
    overwritten by the next call). The compressed cache is updated by the caller when a span
    completes (once every d steps; ``NSAAttention.decode`` does it).

    ``held_by_cache``: the step is kept in ``cache.kernel_state`` (``kernels.routes``), and then holds
    the cache weakly, so that a cache dropped is freed at once with its steps and their CUDA graph
    rather than by Python's cyclic collector later, at any allocation: in the middle of a CUDA-graph
    capture, freeing a graph invalidates the capture (``nsa_core.cuda_graph``)."""

    def __init__(self, cfg: NSAConfig, cache, branches=BRANCHES, *, held_by_cache: bool = False) -> None:
        self.cfg, self.branches = cfg, tuple(branches)
        self._cache = weakref.ref(cache) if held_by_cache else lambda: cache
        B = cache.k.shape[0]
        self.plan = plan(cfg, B, cache.k.shape[1], cache.k_cmp.shape[1], cache.k.device)
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


def launch_floor(device, rows: int, launches: int = len(LAUNCHES)):
    """A callable that launches ``launches`` kernels of one program doing nothing, chained as a
    step over ``rows`` = B·G chains its own (programmatic dependent launch where the step has it).
    Timed as the step is, it is a floor under any step of that many launches: the decode bench
    reports it beside the step (``floor_ms``). H100, graph replays after the bench's read flush: one
    launch 4.6-5.3 us, five 8.6-9.4 (10.9-12.1 without programmatic dependent launch)."""
    gdc = 2 if _gdc(device, rows) else 0
    x = torch.zeros(1, dtype=torch.int32, device=device)

    def run():
        for _ in range(launches):
            _empty_kernel[(1,)](x, GDC=gdc, launch_pdl=gdc > 0, num_warps=1)
    return run
