"""The whole NSA layer's decode step on the Triton kernels, with nothing the host must compute.

``NSAAttention.decode`` on the torch route appends on the host, runs φ only when a compressed span
completes (an ``if`` on a host integer) and mixes the branches in torch. ``LayerDecodeStep`` does
the same work as device operations of fixed shapes, so a whole layer step (projections, append,
φ, gate, attention, gated mix, output projection) can be captured in a CUDA graph; it is what
``NSAAttention.decode`` runs on the Triton route (one per cache, ``kernels.routes.decode_layer``):

* the position lives on the device (``next_t`` [B] int32, advanced by the step itself);
* φ runs every step over the l tokens ending at t, for k and v together, in two launches:
  ``_phi_fc1_kernel`` gathers the span from the cache (+ the intra-block position embedding: the
  prefill's φ folds it into fc1's bias instead, which saves it a pass over all the spans, but here
  the gather adds it for free; both forms are checked against the oracle) and multiplies it by fc1's
  weight in K-chunks (fp32 partial sums); ``_phi_fc2_kernel`` adds them up with the bias, applies
  silu and fc2, and writes the result to compressed slot (t+1−l)/d only where token t completes
  that span. They replaced ten launches (the span gather; fc1, cuBLAS's split-K reduce, silu and fc2
  for each of k and v in torch; the store): H100, paper config, bf16, the whole layer step
  graph-replayed at 64k after the read flush, B=1 88.9 vs 95.7 µs, B=16 177.5 vs 188.7 (two
  machines, one run each, not alternated). A first version whose fc2 program added the K-split
  partials one dependent load at a time and whose fc1 read W1 across its rows (uncoalesced) took
  164.4 / 454.0 µs. (φ = mean: the gather, a torch mean and ``_store_kernel``.) A fixed set of
  launches instead of a data-dependent branch (the torch gather/where/index_put version of this took
  ~30 launches, ~100 µs of a step on the H100);
* the three branches and the gate mix run in ``kernels.decode.DecodeStep``.

Shapes: x [B, 1, D] -> out [B, 1, D]. The cache's host ``length`` is advanced by ``__call__``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import precision
from kernels.decode import DecodeStep, StepOut

# φ's fc1 in the decode step: inputs per program (a K-chunk), per product, and columns per program
PHI_BK, PHI_KC, PHI_BN = 512, 128, 64


@triton.jit
def _span_rows(X, SRC, b, g, t, sb, st, G: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
               BL: tl.constexpr, BD: tl.constexpr):
    i = tl.arange(0, BL)
    rows = tl.maximum(t - L + 1 + i, 0)
    cols = tl.arange(0, BD)
    ok = (i < L)[:, None] & (cols < D)[None, :]
    x = tl.load(SRC + b * sb + rows[:, None] * st + g * D + cols[None, :], mask=ok)
    tl.store(X + (b * G + g) * L * D + i[:, None] * D + cols[None, :], x.to(X.dtype.element_ty), mask=ok)


@triton.jit
def _span_kernel(K, V, T, XK, XV, skb, skt, svb, svt,
                 G: tl.constexpr, L: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BL: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr):
    """Program (b, g): rows t−L+1 .. t of k and v (clamped at 0: such a span is never stored) for KV
    head g -> XK[b, g] = [L·d_k] (row-major over (l, d)), XV likewise (φ = mean)."""
    b, g = tl.program_id(0).to(tl.int64), tl.program_id(1)    # 64-bit: b · (T_max · G · d) may pass 2^31
    t = tl.load(T + b).to(tl.int64)
    _span_rows(XK, K, b, g, t, skb, skt, G, L, DK, BL, BDK)
    _span_rows(XV, V, b, g, t, svb, svt, G, L, DV, BL, BDV)


@triton.jit
def _store_row(Y, C, b, g, start, sb, sn, G: tl.constexpr, STRIDE: tl.constexpr, D: tl.constexpr,
               BD: tl.constexpr):
    cols = tl.arange(0, BD)
    # the test "t completes a span" on a vector, not a scalar: triton 3.9's interpreter types a mask
    # combined from a scalar built of a loaded value as int32 and refuses it
    s = start + cols * 0
    ok = (cols < D) & (s >= 0) & (s % STRIDE == 0)
    slot = tl.maximum(start, 0) // STRIDE
    tl.store(C + b * sb + slot * sn + g * D + cols, tl.load(Y + (b * G + g) * D + cols, mask=ok), mask=ok)


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
def _phi_fc1_part(SRC, PE, W1, PART, T, sb, st, split, n0, part_base, M,
                  G: tl.constexpr, L: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                  KC: tl.constexpr, BN: tl.constexpr, NMAX: tl.constexpr, PREC: tl.constexpr):
    """Columns [n0, n0 + BN) of fc1 over the K-chunk ``split`` (BK of the l·D inputs, KC at a time)
    for every row r = b·G + g: the span's rows t−L+1 .. t of k or v (clamped at 0: such a span is
    never stored) + pe, gathered element by element, times W1ᵀ -> PART[part_base + (split · M + r) ·
    NMAX + n] (fp32)."""
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
        x = tl.load(SRC + b[:, None] * sb + row * st + g[:, None] * D + d[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x += tl.load(PE + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        # W1's rows are contiguous along K: loaded [BN, KC] (coalesced) and transposed for the product
        w = tl.load(W1 + n[:, None] * (L * D) + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=PREC)
    tl.store(PART + part_base + (split * M + r[:, None]) * NMAX + n[None, :], acc,
             mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _phi_fc1_kernel(K, V, PE_K, PE_V, W1_K, W1_V, T, PART, skb, skt, svb, svt, M,
                    G: tl.constexpr, L: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr, KC: tl.constexpr, BN: tl.constexpr, NMAX: tl.constexpr,
                    SPLITS: tl.constexpr, PREC: tl.constexpr):
    """φ's fc1 for k (program_id(2) = 0) and v (1) in one launch, split over K-chunks (program_id(0))
    and column tiles (program_id(1)): fp32 partial sums, added up by ``_phi_fc2_kernel``."""
    split, n0, which = tl.program_id(0), tl.program_id(1) * BN, tl.program_id(2)
    if which == 0:
        if split * BK < L * DK and n0 < DK:
            _phi_fc1_part(K, PE_K, W1_K, PART, T, skb, skt, split, n0, 0, M, G, L, DK, BM, BK, KC, BN, NMAX, PREC)
    else:
        if split * BK < L * DV and n0 < DV:
            _phi_fc1_part(V, PE_V, W1_V, PART, T, svb, svt, split, n0, SPLITS * M * NMAX, M, G, L, DV, BM, BK, KC,
                          BN, NMAX, PREC)


@triton.jit
def _phi_fc2_row(PART, part_base, B1, W2, B2, C, T, r, sb, sn, M, G: tl.constexpr, L: tl.constexpr,
                 STRIDE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, NMAX: tl.constexpr,
                 BJ: tl.constexpr, SP: tl.constexpr):
    """Row r = b·G + g: h = silu(Σ_splits partials + b1), y = W2·h + b2, written (the cache's dtype) to
    compressed slot (t+1−L)/STRIDE where token t completes that span; else nothing."""
    cols = tl.arange(0, BD)
    c_ok = cols < D
    sp = tl.arange(0, SP)                       # every split's partial in one load (not a chain of them)
    part = tl.load(PART + part_base + (sp[:, None] * M + r) * NMAX + cols[None, :],
                   mask=(sp < tl.cdiv(L * D, BK))[:, None] & c_ok[None, :], other=0.0)
    h = tl.sum(part, 0) + tl.load(B1 + cols, mask=c_ok, other=0.0).to(tl.float32)
    h = h * tl.sigmoid(h)                                                                       # silu
    b, g = r // G, r % G
    start = tl.load(T + b).to(tl.int64) + 1 - L
    slot = tl.maximum(start, 0) // STRIDE
    for j0 in tl.static_range(0, BD, BJ):
        j = j0 + tl.arange(0, BJ)
        j_ok = j < D
        w = tl.load(W2 + j[:, None] * D + cols[None, :], mask=j_ok[:, None] & c_ok[None, :], other=0.0)
        y = tl.sum(w.to(tl.float32) * h[None, :], 1) + tl.load(B2 + j, mask=j_ok, other=0.0).to(tl.float32)
        s_vec = start + j * 0          # the span test on a vector (see ``_store_row``)
        ok = j_ok & (s_vec >= 0) & (s_vec % STRIDE == 0)
        tl.store(C + b.to(tl.int64) * sb + slot * sn + g * D + j, y.to(C.dtype.element_ty), mask=ok)


@triton.jit
def _phi_fc2_kernel(PART, B1_K, B1_V, W2_K, W2_V, B2_K, B2_V, KC, VC, T, skb, skn, svb, svn, M,
                    G: tl.constexpr, L: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BDK: tl.constexpr, BDV: tl.constexpr, BK: tl.constexpr, NMAX: tl.constexpr,
                    SPLITS: tl.constexpr, BJ: tl.constexpr, SP: tl.constexpr):
    """Program (row r = b·G + g, k or v): φ's fc1 sum, silu and fc2, stored where t completes a span."""
    r, which = tl.program_id(0), tl.program_id(1)
    if which == 0:
        _phi_fc2_row(PART, 0, B1_K, W2_K, B2_K, KC, T, r, skb, skn, M, G, L, STRIDE, DK, BDK, BK, NMAX, BJ, SP)
    else:
        _phi_fc2_row(PART, SPLITS * M * NMAX, B1_V, W2_V, B2_V, VC, T, r, svb, svn, M, G, L, STRIDE, DV, BDV, BK,
                     NMAX, BJ, SP)


class LayerDecodeStep:
    """One NSA layer decode step for module ``m`` over ``cache`` (which holds ``cache.length``
    tokens, e.g. after a prefill); buffers and plan are made once, here."""

    def __init__(self, m, cache) -> None:
        self.m, self.cache, cfg = m, cache, m.cfg
        self.attn = DecodeStep(cfg, cache)
        B, G, l = cache.k.shape[0], cfg.n_kv_heads, cfg.cmp_len
        dev, dt = cache.k.device, cache.k.dtype
        assert cache.k_cmp.stride(2) == cfg.d_k and cache.v_cmp.stride(2) == cfg.d_v, "cache rows must be contiguous [G, d]"
        if cfg.compress == "mlp":        # φ's fc1 partial sums (written by _phi_fc1_kernel); both launches' settings
            M, nmax = B * G, max(cfg.d_k, cfg.d_v)
            splits = triton.cdiv(l * nmax, PHI_BK)
            self.part = torch.empty(2, splits, M, nmax, device=dev, dtype=torch.float32)
            bd = (triton.next_power_of_2(cfg.d_k), triton.next_power_of_2(cfg.d_v))
            shared = dict(G=G, L=l, DK=cfg.d_k, DV=cfg.d_v, BK=PHI_BK, NMAX=nmax, SPLITS=splits)
            self.phi_fc1 = ((splits, triton.cdiv(nmax, PHI_BN), 2),
                            dict(shared, BM=max(16, triton.next_power_of_2(M)), KC=PHI_KC, BN=PHI_BN,
                                 PREC=precision(dt)))
            self.phi_fc2 = ((M, 2), dict(shared, STRIDE=cfg.cmp_stride, BDK=bd[0], BDV=bd[1], BJ=min(32, *bd),
                                         SP=triton.next_power_of_2(splits), num_warps=8))
        else:                            # φ's inputs (mean), written by _span_kernel
            self.xk = torch.empty(B, G, l * cfg.d_k, device=dev, dtype=dt)
            self.xv = torch.empty(B, G, l * cfg.d_v, device=dev, dtype=dt)
        self.next_t = torch.full((B,), cache.length, dtype=torch.int32, device=dev)
        self.length = cache.length          # host mirror of next_t: the cache's length as this step left it
        self.last: StepOut | None = None

    def seek(self, t: int) -> None:
        """Continue at position t: the next step appends token t, as if tokens t.. had not been
        decoded (a device fill and a host integer; no sync). Replaying a captured step after
        ``seek`` inside the captured work decodes the same position every time (the bench)."""
        self.next_t.fill_(t)
        self.cache.length = self.length = t

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, c = self.m, self.cache
        if c.length >= c.max_len:
            raise ValueError(f"DecodeCache full: {c.length} + 1 > max_len {c.max_len}")
        B = x.shape[0]
        t = self.next_t
        q, k, v = m.project(x)
        self.attn._append(k[:, 0], v[:, 0], t)
        self._compress(t)
        g = m.gates(x)[:, 0].contiguous()                                   # [B, H, 3]
        self.last = self.attn(q[:, 0], pos=t, gate=g)
        out = m.o_proj(self.last.mixed.reshape(B, 1, -1))
        c.pos.copy_(t)
        t.add_(1)
        c.length += 1
        self.length = c.length
        return out

    def _compress(self, t: torch.Tensor) -> None:
        """φ over raw tokens t−l+1 .. t into compressed slot (t+1−l)/d, where t completes it."""
        m, c, cfg = self.m, self.cache, self.m.cfg
        B, G, l = c.k.shape[0], cfg.n_kv_heads, cfg.cmp_len
        if cfg.compress == "mlp":        # the launches' grids and settings: fixed in __init__
            pk, pv = m.cmp_k, m.cmp_v
            (grid1, kw1), (grid2, kw2) = self.phi_fc1, self.phi_fc2
            M = grid2[0]
            _phi_fc1_kernel[grid1](c.k, c.v, pk.pe, pv.pe, pk.fc1.weight, pv.fc1.weight, t, self.part, c.k.stride(0),
                                   c.k.stride(1), c.v.stride(0), c.v.stride(1), M, **kw1)
            _phi_fc2_kernel[grid2](self.part, pk.fc1.bias, pv.fc1.bias, pk.fc2.weight, pv.fc2.weight, pk.fc2.bias,
                                   pv.fc2.bias, c.k_cmp, c.v_cmp, t, c.k_cmp.stride(0), c.k_cmp.stride(1),
                                   c.v_cmp.stride(0), c.v_cmp.stride(1), M, **kw2)
            return
        bd = (triton.next_power_of_2(cfg.d_k), triton.next_power_of_2(cfg.d_v))
        _span_kernel[(B, G)](c.k, c.v, t, self.xk, self.xv, c.k.stride(0), c.k.stride(1), c.v.stride(0),
                             c.v.stride(1), G=G, L=l, DK=cfg.d_k, DV=cfg.d_v, BL=triton.next_power_of_2(l),
                             BDK=bd[0], BDV=bd[1])
        yk, yv = self.xk.view(B, G, l, -1).mean(2), self.xv.view(B, G, l, -1).mean(2)
        _store_kernel[(B, G)](yk.contiguous(), yv.contiguous(), c.k_cmp, c.v_cmp, t, c.k_cmp.stride(0),
                              c.k_cmp.stride(1), c.v_cmp.stride(0), c.v_cmp.stride(1), G=G, L=l,
                              STRIDE=cfg.cmp_stride, DK=cfg.d_k, DV=cfg.d_v, BDK=bd[0], BDV=bd[1])
