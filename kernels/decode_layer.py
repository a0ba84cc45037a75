"""The whole NSA layer's decode step on the Triton kernels, with nothing the host must compute.

``NSAAttention.decode`` on the torch route appends on the host, runs φ only when a compressed span
completes (an ``if`` on a host integer) and mixes the branches in torch. ``LayerDecodeStep`` does
the same work as device operations of fixed shapes, so a whole layer step (projections, append,
φ, gate, attention, gated mix, output projection) can be captured in a CUDA graph; it is what
``NSAAttention.decode`` runs on the Triton route (one per cache, ``kernels.routes.decode_layer``):

* the position lives on the device (``next_t`` [B] int32, advanced by the step itself, with the
  cache's ``pos``, in one launch: ``_advance_kernel``);
* the step's small MLPs run in two launches: ``_fc1_kernel`` computes fc1 of the gate (from x) and of
  φ for k and v (over the l tokens ending at t), split over K-chunks, as fp32 partial sums;
  ``_fc2_kernel`` adds them up with the bias and applies silu and fc2 (and the gate's sigmoid). φ runs
  every step: its fc1 programs gather the span from the cache, token t from the new token's own row
  (it is not in the cache yet), plus the intra-block position embedding (the prefill's φ folds it
  into fc1's bias instead, which saves it a pass over all the spans; here the gather adds it for
  free; both forms are checked against the oracle), and its fc2 programs write compressed slot
  (t+1−l)/d only where token t completes that span: a fixed set of launches instead of a
  data-dependent branch, so the step can be captured. (φ = mean: the gather, a torch mean and
  ``_store_kernel``; the two launches then hold the gate alone.) What these launches replaced and
  measured: ``docs/decisions.md``;
* the three branches and the gate mix run in ``kernels.decode.DecodeStep``, whose first launch
  appends the new token to the cache, as in the attention step the decode bench times.

Shapes: x [B, 1, D] -> out [B, 1, D]. The cache's host ``length`` is advanced by ``__call__`` (where the
host counts: not once the step was recorded into a caller's CUDA graph, ``record``).
"""
from __future__ import annotations

import time
import weakref

import torch
import triton
import triton.language as tl

from kernels.common import fp32_compiled, precision
from kernels.decode import DecodeStep, StepOut, horizon
from nsa_core import dispatch
from nsa_core.cuda_graph import capturing
from nsa_core.module import StepInfo

# fc1 of the step's small MLPs (φ for k and v, the gate): inputs per program (a K-chunk), per product, and columns
# per program; warps of an fc2 program (which takes BJ = 32 outputs). The fastest of the settings swept on an H100
# (docs/decisions.md)
MLP_BK, MLP_KC, MLP_BN = 128, 128, 64
# inputs per product in fp32 where compiled (``fp32_compiled``): 128 spilled 3.9 KB a thread (sm90, Triton 3.6, the
# counters suite's fp32 paper-config step), 32 none; the interpreter keeps MLP_KC (fewer steps there)
MLP_KC_FP32 = 32
FC2_WARPS = 4


@triton.jit
def _span_rows(X, SRC, NEW, b, g, t, sb, st, G: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
               BL: tl.constexpr, BD: tl.constexpr):
    i = tl.arange(0, BL)
    rows = tl.maximum(t - L + 1 + i, 0)
    cols = tl.arange(0, BD)
    ok = (i < L)[:, None] & (cols < D)[None, :]
    # token t is not in the cache yet (the attention step's first launch appends it): from the new token's row
    x = tl.load(SRC + b * sb + rows[:, None] * st + g * D + cols[None, :], mask=ok & (rows < t)[:, None], other=0.0)
    x += tl.load(NEW + (b * G + g) * D + cols[None, :] + rows[:, None] * 0, mask=ok & (rows == t)[:, None], other=0.0)
    tl.store(X + (b * G + g) * L * D + i[:, None] * D + cols[None, :], x.to(X.dtype.element_ty), mask=ok)


@triton.jit
def _span_kernel(K, V, KN, VN, T, XK, XV, skb, skt, svb, svt,
                 G: tl.constexpr, L: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BL: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr):
    """Program (b, g): rows t−L+1 .. t of k and v (clamped at 0: such a span is never stored; row t
    from the new token's KN [B, G, d_k] / VN [B, G, d_v]) for KV head g -> XK[b, g] = [L·d_k]
    (row-major over (l, d)), XV likewise (φ = mean)."""
    b, g = tl.program_id(0).to(tl.int64), tl.program_id(1)    # 64-bit: b · (T_max · G · d) may pass 2^31
    t = tl.load(T + b).to(tl.int64)
    _span_rows(XK, K, KN, b, g, t, skb, skt, G, L, DK, BL, BDK)
    _span_rows(XV, V, VN, b, g, t, svb, svt, G, L, DV, BL, BDV)


@triton.jit
def _store_row(Y, C, b, g, start, sb, sn, G: tl.constexpr, STRIDE: tl.constexpr, D: tl.constexpr,
               BD: tl.constexpr):
    cols = tl.arange(0, BD)
    ok = (cols < D) & _completes(start, cols, STRIDE)
    slot = tl.maximum(start, 0) // STRIDE
    tl.store(C + b * sb + slot * sn + g * D + cols, tl.load(Y + (b * G + g) * D + cols, mask=ok), mask=ok)


@triton.jit
def _completes(start, lanes, STRIDE: tl.constexpr):
    """Whether the span starting at ``start`` (= t+1−l) is one φ stores (t completes it), as a mask like
    ``lanes``: on a vector, not a scalar, since triton 3.9's interpreter types a mask combined from a
    scalar built of a loaded value as int32 and refuses it."""
    s = start + lanes * 0
    return (s >= 0) & (s % STRIDE == 0)


@triton.jit
def _store_kernel(YK, YV, KC, VC, T, skb, skn, svb, svn,
                  G: tl.constexpr, L: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BDK: tl.constexpr, BDV: tl.constexpr):
    """Program (b, g): where token t completes a span ((t+1−L) ≥ 0 and a multiple of STRIDE), write
    φ's outputs YK[b, g] [d_k] / YV[b, g] [d_v] to compressed slot (t+1−L)/STRIDE; else nothing."""
    b, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    start = tl.load(T + b).to(tl.int64) + 1 - L
    _store_row(YK, KC, b, g, start, skb, skn, G, STRIDE, DK, BDK)
    _store_row(YV, VC, b, g, start, svb, svn, G, STRIDE, DV, BDV)


@triton.jit
def _phi_fc1_part(SRC, NEW, PE, W1, PART, T, sb, st, split, n0, part_base, M,
                  G: tl.constexpr, L: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                  KC: tl.constexpr, BN: tl.constexpr, NMAX: tl.constexpr, PREC: tl.constexpr):
    """Columns [n0, n0 + BN) of φ's fc1 over the K-chunk ``split`` (BK of the l·D inputs, KC at a time)
    for every row r = b·G + g: the span's rows t−L+1 .. t−1 of k or v from the cache (clamped at 0: such
    a span is never stored) and row t from the new token's NEW [B·G, D] (not appended yet), + pe,
    gathered element by element, times W1ᵀ -> PART[part_base + (split · M + r) · NMAX + n] (fp32)."""
    r = tl.arange(0, BM)
    n = n0 + tl.arange(0, BN)
    r_ok, n_ok = r < M, n < D
    b, g = (r // G).to(tl.int64), r % G
    t = tl.load(T + b, mask=r_ok, other=0).to(tl.int64)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in tl.static_range(0, BK, KC):
        kk = split * BK + k0 + tl.arange(0, KC)
        k_ok = kk < L * D
        li, d = kk // D, kk % D
        row = tl.maximum(t[:, None] - L + 1 + li[None, :], 0)
        ok = r_ok[:, None] & k_ok[None, :]
        x = tl.load(SRC + b[:, None] * sb + row * st + g[:, None] * D + d[None, :], mask=ok & (row < t[:, None]),
                    other=0.0).to(tl.float32)
        x += tl.load(NEW + r[:, None] * D + d[None, :], mask=ok & (row == t[:, None]), other=0.0).to(tl.float32)
        x += tl.load(PE + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        # W1's rows are contiguous along K: loaded [BN, KC] (coalesced) and transposed for the product
        w = tl.load(W1 + n[:, None] * (L * D) + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=PREC)
    tl.store(PART + part_base + (split * M + r[:, None]) * NMAX + n[None, :], acc,
             mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _gate_fc1_part(X, W1, PART, sx, split, n0, B, D: tl.constexpr, HID: tl.constexpr, BM: tl.constexpr,
                   BK: tl.constexpr, KC: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """Columns [n0, n0 + BN) of the gate's fc1 over the K-chunk ``split`` of x [B, D] (row stride sx)
    -> PART[(split · B + b) · HID + n] (fp32)."""
    r = tl.arange(0, BM)
    n = n0 + tl.arange(0, BN)
    r_ok, n_ok = r < B, n < HID
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in tl.static_range(0, BK, KC):
        kk = split * BK + k0 + tl.arange(0, KC)
        k_ok = kk < D
        x = tl.load(X + r[:, None].to(tl.int64) * sx + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W1 + n[:, None] * D + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=PREC)
    tl.store(PART + (split * B + r[:, None]) * HID + n[None, :], acc, mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _fc1_kernel(X, W1_G, PART_G, K, V, KN, VN, PE_K, PE_V, W1_K, W1_V, T, PART, sx, skb, skt, svb, svt, B, M,
                D_MODEL: tl.constexpr, HID: tl.constexpr, PHI: tl.constexpr,
                G: tl.constexpr, L: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr,
                BK: tl.constexpr, KC: tl.constexpr, BN: tl.constexpr, NMAX: tl.constexpr,
                SPLITS: tl.constexpr, PREC: tl.constexpr):
    """fc1 of the step's small MLPs in one launch, split over K-chunks (program_id(0)) and column tiles
    (program_id(1)); program_id(2): 0 the gate's, 1 / 2 φ's for k / v (only where PHI: φ is an MLP).
    fp32 partial sums, added up by ``_fc2_kernel``."""
    split, n0, which = tl.program_id(0), tl.program_id(1) * BN, tl.program_id(2)
    if which == 0:
        if split * BK < D_MODEL and n0 < HID:
            _gate_fc1_part(X, W1_G, PART_G, sx, split, n0, B, D_MODEL, HID, BM, BK, KC, BN, PREC)
    else:
        if PHI:
            if which == 1:
                if split * BK < L * DK and n0 < DK:
                    _phi_fc1_part(K, KN, PE_K, W1_K, PART, T, skb, skt, split, n0, 0, M, G, L, DK, BM, BK, KC, BN,
                                  NMAX, PREC)
            else:
                if split * BK < L * DV and n0 < DV:
                    _phi_fc1_part(V, VN, PE_V, W1_V, PART, T, svb, svt, split, n0, SPLITS * M * NMAX, M, G, L, DV,
                                  BM, BK, KC, BN, NMAX, PREC)


@triton.jit
def _fc2_chunk(PART, first, split_stride, splits, B1, W2, B2, j0, N_IN: tl.constexpr, N_OUT: tl.constexpr,
               BIN: tl.constexpr, BJ: tl.constexpr, SP: tl.constexpr):
    """Outputs j0 .. j0+BJ−1 of one row's fc2 -> (y [BJ] fp32, j, j_ok): h = silu(Σ_s PART[first + s ·
    split_stride + i] + b1) over the N_IN hidden units (the fc1 partials of ``splits`` K-chunks),
    y = W2·h + b2 (W2 [N_OUT, N_IN] row-major)."""
    cols = tl.arange(0, BIN)
    c_ok = cols < N_IN
    sp = tl.arange(0, SP)                       # every split's partial in one load (not a chain of them)
    part = tl.load(PART + first + sp[:, None] * split_stride + cols[None, :],
                   mask=(sp < splits)[:, None] & c_ok[None, :], other=0.0)
    h = tl.sum(part, 0) + tl.load(B1 + cols, mask=c_ok, other=0.0).to(tl.float32)
    h = h * tl.sigmoid(h)                                                                       # silu
    j = j0 + tl.arange(0, BJ)
    j_ok = j < N_OUT
    w = tl.load(W2 + j[:, None] * N_IN + cols[None, :], mask=j_ok[:, None] & c_ok[None, :], other=0.0)
    y = tl.sum(w.to(tl.float32) * h[None, :], 1) + tl.load(B2 + j, mask=j_ok, other=0.0).to(tl.float32)
    return y, j, j_ok


@triton.jit
def _phi_fc2_row(PART, part_base, B1, W2, B2, C, T, r, j0, sb, sn, M, G: tl.constexpr, L: tl.constexpr,
                 STRIDE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, NMAX: tl.constexpr,
                 BJ: tl.constexpr, SP: tl.constexpr):
    """φ's row r = b·G + g, outputs j0 .. j0+BJ−1, written (the cache's dtype) to compressed slot
    (t+1−L)/STRIDE where token t completes that span; else nothing."""
    y, j, j_ok = _fc2_chunk(PART, part_base + r * NMAX, M * NMAX, tl.cdiv(L * D, BK), B1, W2, B2, j0, D, D, BD,
                            BJ, SP)
    b, g = r // G, r % G
    start = tl.load(T + b).to(tl.int64) + 1 - L
    slot = tl.maximum(start, 0) // STRIDE
    tl.store(C + b.to(tl.int64) * sb + slot * sn + g * D + j, y.to(C.dtype.element_ty),
             mask=j_ok & _completes(start, j, STRIDE))


@triton.jit
def _gate_fc2_row(PART, B1, W2, B2, OUT, r, j0, B, HID: tl.constexpr, NOUT: tl.constexpr, BHID: tl.constexpr,
                  BJ: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr):
    """The gate's batch row r, outputs j0 .. j0+BJ−1: OUT[r, j] = sigmoid(y)[j] (OUT [B, NOUT = 3·H],
    its dtype)."""
    y, j, j_ok = _fc2_chunk(PART, r * HID, B * HID, SPLITS, B1, W2, B2, j0, HID, NOUT, BHID, BJ, SP)
    tl.store(OUT + r * NOUT + j, tl.sigmoid(y).to(OUT.dtype.element_ty), mask=j_ok)


@triton.jit
def _fc2_kernel(PART_G, B1_G, W2_G, B2_G, GATE, PART, B1_K, B1_V, W2_K, W2_V, B2_K, B2_V, KC, VC, T,
                skb, skn, svb, svn, B, M,
                HID: tl.constexpr, NOUT: tl.constexpr, BHID: tl.constexpr, SPLITS_G: tl.constexpr, SPG: tl.constexpr,
                PHI: tl.constexpr, G: tl.constexpr, L: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr,
                DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BK: tl.constexpr, NMAX: tl.constexpr,
                SPLITS: tl.constexpr, BJ: tl.constexpr, SP: tl.constexpr):
    """Program (row r, which, chunk of BJ outputs): the fc1 sums, silu and fc2 of the step's small MLPs:
    which = 0 the gate of batch row r (r < B) -> GATE [B, 3·H]; 1 / 2 φ for k / v of row r = b·G + g,
    stored where t completes a span (only where PHI). Each program sums the partials itself: one output
    chunk a program, so that its W2 load is the only one it waits on."""
    r, which, j0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BJ
    if which == 0:
        if r < B and j0 < NOUT:
            _gate_fc2_row(PART_G, B1_G, W2_G, B2_G, GATE, r, j0, B, HID, NOUT, BHID, BJ, SPLITS_G, SPG)
    else:
        if PHI:
            if which == 1:
                if j0 < DK:
                    _phi_fc2_row(PART, 0, B1_K, W2_K, B2_K, KC, T, r, j0, skb, skn, M, G, L, STRIDE, DK, BDK, BK,
                                 NMAX, BJ, SP)
            else:
                if j0 < DV:
                    _phi_fc2_row(PART, SPLITS * M * NMAX, B1_V, W2_V, B2_V, VC, T, r, j0, svb, svn, M, G, L, STRIDE,
                                 DV, BDV, BK, NMAX, BJ, SP)


@triton.jit
def _advance_kernel(T, POS, OVER, B, MAX_LEN, BB: tl.constexpr):
    """After a step: POS[b] = T[b] (the cache's position: the token just appended) and T[b] += 1,
    except past the cache's last row: there T stays, so that a step replayed from a caller's CUDA
    graph on a full cache rewrites the last row instead of writing past the buffers, and sets
    OVER[0] = 1 (POS was T already: the step before wrote that row)."""
    i = tl.arange(0, BB)
    ok = i < B
    t = tl.load(T + i, mask=ok)
    last = t + 1 >= MAX_LEN
    tl.store(OVER + i * 0, tl.full([BB], 1, tl.int32), mask=ok & last & (tl.load(POS + i, mask=ok) == t))
    tl.store(POS + i, t, mask=ok)
    tl.store(T + i, tl.where(last, t, t + 1), mask=ok)


@triton.jit(do_not_specialize=["t"])      # one compile for every position
def _seek_kernel(T, POS, OVER, t, B, MAX_LEN, BB: tl.constexpr):
    """T[b] = t (the next step appends token t), POS[b] = t − 1 (the token appended last), OVER = 0:
    one launch, which the decode bench replays inside its captured step. T stays on the last row
    (t = MAX_LEN: a full cache), where a step then sets the overflow flag (``_advance_kernel``)."""
    i = tl.arange(0, BB)
    tl.store(T + i, tl.full([BB], 0, tl.int32) + tl.minimum(t, MAX_LEN - 1), mask=i < B)
    tl.store(POS + i, tl.full([BB], 0, tl.int32) + (t - 1), mask=i < B)
    tl.store(OVER + i, tl.full([BB], 0, tl.int32), mask=i < 1)


# The replay's hand-over (``LayerDecodeStep.replay``): the caller's x and a fresh output are not copied on the host's
# side of a call; their addresses go into a ring of pinned host memory, and the graph's first launch reads x from
# there and its last writes the results there. RING: calls the host may run ahead of the GPU before it waits for a
# slot (the launch queue holds a few hundred replays; 64 steps ahead is already far past any loop's needs)
RING = 64
HAND_BLOCK = 1024             # elements per program of the two hand-over copies


@triton.jit
def _take_kernel(RING_PTR, SEQ, HAND, RING_N: tl.constexpr):
    """A replay's first launch (one program of one warp: one read of host memory, ~1 µs, where every warp's
    own read would queue behind the others'): the call's two addresses, pinned RING_PTR[seq % RING_N, :2] (x's,
    the output's; written by the host before the replay) -> HAND [2] on the device. After it the host may write
    the slot again."""
    slot = tl.load(SEQ) % RING_N
    two = tl.arange(0, 2)
    tl.store(HAND + two, tl.load(RING_PTR + 2 * slot + two, volatile=True))


@triton.jit
def _copy_in_kernel(HAND, X_IN, N, BLOCK: tl.constexpr):
    """x, at the address HAND[0] holds -> X_IN [N] (bits copied as integers)."""
    src = tl.load(HAND).to(tl.pointer_type(X_IN.dtype.element_ty))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X_IN + offs, tl.load(src + offs, mask=offs < N), mask=offs < N)


@triton.jit
def _give_kernel(BUF, HAND, SEQ, DONE, N, BLOCK: tl.constexpr):
    """A replay's last launch: BUF [N] (out and the reads and blocks, as integers) -> the call's output at the
    address HAND[1] holds; program 0 advances SEQ and tells the host, in pinned DONE [1], how many replays
    have taken their slot (``_take_kernel`` ran before this launch: no program here reads SEQ or the ring)."""
    dst = tl.load(HAND + 1).to(tl.pointer_type(BUF.dtype.element_ty))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(BUF + offs, mask=offs < N), mask=offs < N)
    if tl.program_id(0) == 0:
        s = tl.load(SEQ) + 1
        tl.store(SEQ, s)
        tl.store(DONE, s)


# bumped wherever a parameter or a submodule is registered, in any module (torch's global registration hooks):
# a replay step lists its module's parameters again only then (``LayerDecodeStep._param_ptrs``)
_REGISTRATIONS = [0]


def _registered(*_) -> None:
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_module_registration_hook(_registered)
_DATA_PTR = torch.Tensor.data_ptr
_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int64_info(r: StepOut, out: torch.Tensor | None = None) -> torch.Tensor:
    """A step's reads and blocks as one int64 tensor [B, G, branches + n] (each branch's reads in
    ``r.reads``'s order, then the blocks), into ``out`` where given: one copy for the caller to take."""
    return torch.cat([torch.stack(list(r.reads.values()), -1), r.idx], -1, out=out).long()


class LayerDecodeStep:
    """One NSA layer decode step for module ``m`` over ``cache`` (which holds ``cache.length``
    tokens, e.g. after a prefill); buffers are made once, here, and the attention step of each plan the
    cache goes through once, as the position first needs it (``attention``). ``held_by_cache``: kept in
    ``cache.kernel_state``, it holds the cache weakly (``DecodeStep``)."""

    def __init__(self, m, cache, *, held_by_cache: bool = False) -> None:
        self.m, cfg = m, m.cfg
        self._cache = weakref.ref(cache) if held_by_cache else lambda: cache
        self._held_by_cache = held_by_cache
        self._steps: dict[int, DecodeStep] = {}  # horizon -> the attention step planned for it
        self._span = (0, 0, None)                # positions [lo, hi) known to take step (``attention``)
        B, G, l, D = cache.k.shape[0], cfg.n_kv_heads, cfg.cmp_len, cfg.d_model
        dev, dt = cache.k.device, cache.k.dtype
        assert cache.k_cmp.stride(2) == cfg.d_k and cache.v_cmp.stride(2) == cfg.d_v, "cache rows must be contiguous [G, d]"
        gate, phi = m.gate, cfg.compress == "mlp"
        mlps = (gate.fc1, gate.fc2) + ((m.cmp_k.fc1, m.cmp_k.fc2, m.cmp_v.fc1, m.cmp_v.fc2) if phi else ())
        assert all(f.weight.is_contiguous() for f in mlps), "the MLPs' weights must be contiguous"
        # the two launches of the small MLPs (the gate, and φ where it is an MLP): grids and settings fixed here
        M, nmax, hid, nout = B * G, max(cfg.d_k, cfg.d_v), gate.fc1.out_features, gate.fc2.out_features
        splits, splits_g = triton.cdiv(l * nmax, MLP_BK), triton.cdiv(D, MLP_BK)
        self.gate_part = torch.empty(splits_g, B, hid, device=dev, dtype=torch.float32)
        self.g = torch.empty(B, cfg.n_heads, 3, device=dev, dtype=gate.fc2.weight.dtype)
        self.part = torch.empty(2 if phi else 0, splits, M, nmax, device=dev, dtype=torch.float32)
        bd = (triton.next_power_of_2(cfg.d_k), triton.next_power_of_2(cfg.d_v))
        shared = dict(PHI=phi, G=G, L=l, DK=cfg.d_k, DV=cfg.d_v, BK=MLP_BK, NMAX=nmax, SPLITS=splits)
        jobs = 3 if phi else 1                   # program_id(2) / (1): the gate, then φ for k and v
        kc = MLP_KC_FP32 if fp32_compiled(dt.itemsize) else MLP_KC
        self.fc1 = ((max(splits, splits_g) if phi else splits_g,
                     triton.cdiv(max(nmax, hid) if phi else hid, MLP_BN), jobs),
                    dict(shared, D_MODEL=D, HID=hid, BM=max(16, triton.next_power_of_2(max(M, B))), KC=min(kc, MLP_BK),
                         BN=MLP_BN, PREC=precision(dt)))
        bj = min(32, *bd)
        self.fc2 = ((max(M, B), jobs, triton.cdiv(max(nmax, nout) if phi else nout, bj)),
                    dict(shared, HID=hid, NOUT=nout, BHID=triton.next_power_of_2(hid), SPLITS_G=splits_g,
                         SPG=triton.next_power_of_2(splits_g), STRIDE=cfg.cmp_stride, BDK=bd[0], BDV=bd[1],
                         BJ=bj, SP=triton.next_power_of_2(splits), num_warps=FC2_WARPS))
        if not phi:                              # φ's inputs (mean), written by _span_kernel; its launches' settings
            self.xk = torch.empty(B, G, l * cfg.d_k, device=dev, dtype=dt)
            self.xv = torch.empty(B, G, l * cfg.d_v, device=dev, dtype=dt)
            self.span = dict(G=G, L=l, DK=cfg.d_k, DV=cfg.d_v, BDK=bd[0], BDV=bd[1])
        self.bb = triton.next_power_of_2(B)      # _advance_kernel's lanes
        self.next_t = torch.empty(B, dtype=torch.int32, device=dev)    # the position the next step appends at
        self.seek(cache.length)             # sets next_t, and self.length: the cache's length as this step last saw it
        self.last: StepOut | None = None
        # (what it was captured for, CUDA graph, its input (read by the graph: kept alive here), the buffer of its
        # results and their layout, its notes)
        self._graph: tuple | None = None
        self._hand: tuple | None = None          # the replay's ring, its numpy views and the device counters
        self._calls = 0                          # replays handed a slot of the ring (the device counts them too)
        self._params: tuple | None = None        # (``_REGISTRATIONS`` when listed, the module's parameters)

    @property
    def cache(self):
        return self._cache()

    def attention(self, t: int, whole: bool = False) -> DecodeStep:
        """The attention step for token t: planned for ``kernels.decode.horizon`` of t, the next power of two of
        tokens (a cache with room to grow runs the plan of a full one; the plan changes as the cache fills), or with
        ``whole`` for the cache's capacity, every position (what a CUDA graph replayed token after token needs:
        ``record``). Each made once; a call within the range of the last one's positions asks nothing else."""
        lo, hi, step = self._span
        if lo <= t < hi and not whole:
            return step
        c = self.cache
        h = c.max_len if whole else horizon(self.m.cfg, t, c.max_len)
        step = self._steps.get(h)
        if step is None:
            step = self._steps[h] = DecodeStep(self.m.cfg, c, held_by_cache=self._held_by_cache, horizon=h)
        if not whole:
            self._span = (t, h, step)
        return step

    def seek(self, t: int) -> None:
        """Continue at position t: the next step appends token t, as if tokens t.. had not been
        decoded (one launch and a host integer; no sync). Replaying a captured step after
        ``seek`` inside the captured work decodes the same position every time (the bench)."""
        c = self.cache
        _seek_kernel[(1,)](self.next_t, c.pos, c.overflow, t, self.next_t.numel(), c.max_len, BB=self.bb)
        c.length = self.length = t

    def check_room(self, length: int | None = None) -> int:
        """Raise where the cache, holding ``length`` tokens (default: its ``length``, which on a
        ``device_owned`` cache is a read from the GPU, a sync), has no row left for the next; returns that length."""
        c = self.cache
        if length is None:
            length = c.length
        if length >= c.max_len:
            raise ValueError(f"DecodeCache full: {length} + 1 > max_len {c.max_len}")
        return length

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, length: int | None = None, into: torch.Tensor | None = None, *,
                 whole: bool | None = None) -> torch.Tensor:
        """The step, run eagerly, for token t = the cache's length (``length``: that, where read already)
        -> out [B, 1, D], written into ``into`` where given. ``whole``: on the attention step planned for every
        position (``attention``); by default where a CUDA graph is being captured (its replays go on token after
        token, past any smaller plan's horizon), else on the plan for t. False under a capture: the caller replays
        the graph only at positions below that plan's horizon (``replay``'s own graph, captured again as the
        position passes it; the decode bench, whose captured work seeks back to t before each step)."""
        held = self.check_room(length)
        if whole is None:
            whole = x.is_cuda and torch.cuda.is_current_stream_capturing()
        attn = self.attention(held, whole)
        m, c = self.m, self.cache
        B = x.shape[0]
        t = self.next_t
        q, k, v = m.project(x)
        kn, vn = k[:, 0].contiguous(), v[:, 0].contiguous()     # [B, G, d]: the new token, appended by the step
        self._mlps(x[:, 0].contiguous(), kn, vn, t)              # the gate -> self.g; φ -> its compressed slot
        self.last = attn(q[:, 0], kn, vn, pos=t, gate=self.g)
        out = self._o_proj(self.last.mixed.reshape(B, 1, -1), into)
        _advance_kernel[(1,)](t, c.pos, c.overflow, B, c.max_len, BB=self.bb)
        c.advanced()
        self.length = held + 1             # not c.length: on a device_owned cache that read would wait for this step
        return out

    def _o_proj(self, mixed: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        """The output projection of mixed [B, 1, H·d_v] -> [B, 1, D], into ``into`` where given: for a
        bias-free ``nn.Linear`` (the module's own) the same product its forward makes, written in place."""
        lin = self.m.o_proj
        if into is None:
            return lin(mixed)
        if type(lin) is torch.nn.Linear and lin.bias is None:
            torch.mm(mixed[:, 0], lin.weight.t(), out=into[:, 0])
            return into
        return into.copy_(lin(mixed))

    def decode(self, x: torch.Tensor, length: int | None = None):
        """The step as ``NSAAttention.decode`` runs it -> (out [B, 1, D], ``StepInfo``: reads {branch: [B, G]
        int64} and idx [B, G, n] int64), new tensors: replayed from a CUDA graph on a GPU (``replay``), run
        eagerly elsewhere. Where a caller is capturing a CUDA graph of its own, the step is recorded
        into it (no graph inside a graph; ``record``). ``length``: the cache's length where the caller
        has read it already (on a ``device_owned`` cache each read is a sync; then none is made here)."""
        with torch.no_grad():
            if not x.is_cuda:
                out = self(x, length)
                info = _int64_info(self.last)
                return out, StepInfo.packed(lambda: info, list(self.last.reads))
            if torch.cuda.is_current_stream_capturing():
                return self.record(x, length)
            return self.replay(x, length)

    @torch.no_grad()
    def record(self, x: torch.Tensor, length: int | None = None):
        """As ``decode``, into the CUDA graph the caller is capturing: each of its replays decodes
        the next token (the position advances on the device), which the host cannot count, so the
        cache becomes ``device_owned`` (its length read from the device from then on), and the
        attention step recorded is the one planned for the cache's capacity (``attention``). The
        kernels are not noted as run: recording runs nothing, and the caller's replays are not
        seen here. An earlier, uncaptured call on this cache (``kernels.routes.decode_layer`` asks
        for one) made the buffers and compiled the kernels of the plan for its position; where that
        plan was not the capacity's, the capacity's step is made here, as the graph records: its
        workspace comes from the caller's graph's memory pool (held by the step, it outlives the
        graph; its zero fills are recorded into the graph too, and run again at each replay, which is harmless)
        and its kernels compile and load during the capture, which CUDA's global capture mode allows
        (H200, torch 2.11, Triton 3.6: ``tests/nsa/test_decode_layer.py``)."""
        held = self.check_room(length)
        self.cache.device_owned = True     # before the step: the host does not count this token (nothing ran)
        with dispatch.diverted():
            out = self(x, held, whole=True)
            info = _int64_info(self.last)
        self.length = held                 # the host's view: recording decoded nothing
        return out, StepInfo.packed(lambda: info, list(self.last.reads))

    def replay(self, x: torch.Tensor, length: int | None = None):
        """As ``decode``, from a CUDA graph of the step captured at the first call (GPU only; nothing it
        returns has a gradient): one graph launch instead of a dozen kernel launches from Python. Captured
        again where x's shape or dtype, where a parameter of the module lives (its ``data_ptr``: a
        parameter replaced, or moved by ``.to()``), or the position's plan (``attention``: a cache filling
        past its horizon) is not what it was captured for."""
        # The host's work per token, which a decode loop that calls the layer from Python waits on: a check of the
        # key (the plan's step included: two comparisons while the position stays in its range), one allocation (out
        # and the reads and blocks share one buffer), two addresses written into pinned memory, the graph's launch.
        # The graph itself copies x in (``_take_kernel``) and its results out (``_give_kernel``): a copy and a clone
        # from the host cost ~27 µs a call on an H200 pod's CPU (docs/decisions.md). x and the output are used on the
        # current stream, after this call returns, as any kernel launched here would use them; the reads and blocks
        # are cut out only when asked for.
        held = self.check_room(length)
        key = (x.shape, x.dtype, self._param_ptrs(), self.attention(held))
        if self._graph is None or self._graph[0] != key:
            self._capture(x, key, held)
        _, graph, _, buf, (out_shape, out_strides, at, info_shape, names), notes = self._graph
        ring, slots, done, _, _ = self._hand
        if not x.is_contiguous():
            x = x.contiguous()             # (freed after the call: reused only by work queued after this replay)
        got = torch.empty_like(buf)
        i = self._calls
        while i - int(done[0]) >= RING:    # the GPU is RING replays behind: wait for it to take a slot
            time.sleep(0)
        slots[i % RING, 0], slots[i % RING, 1] = x.data_ptr(), got.data_ptr()
        graph.replay()                     # advances next_t and the cache's pos on the device
        self._calls = i + 1
        dispatch.replay(notes)             # the kernels the capture recorded ran again
        self.cache.advanced()
        self.length = held + 1             # (no read of a device_owned cache's length: it would wait for the replay)
        return (got.as_strided(out_shape, out_strides),
                StepInfo.packed(lambda: got[at:].view(torch.int64).view(info_shape), names))

    def _param_ptrs(self) -> tuple:
        """The addresses of the module's parameters. The list of parameters is made again only where a
        parameter or submodule was registered anywhere since (``_REGISTRATIONS``); an address changes where a
        parameter's storage moved (``.to()``, ``p.data = …``)."""
        if self._params is None or self._params[0] != _REGISTRATIONS[0]:
            self._params = (_REGISTRATIONS[0], list(self.m.parameters()))
        return tuple(map(_DATA_PTR, self._params[1]))

    def _hand_over(self, device) -> tuple:
        """The replay's ring (pinned [RING, 2] int64: x's and the output's addresses per call), the number of
        replays that took their slot (pinned [1], written by the GPU), and on the device [3] int64: the count of
        replays, then the current call's two addresses: made once per step, kept across captures, since replays of
        an earlier graph may still be queued when the step is captured again."""
        if self._hand is None:
            ring = torch.zeros(RING, 2, dtype=torch.int64, pin_memory=True)
            done = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            self._hand = (ring, ring.numpy(), done.numpy(), done, torch.zeros(3, dtype=torch.int64, device=device))
        return self._hand

    @torch.no_grad()
    def _capture(self, x: torch.Tensor, key: tuple, t: int) -> None:
        x_in = x.contiguous().clone()
        self.seek(t)
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):      # compiles and warms up: decodes token t, written again by the replay
            out = self(x_in, t)
        torch.cuda.current_stream(x.device).wait_stream(side)
        self.seek(t)
        # out and the reads and blocks in one buffer of out's dtype, the int64 part 8-byte aligned
        per = 8 // out.element_size()
        at = -(-out.numel() // per) * per
        info_shape = (*self.last.idx.shape[:2], len(self.last.reads) + self.last.idx.shape[2])
        buf = torch.empty(at + per * info_shape[0] * info_shape[1] * info_shape[2], dtype=out.dtype, device=x.device)
        out_view = buf[:out.numel()].view(out.shape)
        # the hand-over copies move bits: x and the buffer seen as integers of their width (the buffer's length is a
        # multiple of 8 bytes)
        x_bits, buf_bits = x_in.view(-1).view(_INT_OF[x_in.element_size()]), buf.view(torch.int64)
        ring, slots, _, done, dev = self._hand_over(x.device)
        seq, hand_at = dev[0:1], dev[1:3]

        def take():                        # x in
            _take_kernel[(1,)](ring, seq, hand_at, RING_N=RING, num_warps=1)
            _copy_in_kernel[(triton.cdiv(x_bits.numel(), HAND_BLOCK),)](hand_at, x_bits, x_bits.numel(),
                                                                        BLOCK=HAND_BLOCK)

        def give():                        # the results out
            _give_kernel[(triton.cdiv(buf_bits.numel(), HAND_BLOCK),)](buf_bits, hand_at, seq, done,
                                                                       buf_bits.numel(), BLOCK=HAND_BLOCK)

        # the hand-over launches once outside the capture (compiled there, not while it records), as a call
        # would: x_in onto itself, the buffer onto itself. The side stream waits for the current one again: the
        # buffer and a first call's device counters (zeroed) were made there after the wait above; a take that
        # ran before the zeroing read a stale count, so an unwritten slot, and crashed on its address
        slots[self._calls % RING] = (x_bits.data_ptr(), buf_bits.data_ptr())
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            take()
            give()
        side.synchronize()
        self._calls += 1
        graph = torch.cuda.CUDAGraph()
        # recorded, not run: no notes outside. On x's device's stream (torch's default capture stream lives on
        # whichever GPU was current at the process's first capture)
        with dispatch.diverted() as notes, capturing(graph, stream=side):
            take()
            self(x_in, t, into=out_view, whole=False)     # replayed below the plan's horizon only (the key)
            _int64_info(self.last, out=buf[at:].view(torch.int64).view(info_shape))
            give()
        self.seek(t)                       # the capture ran the host's bookkeeping once, and no kernel
        self._graph = (key, graph, x_in, buf, (out_view.shape, out_view.stride(), at, info_shape, list(self.last.reads)),
                       notes)

    def _mlps(self, x: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor, t: torch.Tensor) -> None:
        """The gate for x [B, D] -> self.g [B, H, 3], and φ over tokens t−l+1 .. t (token t: kn [B, G, d_k]
        / vn [B, G, d_v], not in the cache yet) into compressed slot (t+1−l)/d, where t completes it."""
        m, c, cfg = self.m, self.cache, self.m.cfg
        B, G, l = c.k.shape[0], cfg.n_kv_heads, cfg.cmp_len
        gate, pk, pv = m.gate, m.cmp_k, m.cmp_v
        phi = cfg.compress == "mlp"
        (grid1, kw1), (grid2, kw2) = self.fc1, self.fc2
        # φ = mean has no MLP tensors: its pointer arguments are the gate's, never read (PHI=False)
        k_mlp = (pk.pe, pv.pe, pk.fc1.weight, pv.fc1.weight) if phi else (gate.fc1.weight,) * 4
        _fc1_kernel[grid1](x, gate.fc1.weight, self.gate_part, c.k, c.v, kn, vn, *k_mlp, t, self.part, x.stride(0),
                           c.k.stride(0), c.k.stride(1), c.v.stride(0), c.v.stride(1), B, B * G, **kw1)
        k_out = ((pk.fc1.bias, pv.fc1.bias, pk.fc2.weight, pv.fc2.weight, pk.fc2.bias, pv.fc2.bias) if phi
                 else (gate.fc1.bias,) * 6)
        _fc2_kernel[grid2](self.gate_part, gate.fc1.bias, gate.fc2.weight, gate.fc2.bias, self.g, self.part, *k_out,
                           c.k_cmp, c.v_cmp, t, c.k_cmp.stride(0), c.k_cmp.stride(1), c.v_cmp.stride(0),
                           c.v_cmp.stride(1), B, B * G, **kw2)
        if phi:
            return
        _span_kernel[(B, G)](c.k, c.v, kn, vn, t, self.xk, self.xv, c.k.stride(0), c.k.stride(1), c.v.stride(0),
                             c.v.stride(1), BL=triton.next_power_of_2(l), **self.span)
        yk, yv = self.xk.view(B, G, l, -1).mean(2), self.xv.view(B, G, l, -1).mean(2)
        _store_kernel[(B, G)](yk.contiguous(), yv.contiguous(), c.k_cmp, c.v_cmp, t, c.k_cmp.stride(0),
                              c.k_cmp.stride(1), c.v_cmp.stride(0), c.v_cmp.stride(1), STRIDE=cfg.cmp_stride,
                              **self.span)
