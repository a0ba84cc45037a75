"""Preallocated decode cache for NSA (raw K/V, compressed K/V).

The raw K/V buffers double as the sliding window (the window branch reads the last w rows of
them), so appending a token is O(1): one row written, plus one compressed token whenever a
compression span completes. Nothing is re-concatenated per step.

Buffers are created filled with NaN: a branch that reads a row nobody wrote produces NaN in
its output, which every suite checks for. Layouts: k [B, T_max, G, d_k], v [B, T_max, G, d_v],
k_cmp [B, N_max, G, d_k], v_cmp [B, N_max, G, d_v]. All batch rows share one position: ``length``
on the host, and ``pos`` [B] int32 on the device (the position of the token appended last, the t
a decode kernel reads without asking the host). ``kernel_state`` holds what a decode
implementation sets up once per cache (the Triton step's plan and workspace), not per token; what
it holds refers back to the cache weakly, so that a dropped cache is freed at once, CUDA graphs
and all (``nsa_core.cuda_graph`` says why that matters).

A decode step recorded into a caller's CUDA graph advances the position on the device at every
replay, which the host cannot count: from then on (``device_owned``) ``length`` is read from
``pos`` (one device sync per read, none while a graph is being captured), and a replay on a full
cache, which rewrites the last row (its token is lost) rather than writing past the buffers, sets
``overflow``, which makes that read raise. Host-side writes (``append``) are then refused by the
module: the graph would not see them.
"""
from __future__ import annotations

import torch

from nsa_core.config import NSAConfig


class DecodeCache:
    def __init__(self, cfg: NSAConfig, batch: int, max_len: int, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.cfg, self.max_len = cfg, max_len
        G = cfg.n_kv_heads
        nan = float("nan")
        self.k = torch.full((batch, max_len, G, cfg.d_k), nan, device=device, dtype=dtype)
        self.v = torch.full((batch, max_len, G, cfg.d_v), nan, device=device, dtype=dtype)
        n_max = max(cfg.n_cmp_total(max_len), 1)
        self.k_cmp = torch.full((batch, n_max, G, cfg.d_k), nan, device=device, dtype=dtype)
        self.v_cmp = torch.full((batch, n_max, G, cfg.d_v), nan, device=device, dtype=dtype)
        self._length = 0
        self.pos = torch.zeros(batch, dtype=torch.int32, device=device)
        self.overflow = torch.zeros(1, dtype=torch.int32, device=device)   # set by device work past max_len
        self.device_owned = False
        self.kernel_state: dict = {}

    @property
    def length(self) -> int:
        """Tokens held. Kept on the host, except once ``device_owned``: then read from ``pos``,
        where an ``overflow`` raises (outside a capture; inside one, the host's count as last read
        or set)."""
        if self.device_owned and not _capturing(self.pos):
            pos, over = torch.cat([self.pos[:1], self.overflow]).tolist()
            if over:
                raise ValueError(f"DecodeCache full: a decode step replayed from a CUDA graph ran past max_len "
                                 f"{self.max_len}; the outputs of such replays are not valid")
            self._length = pos + 1
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        self._length = n

    def advanced(self) -> None:
        """Device work appended one token and moved ``pos``: count it on the host, where the host
        counts (not once ``device_owned``: ``pos`` has it)."""
        if not self.device_owned:
            self._length += 1

    @property
    def n_cmp(self) -> int:
        return self.cfg.n_cmp_total(self.length)

    def _check_room(self, n: int) -> None:
        if (held := self.length) + n > self.max_len:
            raise ValueError(f"DecodeCache full: {held} + {n} > max_len {self.max_len}")

    def write_prefill(self, k, v, k_cmp, v_cmp) -> None:
        """Store a whole prefill (cache must be empty). k [B, S, G, d_k] …, k_cmp [B, N, G, d_k] …"""
        if self.length:
            raise ValueError("write_prefill needs an empty cache")
        S = k.shape[1]
        self._check_room(S)
        self.k[:, :S], self.v[:, :S] = k, v
        N = k_cmp.shape[1]
        self.k_cmp[:, :N], self.v_cmp[:, :N] = k_cmp, v_cmp
        self.length = S
        self.pos.fill_(S - 1)
        self.overflow.zero_()

    def append(self, k, v) -> tuple[int, int] | None:
        """Write token t = length (k [B, 1, G, d_k], v likewise). Returns the raw span
        (start, end) of the compressed token that this token completes, or None."""
        self._check_room(1)
        t = self.length
        self.k[:, t:t + 1], self.v[:, t:t + 1] = k, v
        self.length = t + 1
        self.pos.fill_(t)                  # a fill kernel with t as its argument: no copy, no sync
        cfg = self.cfg
        if t + 1 >= cfg.cmp_len and (t + 1 - cfg.cmp_len) % cfg.cmp_stride == 0:
            start = t + 1 - cfg.cmp_len
            return start, t + 1
        return None

    def copy_rows(self, n: int, row: int = 0) -> "DecodeCache":
        """A new cache of n identical batch rows, each a copy of row ``row`` (same length)."""
        c = DecodeCache.__new__(DecodeCache)
        c.cfg, c.max_len, c._length, c.kernel_state, c.device_owned = self.cfg, self.max_len, self.length, {}, False
        c.overflow = torch.zeros_like(self.overflow)
        for name in ("k", "v", "k_cmp", "v_cmp"):
            setattr(c, name, getattr(self, name)[row:row + 1].repeat(n, 1, 1, 1))
        c.pos = self.pos[row:row + 1].repeat(n)
        return c


def _capturing(t: torch.Tensor) -> bool:
    """Whether t's GPU's current stream is capturing a CUDA graph (where a sync is not allowed)."""
    if not t.is_cuda:
        return False
    with torch.cuda.device(t.device):
        return torch.cuda.is_current_stream_capturing()
