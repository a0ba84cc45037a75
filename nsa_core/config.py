"""Typed configuration of one NSA attention layer (docs/nsa.md).

Notation follows the paper (arXiv 2502.11089): G KV heads, h query heads per group
(H = G·h query heads), compression block length l with stride d, selection block
length l' (``block_size``), n selected blocks (``n_selected``, counting the forced
initial and two local blocks), sliding window w.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

BRANCHES = ("cmp", "sel", "win")    # compressed, selected, sliding window: the gate's order


@dataclass(frozen=True)
class NSAConfig:
    d_model: int = 1024
    n_kv_heads: int = 4          # G
    heads_per_group: int = 16    # h
    d_k: int = 192
    d_v: int = 128
    cmp_len: int = 32            # l
    cmp_stride: int = 16         # d
    block_size: int = 64         # l'
    n_selected: int = 16         # n, including block 0 and the two local blocks
    window: int = 512            # w
    compress: str = "mlp"        # "mlp" (φ = MLP with intra-block position encoding) | "mean"

    def __post_init__(self) -> None:
        for name in ("d_model", "n_kv_heads", "heads_per_group", "d_k", "d_v",
                     "cmp_len", "cmp_stride", "block_size", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"NSAConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_selected < 3:
            raise ValueError("NSAConfig.n_selected must be >= 3 (block 0 and two local blocks are forced)")
        if self.cmp_stride > self.cmp_len:
            raise ValueError("NSAConfig.cmp_stride must be <= cmp_len (spans would leave gaps)")
        if self.compress not in ("mlp", "mean"):
            raise ValueError(f"NSAConfig.compress must be 'mlp' or 'mean', got {self.compress!r}")

    @property
    def n_heads(self) -> int:
        """H = G·h query heads."""
        return self.n_kv_heads * self.heads_per_group

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d_k)

    # -- counts of docs/nsa.md, as plain integer functions of the absolute position t --------
    def n_cmp(self, t: int) -> int:
        """Compressed tokens usable by query t: token i needs i·d + l − 1 <= t."""
        return 0 if t + 1 < self.cmp_len else (t + 1 - self.cmp_len) // self.cmp_stride + 1

    def n_cmp_total(self, seq_len: int) -> int:
        """Compressed tokens that exist once seq_len raw tokens are known."""
        return self.n_cmp(seq_len - 1) if seq_len > 0 else 0

    def n_blocks(self, seq_len: int) -> int:
        return -(-seq_len // self.block_size)

    def expected_reads(self, t: int) -> dict[str, int]:
        """Formula of docs/nsa.md: KV tokens read per KV head by the decode step at position t."""
        nb = -(-(t + 1) // self.block_size)
        sel = min(self.n_selected, nb) * self.block_size - (nb * self.block_size - (t + 1))
        return {"cmp": self.n_cmp(t), "sel": sel, "win": min(self.window, t + 1)}

    def to_dict(self) -> dict:
        return asdict(self)


PAPER = NSAConfig()
"""The paper's efficiency configuration: G=4, h=16, d_k=192, d_v=128, l=32, d=16, l'=64, n=16, w=512."""


def tiny(**overrides) -> NSAConfig:
    """A small configuration for CPU tests: every branch and corner still exercised."""
    base = dict(d_model=32, n_kv_heads=2, heads_per_group=2, d_k=16, d_v=8,
                cmp_len=8, cmp_stride=4, block_size=8, n_selected=4, window=12)
    base.update(overrides)
    return NSAConfig(**base)
