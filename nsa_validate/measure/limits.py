"""What this device can physically do, and the check that every bench figure stays inside it.

A figure faster than the hardware allows is a bug (a timer that misses work, a graph that replays
nothing, bytes counted twice), not a result. Every timing a suite records goes through
``implausible``: a non-positive time fails, and so does

* achieved bandwidth (the fewest bytes the work must move / time) above the device's measured
  ceiling — the larger of a 1 GiB device copy (read + write) and a 1 GiB read — when those bytes
  come from DRAM (the L2 was flushed before each repetition, or the working set exceeds the L2);
* achieved arithmetic (the fewest FLOPs the work must do / time) above the profile's spec-sheet
  peak (``expect.peak_tflops``).

Bytes and FLOPs passed here are lower bounds of the work (each input read once, useful FLOPs
only), so the achieved figures are lower bounds too: a figure past a ceiling cannot be real.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Ceilings:
    copy_gbs: float | None          # measured 1 GiB -> 1 GiB copy, read + write bytes
    read_gbs: float | None          # measured read of 1 GiB
    l2_bytes: int | None
    peak_tflops: float | None       # spec sheet (profile)

    @property
    def bandwidth_gbs(self) -> float | None:
        known = [x for x in (self.copy_gbs, self.read_gbs) if x]
        return max(known) if known else None


@functools.cache
def measured_bandwidth() -> tuple[float, float]:
    """(copy GB/s, read GB/s) of the current CUDA device, measured once per process (eager CUDA
    events: a graph-captured 1 GiB copy reads lower on an H100)."""
    import torch

    from nsa_validate.measure import timing
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = timing.bench(lambda: dst.copy_(src), l2_flush=False, telemetry=False)
    words = src.view(torch.float32)
    read = timing.bench(lambda: words.sum(), l2_flush=False, telemetry=False)
    del src, dst, words
    return 2 * (1 << 30) / (copy.median_ms * 1e-3) / 1e9, (1 << 30) / (read.median_ms * 1e-3) / 1e9


def ceilings(device: str, peak_tflops: float | None) -> Ceilings:
    if device != "cuda":
        return Ceilings(None, None, None, None)
    import torch
    copy, read = measured_bandwidth()
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", None)
    return Ceilings(copy, read, l2, peak_tflops)


def achieved(summary: dict, nbytes: float | None, flops: float | None) -> dict:
    """GB/s and TFLOP/s of a ``Timing.summary()`` for the given work (None where not given)."""
    s = summary["median_ms"] * 1e-3
    return {"bytes": nbytes, "flops": flops,
            "achieved_gbs": nbytes / s / 1e9 if nbytes and s > 0 else None,
            "achieved_tflops": flops / s / 1e12 if flops and s > 0 else None}


def implausible(summary: dict, nbytes: float | None, flops: float | None, c: Ceilings) -> list[str]:
    """What about this timing the hardware cannot do ([] when nothing)."""
    problems = []
    if min(summary["samples_ms"], default=0.0) <= 0 or summary["median_ms"] <= 0:
        problems.append(f"non-positive time (median {summary['median_ms']:.4g} ms, "
                        f"min sample {min(summary['samples_ms'], default=0.0):.4g} ms)")
        return problems
    a = achieved(summary, nbytes, flops)
    from_dram = summary.get("l2_flush") or (c.l2_bytes is not None and nbytes is not None and nbytes > c.l2_bytes)
    if a["achieved_gbs"] and c.bandwidth_gbs and from_dram and a["achieved_gbs"] > c.bandwidth_gbs:
        problems.append(f"{a['achieved_gbs']:.0f} GB/s for {nbytes / 1e6:.1f} MB in {summary['median_ms']:.4g} ms "
                        f"exceeds the device's measured {c.bandwidth_gbs:.0f} GB/s (copy {c.copy_gbs:.0f}, "
                        f"read {c.read_gbs:.0f})")
    if a["achieved_tflops"] and c.peak_tflops and a["achieved_tflops"] > c.peak_tflops:
        problems.append(f"{a['achieved_tflops']:.0f} TFLOP/s for {flops / 1e9:.1f} GFLOP in {summary['median_ms']:.4g} ms "
                        f"exceeds the spec-sheet peak {c.peak_tflops:.0f} TFLOP/s")
    return problems
