"""Triton sliding-window attention (NSA's window branch), forward and backward.

Query t of a sequence attends to keys max(0, t − w + 1) .. t of its own sequence. These are the
compressed-attention kernels (``kernels/compressed.py``) with every raw token as a key (span
length and stride 1) and their WINDOW bound set: group-centric (one program holds the h query
heads of a KV group, so each K/V tile it loads serves them all), d_v may differ from d_k with no
padding, deterministic (no atomics), 64-bit offsets, K/V tiles through tensor descriptors where
the GPU has them. A tile of query tokens walks only the chunks its window covers, and the dk/dv
kernel only the queries whose windows hold its keys.

Faster than flash-attn's sliding window at 64k, forward and forward+backward, at d 128 and at
d_k 192 / d_v 128 (docs/decisions.md).

Layouts (packed variable length, like flash-attn's varlen API):
    q [T, H, d_k], k [T, G, d_k], v [T, G, d_v], cu_seqlens [B + 1] int32;
    o [T, H, d_v] in q's dtype, lse [T, H] fp32 (natural log).
"""
from __future__ import annotations

import torch

from kernels import compressed
from kernels.common import cu_or_one


def window_attention_fwd(q, k, v, window: int, cu_seqlens=None, *, scale=None, max_seqlen: int | None = None,
                         out=None, lse=None, mix=None, keep_o: bool = True):
    """Forward launcher: (o [T, H, d_v], lse [T, H] fp32). ``out``/``lse`` may be given (e.g.
    NaN-poisoned buffers in tests); every row of both is written. ``mix`` = (g [T, H, 3], o_cmp,
    o_sel): also NSA's gated sum of the three branches in the same launch, returned third (and
    ``keep_o=False`` leaves o unstored: None); see ``compressed.compressed_attention_fwd``."""
    cu, max_seqlen = _sequences(q, cu_seqlens, max_seqlen)
    return compressed.compressed_attention_fwd(q, k, v, 1, 1, cu, cu, scale=scale, max_seqlen=max_seqlen,
                                               out=out, lse=lse, window=_check(window), mix=mix, keep_o=keep_o)


def window_attention_bwd(do, q, k, v, o, lse, window: int, cu_seqlens=None, *, scale=None,
                         max_seqlen: int | None = None):
    """Backward launcher: (dq [T, H, d_k], dk [T, G, d_k], dv [T, G, d_v]) in q's dtype; every row written."""
    cu, max_seqlen = _sequences(q, cu_seqlens, max_seqlen)
    return compressed.compressed_attention_bwd(do, q, k, v, o, lse, 1, 1, cu, cu, scale=scale, max_seqlen=max_seqlen,
                                               window=_check(window))


def _sequences(q, cu_seqlens, max_seqlen):
    """(cu_seqlens, max_seqlen), one sequence of all of q's tokens where cu_seqlens is None."""
    cu, one = cu_or_one(cu_seqlens, q.shape[0], q.device)
    return cu, one if max_seqlen is None else max_seqlen


def _check(window: int) -> int:
    if window < 1:
        raise ValueError(f"window must be at least 1; got {window}")
    return window


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                     cu_seqlens: torch.Tensor | None = None, *, scale: float | None = None,
                     max_seqlen: int | None = None) -> torch.Tensor:
    """Sliding-window causal attention, differentiable in q, k and v: o [T, H, d_v].

    q [T, H, d_k], k [T, G, d_k], v [T, G, d_v] (packed sequences, fp16/bf16, or fp32); ``window``
    w >= 1 keys per query (itself and the w − 1 before it); cu_seqlens [B+1] int32 (None: one
    sequence of T tokens); scale defaults to 1/sqrt(d_k); max_seqlen (the longest sequence)
    avoids a device sync when given.
    """
    cu, max_seqlen = _sequences(q, cu_seqlens, max_seqlen)
    o, _ = compressed.CompressedAttention.apply(q, k, v, 1, 1, cu, cu, scale, max_seqlen, _check(window))
    return o
