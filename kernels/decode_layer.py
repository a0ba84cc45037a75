"""The whole NSA layer's decode step on the Triton kernels, with nothing the host must compute.

``NSAAttention.decode`` (the module's API) appends on the host, runs φ only when a compressed
span completes (an ``if`` on a host integer) and mixes the branches in torch. ``LayerDecodeStep``
does the same work as device operations of fixed shapes, so a whole layer step (projections,
append, φ, gate, attention, gated mix, output projection) can be captured in a CUDA graph:

* the position lives on the device (``next_t`` [B] int32, advanced by the step itself);
* φ runs every step over the l tokens ending at t, and its result is written to compressed slot
  (t+1−l)/d only when token t completes that span (elsewhere the slot's own value is written
  back): one small MLP per step instead of a data-dependent branch;
* the three branches and the gate mix run in ``kernels.decode.DecodeStep``.

Shapes: x [B, 1, D] -> out [B, 1, D]. The cache's host ``length`` is advanced by ``__call__``.
"""
from __future__ import annotations

import torch

from kernels.decode import DecodeStep, StepOut


class LayerDecodeStep:
    """One NSA layer decode step for module ``m`` over ``cache`` (which holds ``cache.length``
    tokens, e.g. after a prefill); buffers and plan are made once, here."""

    def __init__(self, m, cache) -> None:
        self.m, self.cache, cfg = m, cache, m.cfg
        self.attn = DecodeStep(cfg, cache)
        B = cache.k.shape[0]
        dev = cache.k.device
        self.rows = torch.arange(B, device=dev)
        self.span = torch.arange(cfg.cmp_len, device=dev)
        self.next_t = torch.full((B,), cache.length, dtype=torch.int32, device=dev)
        self.last: StepOut | None = None

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
        return out

    def _compress(self, t: torch.Tensor) -> None:
        """φ over raw tokens t−l+1 .. t into compressed slot (t+1−l)/d, where t completes it."""
        m, c, cfg = self.m, self.cache, self.m.cfg
        l, d = cfg.cmp_len, cfg.cmp_stride
        t64 = t.long()
        at = (t64[:, None] - l + 1 + self.span).clamp(min=0)               # [B, l]
        done = (t64 + 1 >= l) & ((t64 + 1 - l) % d == 0)                    # [B]
        slot = torch.where(done, (t64 + 1 - l).clamp(min=0) // d, 0)
        for raw, comp, phi in ((c.k, c.k_cmp, m.cmp_k), (c.v, c.v_cmp, m.cmp_v)):
            new = phi(raw[self.rows[:, None], at])[:, 0]                    # [B, G, d]
            comp[self.rows, slot] = torch.where(done[:, None, None], new, comp[self.rows, slot])
