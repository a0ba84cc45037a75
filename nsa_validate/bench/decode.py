"""The decode bench's inputs, shared by the ``decode`` suite and the Nsight Compute probe.

``make_inputs`` builds a decode cache of S tokens (random K/V and compressed K/V, NaN past them)
and the new token's tensors; ``python -m nsa_validate.bench.decode`` runs one eager decode step on
them between ``cudaProfilerStart``/``Stop``, the region ``ncu --profile-from-start off`` profiles
(``nsa_validate.ncu``). Same seed, same inputs: the suite and the probe measure the same step.
"""
from __future__ import annotations

import argparse

import torch

from nsa_core.config import PAPER, NSAConfig, tiny
from nsa_validate.tolerance import DTYPES


def layer_config(paper: bool) -> NSAConfig:
    """The decode bench's layer: the paper's (G=4, h=16, d_k 192 / d_v 128), or a tiny one."""
    return PAPER if paper else tiny(block_size=16, n_selected=4, window=64)


def make_inputs(cfg: NSAConfig, B: int, S: int, dtype: torch.dtype, device, seed: int):
    """A DecodeCache of capacity S holding tokens 0..S−2 (random K/V and compressed K/V; the rest
    NaN), and the new token's tensors {q [B, H, d_k], k_new [B, G, d_k], v_new [B, G, d_v],
    gate [B, H, 3], pos [B] int32 = S−1}."""
    from nsa_core import DecodeCache
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g).to(dtype)  # noqa: E731
    c = DecodeCache(cfg, B, S, device=device, dtype=dtype)
    t = S - 1
    G, N = cfg.n_kv_heads, cfg.n_cmp(t)
    c.k[:, :t], c.v[:, :t] = rnd(B, t, G, cfg.d_k), rnd(B, t, G, cfg.d_v)
    c.k_cmp[:, :N], c.v_cmp[:, :N] = rnd(B, N, G, cfg.d_k), rnd(B, N, G, cfg.d_v)
    new = dict(q=rnd(B, cfg.n_heads, cfg.d_k), k_new=rnd(B, G, cfg.d_k), v_new=rnd(B, G, cfg.d_v),
               gate=torch.rand(B, cfg.n_heads, 3, device=device, generator=g).to(dtype),
               pos=torch.full((B,), t, dtype=torch.int32, device=device))
    return c, new


def probe_seed(B: int, S: int) -> int:
    return B * 7919 + S


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="one eager NSA decode step inside cudaProfilerStart/Stop (for ncu)")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--config", default="paper", choices=["paper", "tiny"])
    a = ap.parse_args(argv)
    from kernels import decode
    cfg = layer_config(a.config == "paper")
    cache, new = make_inputs(cfg, a.batch, a.context, DTYPES[a.dtype], "cuda", probe_seed(a.batch, a.context))
    step = decode.DecodeStep(cfg, cache)
    with torch.no_grad():
        step(**new)                       # compiles the kernels outside the profiled region
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step(**new)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
