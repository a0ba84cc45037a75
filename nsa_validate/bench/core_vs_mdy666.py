"""NSA attention without the layer's projections, this repo's kernels vs the public reference the
layer's targets were set from (mdy666/Scalable-Flash-Native-Sparse-Attention, ``flash_nsa``), on
the GPU at hand, timed by the harness's one timing helper.

What its README benchmarks, and what this times for both: q [T, 64, 128], k and v [T, 4, 128] and
the gate weights in, o out (no q/k/v or output projection, no gate MLP); k and v compressed by mean
pooling over spans of 32 tokens with stride 16 (its default, and here ``unfold().mean()`` in torch,
inside the timed call), selection blocks of 64, 16 selected, a window of 512, bf16, B = 1, forward
and the backward of one forward's output. Ours is ``kernels.branches.nsa_branches`` (the op the
layer runs when every prefill stage routes to Triton); its gates are taken as given, theirs go
through a sigmoid in their combine kernel.

``PYTHONPATH=/path/to/Scalable-Flash-Native-Sparse-Attention python -m nsa_validate.bench.core_vs_mdy666
[--lengths 16384 65536]`` (a CUDA GPU) prints one ``Row`` per implementation and length. Without
``flash_nsa`` importable only ours runs, and the run says so. Its window runs on flash-attn 3 where
installed, else flash-attn 2 (``Row.note``).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from kernels import branches
from kernels.compressed import cmp_cu_seqlens
from nsa_validate.measure.timing import bench

H, G, D = 64, 4, 128
L_CMP, D_CMP, BLOCK, N_SEL, WINDOW = 32, 16, 64, 16, 512


@dataclass
class Row:
    impl: str
    seq_len: int
    fwd_ms: float            # median, forward
    fwd_p20_p80: tuple[float, float]
    bwd_ms: float            # median, backward of one forward's output (gradients set to None first)
    bwd_p20_p80: tuple[float, float]
    peak_gib: float          # torch's peak allocation over the forward, backward and their timing
    note: str = ""


def _inputs(S: int, seed: int = 0):
    """q [S, H, D], k and v [S, G, D], gates [S, H, 3] (bf16, leaves wanting gradients), cu_seqlens [0, S]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(S, H, D, **kw).requires_grad_()
    k = torch.randn(S, G, D, **kw).requires_grad_()
    v = torch.randn(S, G, D, **kw).requires_grad_()
    gate = torch.rand(S, H, 3, **kw).requires_grad_()
    cu = torch.tensor([0, S], device="cuda", dtype=torch.int32)
    return q, k, v, gate, cu


def _time(name: str, S: int, fwd, leaves, note: str = "") -> Row:
    o = fwd()
    do = torch.randn_like(o)
    o.backward(do, retain_graph=True)

    def bwd():
        for x in leaves:
            x.grad = None
        o.backward(do, retain_graph=True)
    f, b = bench(fwd), bench(bwd)
    torch.cuda.synchronize()
    return Row(name, S, f.median_ms, (f.p20_ms, f.p80_ms), b.median_ms, (b.p20_ms, b.p80_ms),
               torch.cuda.max_memory_allocated() / 2**30, note)


def ours(S: int) -> Row:
    q, k, v, gate, cu = _inputs(S)
    cu_cmp = cmp_cu_seqlens(cu, L_CMP, D_CMP)
    sh = branches.Shape(L_CMP, D_CMP, BLOCK, N_SEL, WINDOW, D ** -0.5, S)

    def fwd():
        k_cmp = k.unfold(0, L_CMP, D_CMP).mean(-1)       # [N, G, D]: mean of each span
        v_cmp = v.unfold(0, L_CMP, D_CMP).mean(-1)
        return branches.nsa_branches(gate, q, k, v, k_cmp, v_cmp, cu, cu_cmp, sh)[0]
    return _time("nsa-validate", S, fwd, [q, k, v, gate])


def theirs(S: int) -> Row:
    from flash_nsa import HFNSACore, NSAConfig
    from flash_nsa.ops import sliding_window_attention as swa
    cfg = NSAConfig()
    got = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.kernel_size, cfg.stride, cfg.block_size, cfg.top_n,
           cfg.window_size, cfg.cmp_k_method, cfg.cmp_v_method)
    want = (H, G, D, L_CMP, D_CMP, BLOCK, N_SEL, WINDOW, "mean", "mean")
    if got != want:
        raise SystemExit(f"flash_nsa's default NSAConfig is {got}, not the {want} this compares at")
    q, k, v, w, cu = _inputs(S)
    core = HFNSACore(cfg).to(q)
    note = f"window on flash-attn {'3' if swa.HAVE_FA3 else '2' if swa.HAVE_FA2 else 'none'}"
    return _time("mdy666 flash_nsa", S, lambda: core(q, k, v, w, cu), [q, k, v, w], note)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("core_vs_mdy666 needs a CUDA GPU")
    try:
        import flash_nsa  # noqa: F401
        impls = [ours, theirs]
    except ImportError as e:
        print(f"flash_nsa not importable ({e}); timing this repo's op only", file=sys.stderr)
        impls = [ours]
    print(torch.cuda.get_device_name())
    for S in args.lengths:
        for impl in impls:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            print(impl(S), flush=True)


if __name__ == "__main__":
    main()
