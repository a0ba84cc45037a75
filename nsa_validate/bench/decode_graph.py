"""A stack of NSA layers decoded one token after another, as a model's generation loop runs them:
each layer's ``m.decode`` called from Python (each call replays that layer's own CUDA graph) vs
one CUDA graph of the caller's over every layer's ``m.decode`` (recorded into the caller's capture
after a warm-up call: ``kernels.routes.decode_layer``). Timed back to back, without an L2 flush:
at B=1 the host's pace is part of what a token costs.

``python -m nsa_validate.bench.decode_graph [--batch 1 --context 65536 --layers 4 --tokens 100]``
(a CUDA GPU; the paper's layer, bf16) prints a ``Row``. Both ways decode the same tokens over
caches of the same random contents; ``max_abs_diff`` is the largest difference between their
outputs over every token (the same kernels run: 0 expected).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import kernels  # noqa: F401  (registers the Triton routes: without it m.decode runs on torch, uncapturable)
from nsa_core.cuda_graph import capturing
from nsa_core.config import PAPER, NSAConfig
from nsa_validate.bench.decode import nsa_layer
from nsa_validate.measure.timing import bench


@dataclass
class Row:
    batch: int
    context: int              # tokens in each cache when the timed tokens start
    layers: int
    tokens: int               # tokens timed each way
    eager_ms: float           # median per token, each layer's m.decode from Python
    graph_ms: float           # median per token, one graph replay for the whole stack
    max_abs_diff: float       # largest |eager − graph| over the outputs of every token
    lengths: tuple[int, int]  # the caches' lengths after both runs (equal where the graph kept count)


def _caches(cfg: NSAConfig, batch: int, context: int, capacity: int, layers: int, dtype, device, seed: int):
    """One cache per layer holding ``context`` tokens of random K/V and compressed K/V."""
    from nsa_core import DecodeCache
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g).to(dtype)  # noqa: E731
    G, N, out = cfg.n_kv_heads, cfg.n_cmp_total(context), []
    for _ in range(layers):
        c = DecodeCache(cfg, batch, capacity, device=device, dtype=dtype)
        c.write_prefill(rnd(batch, context, G, cfg.d_k), rnd(batch, context, G, cfg.d_v),
                        rnd(batch, N, G, cfg.d_k), rnd(batch, N, G, cfg.d_v))
        out.append(c)
    return out


def stack_decode(cfg: NSAConfig = PAPER, batch: int = 1, context: int = 65536, layers: int = 4, tokens: int = 100,
                 dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0) -> Row:
    """``layers`` NSA layers (random weights, residual adds between them) over caches of
    ``context`` tokens: ``tokens`` decode steps timed each way (see the module docstring)."""
    mods = [nsa_layer(cfg, dtype, device, seed=seed + i) for i in range(layers)]
    warm = 2
    xs = torch.randn(batch, warm + tokens, cfg.d_model, device=device).to(dtype)
    capacity = context + xs.shape[1]
    eager_caches, graph_caches = (_caches(cfg, batch, context, capacity, layers, dtype, device, seed) for _ in range(2))

    def model(x, caches):
        for m, c in zip(mods, caches):
            x = x + m.decode(x, c)[0]
        return x

    outs: dict[str, list[torch.Tensor]] = {"eager": [], "graph": []}
    with torch.no_grad():
        for i in range(warm):                          # each layer's own graph is captured at its first call
            outs["eager"].append(model(xs[:, i:i + 1], eager_caches))
        outs["graph"].append(model(xs[:, :1], graph_caches))     # the warm-up the caller's capture needs
        static = xs[:, 1:2].clone()
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            y = model(static, graph_caches)
        graph.replay()
        outs["graph"].append(y.clone())
        fed = {"eager": iter(range(warm, xs.shape[1])), "graph": iter(range(warm, xs.shape[1]))}

        def eager():
            i = next(fed["eager"])
            outs["eager"].append(model(xs[:, i:i + 1], eager_caches))

        def replay():
            i = next(fed["graph"])
            static.copy_(xs[:, i:i + 1])
            graph.replay()
            outs["graph"].append(y.clone())

        # the graph's clone of y is one more launch than the eager loop's: a fair share of what a caller keeps
        t_eager = bench(eager, device=device, warmup=0, reps=tokens, l2_flush=False, telemetry=False)
        t_graph = bench(replay, device=device, warmup=0, reps=tokens, l2_flush=False, telemetry=False)
    n = min(len(outs["eager"]), len(outs["graph"]))
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs["eager"][:n], outs["graph"][:n]))
    return Row(batch, context, layers, n - warm, t_eager.median_ms, t_graph.median_ms, diff,
               (eager_caches[0].length, graph_caches[0].length))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=100)
    a = ap.parse_args(argv)
    print(stack_decode(batch=a.batch, context=a.context, layers=a.layers, tokens=a.tokens))


if __name__ == "__main__":
    main()
