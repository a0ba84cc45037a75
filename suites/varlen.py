"""What the kernel suites share for packed variable-length batches: offsets and the oracle.

The oracle here only slices sequences and chunks query rows (to bound memory); the attention
itself is ``nsa_core.reference.masked_attention`` over an explicit mask the caller builds from
the reference's mask definitions.
"""
from __future__ import annotations

from typing import Callable

import torch

from nsa_core import reference

CHUNK = 256


def cu_seqlens(lens: list[int], device) -> torch.Tensor:
    """[B+1] int32 offsets of sequences of ``lens`` tokens packed one after the other."""
    return torch.tensor([0] + list(lens), device=device).cumsum(0).to(torch.int32)


def oracle_attention(q, k, v, lens_q: list[int], lens_k: list[int],
                     mask_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
                     dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per sequence, masked attention in ``dtype`` (differentiable): o [Tq or len(rows), H, d_v].

    q [Tq, H, d_k], k [Tk, G, d_k], v [Tk, G, d_v] packed by ``lens_q`` / ``lens_k``.
    ``mask_fn(rows, pos, n_keys)`` gets the global query rows of a chunk and their positions in
    their sequence and returns a bool mask broadcastable to [1, c, G, n_keys]. With ``rows``
    (sorted global query rows) only those rows are computed, and q holds just them.
    """
    G, dk = k.shape[1], k.shape[2]
    h = q.shape[1] // G
    out, q0, k0 = [], 0, 0
    for Sq, Sk in zip(lens_q, lens_k):
        r = torch.arange(q0, q0 + Sq, device=q.device) if rows is None else rows[(rows >= q0) & (rows < q0 + Sq)]
        kk, vv = k[k0:k0 + Sk].to(dtype)[None], v[k0:k0 + Sk].to(dtype)[None]
        for c in range(0, len(r), CHUNK):
            rc = r[c:c + CHUNK]
            qc = q[rc] if rows is None else q[torch.searchsorted(rows, rc)]
            o = reference.masked_attention(qc.to(dtype).view(1, len(rc), G, h, dk), kk, vv,
                                           mask_fn(rc, rc - q0, Sk), dk ** -0.5)
            out.append(o.reshape(len(rc), G * h, -1))
        q0, k0 = q0 + Sq, k0 + Sk
    return torch.cat(out) if out else q.new_zeros(0, q.shape[1], v.shape[2], dtype=dtype)
