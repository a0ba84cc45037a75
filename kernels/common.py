"""What every Triton kernel of the package shares: the log2(e) constant of the exp2-based softmax,
padded tile sizes, the ``tl.dot`` precision per input dtype, and launching with the first
settings the GPU at hand can load (``launch_fitting``)."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from nsa_core import dispatch

LOG2E = 1.4426950408889634                  # softmax runs on exp2: scores are scaled by log2(e)
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)   # the same constant, usable inside kernels


def pow2(x: int, lo: int = 16) -> int:
    """A tile size for x: the next power of two, at least ``lo`` (tl.dot needs 16)."""
    return max(lo, triton.next_power_of_2(x))


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: fp32 inputs must not be rounded to tf32 (the fp32 cases are
    compared at the fp32 floor); fp16/bf16 inputs are exact in either."""
    return "ieee" if dtype == torch.float32 else "tf32"


# -- launch settings that fit the GPU at hand --------------------------------------------------
# A kernel's launch settings were measured on one GPU (its ``launch_configs`` docstring says
# which); a GPU with less shared memory per block (sm80: 163 KiB, sm86/sm89: 99 KiB; sm90: 227 KiB)
# cannot load the same tiles. Each launcher therefore lists the measured settings first and smaller
# ones after, and runs the first that this GPU can load. Triton raises OutOfResources when it loads
# the compiled kernel, before anything runs, so moving on is safe.
try:
    from triton.runtime import OutOfResources
except ImportError:                    # a triton without it never raises it
    class OutOfResources(Exception):   # type: ignore[no-redef]
        pass

_FITS: dict[tuple, int] = {}           # (kernel, device, specialisation) -> the index that loaded
_FORCED: list[int] = []                # tests: start from this index (``forced_config``)


def launch_fitting(kernel: str, spec: tuple, configs: list[dict], launch):
    """``launch(config)`` with the first of ``configs`` (a copy) that this GPU loads, remembered
    per (kernel, spec: device and specialisation); the last one's OutOfResources propagates. A
    launch that needed smaller settings than the measured ones shows in the dispatch log
    (``kernel/<kernel>@settings<i>``), and so in routing.json. Returns what ``launch`` returned."""
    key = (kernel, *spec)
    start = min(_FORCED[-1] if _FORCED else _FITS.get(key, 0), len(configs) - 1)
    for i in range(start, len(configs)):
        try:
            out = launch(dict(configs[i]))
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _FITS[key] = i
        if i:
            dispatch.note("kernel", f"{kernel}@settings{i}", "triton")
        return out


@contextmanager
def forced_config(index: int):
    """``with forced_config(i):`` launches start from settings i (so a test on any machine runs
    the smaller settings a smaller GPU would)."""
    _FORCED.append(index)
    try:
        yield
    finally:
        _FORCED.pop()
