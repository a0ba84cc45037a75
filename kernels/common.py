"""What every Triton kernel of the package shares: the log2(e) constant of the exp2-based softmax,
padded tile sizes, and the ``tl.dot`` precision per input dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634                  # softmax runs on exp2: scores are scaled by log2(e)
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)   # the same constant, usable inside kernels


def pow2(x: int, lo: int = 16) -> int:
    """A tile size for x: the next power of two, at least ``lo`` (tl.dot needs 16)."""
    return max(lo, triton.next_power_of_2(x))


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: fp32 inputs must not be rounded to tf32 (the fp32 cases are
    compared at the fp32 floor); fp16/bf16 inputs are exact in either."""
    return "ieee" if dtype == torch.float32 else "tf32"
