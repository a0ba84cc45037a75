"""The whole NSA layer's decode step on the Triton kernels, with nothing the host must compute.

``NSAAttention.decode`` on the torch route appends on the host, runs φ only when a compressed span
completes (an ``if`` on a host integer) and mixes the branches in torch. ``LayerDecodeStep`` does
the same work as device operations of fixed shapes, so a whole layer step (projections, append,
φ, gate, attention, gated mix, output projection) can be captured in a CUDA graph; it is what
``NSAAttention.decode`` runs on the Triton route (one per cache, ``kernels.routes.decode_layer``):

* the position lives on the device (``next_t`` [B] int32, advanced by the step itself);
* φ runs every step over the l tokens ending at t: ``_span_kernel`` gathers them (+ the intra-block
  position embedding: the prefill's φ folds it into fc1's bias instead, which saves it a pass over
  all the spans, but here that fold would be one more launch per step while the gather adds it for
  free; both forms are checked against the oracle) for k and v in one launch, φ's MLP runs in
  torch, and ``_store_kernel``
  writes the result to compressed slot (t+1−l)/d only where token t completes that span, one
  launch for k and v: a fixed ~8 launches instead of a data-dependent branch (the torch
  gather/where/index_put version of this took ~30 launches, ~100 µs of a step on the H100);
* the three branches and the gate mix run in ``kernels.decode.DecodeStep``.

Shapes: x [B, 1, D] -> out [B, 1, D]. The cache's host ``length`` is advanced by ``__call__``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.decode import DecodeStep, StepOut


@triton.jit
def _span_rows(X, SRC, PE, b, g, t, sb, st, G: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
               BL: tl.constexpr, BD: tl.constexpr, ADD_PE: tl.constexpr):
    i = tl.arange(0, BL)
    rows = tl.maximum(t - L + 1 + i, 0)
    cols = tl.arange(0, BD)
    ok = (i < L)[:, None] & (cols < D)[None, :]
    x = tl.load(SRC + b * sb + rows[:, None] * st + g * D + cols[None, :], mask=ok)
    if ADD_PE:
        x = x.to(tl.float32) + tl.load(PE + i[:, None] * D + cols[None, :], mask=ok).to(tl.float32)
    tl.store(X + (b * G + g) * L * D + i[:, None] * D + cols[None, :], x.to(X.dtype.element_ty), mask=ok)


@triton.jit
def _span_kernel(K, V, PE_K, PE_V, T, XK, XV, skb, skt, svb, svt,
                 G: tl.constexpr, L: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BL: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, ADD_PE: tl.constexpr):
    """Program (b, g): rows t−L+1 .. t of k and v (clamped at 0: such a span is never stored) for KV
    head g, + pe [L, d], -> XK[b, g] = [L·d_k] (row-major over (l, d)), XV likewise."""
    b, g = tl.program_id(0).to(tl.int64), tl.program_id(1)    # 64-bit: b · (T_max · G · d) may pass 2^31
    t = tl.load(T + b).to(tl.int64)
    _span_rows(XK, K, PE_K, b, g, t, skb, skt, G, L, DK, BL, BDK, ADD_PE)
    _span_rows(XV, V, PE_V, b, g, t, svb, svt, G, L, DV, BL, BDV, ADD_PE)


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


class LayerDecodeStep:
    """One NSA layer decode step for module ``m`` over ``cache`` (which holds ``cache.length``
    tokens, e.g. after a prefill); buffers and plan are made once, here."""

    def __init__(self, m, cache) -> None:
        self.m, self.cache, cfg = m, cache, m.cfg
        self.attn = DecodeStep(cfg, cache)
        B, G, l = cache.k.shape[0], cfg.n_kv_heads, cfg.cmp_len
        dev, dt = cache.k.device, cache.k.dtype
        assert cache.k_cmp.stride(2) == cfg.d_k and cache.v_cmp.stride(2) == cfg.d_v, "cache rows must be contiguous [G, d]"
        self.xk = torch.empty(B, G, l * cfg.d_k, device=dev, dtype=dt)      # φ's inputs, written by _span_kernel
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
        mlp = cfg.compress == "mlp"
        bd = (triton.next_power_of_2(cfg.d_k), triton.next_power_of_2(cfg.d_v))
        pe = (m.cmp_k.pe, m.cmp_v.pe) if mlp else (c.k, c.v)                # (unused without the MLP)
        _span_kernel[(B, G)](c.k, c.v, *pe, t, self.xk, self.xv, c.k.stride(0), c.k.stride(1),
                             c.v.stride(0), c.v.stride(1), G=G, L=l, DK=cfg.d_k, DV=cfg.d_v,
                             BL=triton.next_power_of_2(l), BDK=bd[0], BDV=bd[1], ADD_PE=mlp)
        if mlp:
            yk, yv = (phi.fc2(F.silu(phi.fc1(xx))) for phi, xx in ((m.cmp_k, self.xk), (m.cmp_v, self.xv)))
        else:
            yk, yv = self.xk.view(B, G, l, -1).mean(2), self.xv.view(B, G, l, -1).mean(2)
        _store_kernel[(B, G)](yk.contiguous(), yv.contiguous(), c.k_cmp, c.v_cmp, t, c.k_cmp.stride(0),
                              c.k_cmp.stride(1), c.v_cmp.stride(0), c.v_cmp.stride(1), G=G, L=l,
                              STRIDE=cfg.cmp_stride, DK=cfg.d_k, DV=cfg.d_v, BDK=bd[0], BDV=bd[1])
