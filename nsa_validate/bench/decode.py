"""The decode bench's workloads, shared by the ``decode`` suite and the Nsight Compute probe.

``make_inputs`` builds a decode cache of S tokens (random K/V and compressed K/V, NaN past them)
and the new token's tensors; ``python -m nsa_validate.bench.decode`` runs one eager decode step on
them between ``cudaProfilerStart``/``Stop``, the region ``ncu --profile-from-start off`` profiles
(``nsa_validate.measure.ncu``). Same seed, same inputs: the suite and the probe measure the same step.

``nsa_layer`` + ``kernels.decode_layer.LayerDecodeStep`` are the whole NSA layer's decode step
(projections, append, φ, gate, attention, output projection); ``DenseDecode`` is the dense
layer's decode step it is judged against, attention alone or the whole layer.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

from nsa_core.config import PAPER, NSAConfig, tiny
from nsa_validate.measure.tolerance import DTYPES


def layer_config(paper: bool) -> NSAConfig:
    """The decode bench's layer: the paper's (G=4, h=16, d_k 192 / d_v 128), or a tiny one."""
    return PAPER if paper else tiny(block_size=16, n_selected=4, window=64)


def make_inputs(cfg: NSAConfig, B: int, S: int, dtype: torch.dtype, device, seed: int, capacity: int | None = None):
    """A DecodeCache of ``capacity`` tokens (default S: full once the new token is in) holding tokens
    0..S−2 (random K/V and compressed K/V; every other row NaN), and the new token's tensors
    {q [B, H, d_k], k_new [B, G, d_k], v_new [B, G, d_v], gate [B, H, 3], pos [B] int32 = S−1}. The
    same seed gives the same tokens whatever the capacity."""
    from nsa_core import DecodeCache
    if capacity is not None and capacity < S:
        raise ValueError(f"capacity {capacity} < context {S}")
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g).to(dtype)  # noqa: E731
    c = DecodeCache(cfg, B, capacity or S, device=device, dtype=dtype)
    t = S - 1
    G, N = cfg.n_kv_heads, cfg.n_cmp(t)
    c.k[:, :t], c.v[:, :t] = rnd(B, t, G, cfg.d_k), rnd(B, t, G, cfg.d_v)
    c.k_cmp[:, :N], c.v_cmp[:, :N] = rnd(B, N, G, cfg.d_k), rnd(B, N, G, cfg.d_v)
    new = dict(q=rnd(B, cfg.n_heads, cfg.d_k), k_new=rnd(B, G, cfg.d_k), v_new=rnd(B, G, cfg.d_v),
               gate=torch.rand(B, cfg.n_heads, 3, device=device, generator=g).to(dtype),
               pos=torch.full((B,), t, dtype=torch.int32, device=device))
    return c, new


def nsa_layer(cfg: NSAConfig, dtype: torch.dtype, device, seed: int = 0):
    """An ``NSAAttention`` with random weights whose decode runs on the Triton kernels."""
    from nsa_core import NSAAttention
    from nsa_core.routing import RoutingPolicy
    torch.manual_seed(seed)
    return NSAAttention(cfg, RoutingPolicy(decode_backend="triton")).to(device=device, dtype=dtype)


def same_bytes_head_dim(cfg: NSAConfig) -> int:
    """(d_k + d_v)/2 rounded up to a multiple of 8: one head dim for k and v (as FA-2 needs) that
    reads the same K+V bytes per token as the dense layer's d_k + d_v."""
    return 8 * -(-(cfg.d_k + cfg.d_v) // 16)


class DenseDecode:
    """A dense attention layer's decode step over a cache of S tokens (the new token at t = S−1):
    the baseline NSA's decode is judged against. Same heads (H query, G KV) and model width D.

    ``attention``: "sdpa" (``F.scaled_dot_product_attention``; on a GPU fused backends only, since a
    silent fallback to the math path would flatter NSA) or "flash_attn" (``flash_attn_with_kvcache``).
    Head dims ``d_qk`` for q and k, ``d_v`` for v; ``k``/``v`` [B, S, G, d] reuse existing buffers
    (else random ones are made). ``attend()``: append the new token's k/v at t and attend over all
    S tokens -> [B, H, d_v] (new token's q/k/v random, fixed); ``layer(x)``: x [B, 1, D] ->
    q/k/v projections, append + attention, output projection -> [B, 1, D]."""

    def __init__(self, cfg: NSAConfig, B: int, S: int, dtype, device, *, attention: str, d_qk: int,
                 d_v: int, k=None, v=None, seed: int = 0) -> None:
        self.cfg, self.attention, self.gpu = cfg, attention, torch.device(device).type == "cuda"
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_model
        g = torch.Generator(device=device).manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, device=device, generator=g).to(dtype)  # noqa: E731
        self.k = rnd(B, S, G, d_qk) if k is None else k
        self.v = rnd(B, S, G, d_v) if v is None else v
        self.new = (rnd(B, H, d_qk), rnd(B, G, d_qk), rnd(B, G, d_v))
        self.rows = torch.arange(B, device=device)
        self.at = torch.full((B,), S - 1, dtype=torch.long, device=device)
        self.seqlens = torch.full((B,), S, dtype=torch.int32, device=device)
        torch.manual_seed(seed)
        self.proj = nn.ModuleDict(dict(q=nn.Linear(D, H * d_qk, bias=False), k=nn.Linear(D, G * d_qk, bias=False),
                                       v=nn.Linear(D, G * d_v, bias=False), o=nn.Linear(H * d_v, D, bias=False)))
        self.proj.to(device=device, dtype=dtype)
        if attention == "flash_attn":
            from flash_attn import flash_attn_with_kvcache
            self._fa = flash_attn_with_kvcache
        elif attention != "sdpa":
            raise ValueError(f"attention must be 'sdpa' or 'flash_attn', got {attention!r}")

    def attend(self, q=None, k_new=None, v_new=None) -> torch.Tensor:
        if q is None:
            q, k_new, v_new = self.new
        B, H = q.shape[:2]
        self.k[self.rows, self.at], self.v[self.rows, self.at] = k_new, v_new
        if self.attention == "flash_attn":
            return self._fa(q.view(B, 1, H, -1), self.k, self.v, cache_seqlens=self.seqlens,
                            softmax_scale=self.cfg.scale).view(B, H, -1)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        G = self.cfg.n_kv_heads
        allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION] \
            if self.gpu else [SDPBackend.MATH]
        # the h query heads of a group are the rows of one query block over that group's K/V
        # (exact for one new token: it attends to every cached token)
        with sdpa_kernel(allowed):
            o = F.scaled_dot_product_attention(q.view(B, G, H // G, -1), self.k.transpose(1, 2),
                                               self.v.transpose(1, 2), scale=self.cfg.scale)
        return o.reshape(B, H, -1)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        B, H, G = x.shape[0], self.cfg.n_heads, self.cfg.n_kv_heads
        x = x[:, 0]
        o = self.attend(self.proj["q"](x).view(B, H, -1), self.proj["k"](x).view(B, G, -1),
                        self.proj["v"](x).view(B, G, -1))
        return self.proj["o"](o.reshape(B, -1))[:, None]


def dense_decodes(cfg: NSAConfig, cache, dtype, device, *, flash_attn: bool) -> dict[str, DenseDecode]:
    """The dense baselines for a cache of S tokens (``make_inputs``'s):

    * ``sdpa``: k at d_k, v at d_v, over the NSA cache's own K/V buffers: the dense layer's bytes;
    * ``flash_attn`` (when ``flash_attn``): where d_k ≠ d_v, at ``same_bytes_head_dim`` for k and v
      (the same K+V bytes on flash-attn's kernel);
    * ``flash_attn_padded`` (when ``flash_attn`` and d_k ≠ d_v): v zero-padded to d_k, reading
      2·d_k per token, more than the dense layer needs (a labelled second column, never the headline).
    """
    B, S = cache.k.shape[:2]
    out = {"sdpa": DenseDecode(cfg, B, S, dtype, device, attention="sdpa", d_qk=cfg.d_k, d_v=cfg.d_v,
                               k=cache.k, v=cache.v, seed=B)}
    if flash_attn:
        d = cfg.d_k if cfg.d_k == cfg.d_v else same_bytes_head_dim(cfg)
        out["flash_attn"] = DenseDecode(cfg, B, S, dtype, device, attention="flash_attn", d_qk=d, d_v=d, seed=B + 1)
        if cfg.d_k != cfg.d_v:
            out["flash_attn_padded"] = DenseDecode(cfg, B, S, dtype, device, attention="flash_attn",
                                                   d_qk=cfg.d_k, d_v=cfg.d_k, seed=B + 2)
    return out


def loop_rows(calls: int, device, warmup: int = 3) -> int:
    """Tokens ``decode_loop`` appends: one a call of ``timing.loop`` (``timing.loop_calls``)."""
    from nsa_validate.measure import timing
    return timing.loop_calls(calls, torch.device(device).type, warmup)


def loop_start(S: int, calls: int, device, warmup: int = 3) -> int:
    """The position ``decode_loop`` starts at for a context of S tokens: its last token is the bench's, t = S−1,
    so the loop's calls run the plan of the layer step timed there (``kernels.decode.horizon``: one plan for
    positions S/2 .. S−1 of a power-of-two S), and no plan is set up after its first call."""
    n = loop_rows(calls, device, warmup)
    if n > S:
        raise ValueError(f"the decode loop appends {n} tokens, more than the context of {S}")
    return S - n


def decode_loop(m, cache, t: int, calls: int, device, warmup: int = 3, warmed=None):
    """``NSAAttention.decode`` called token after token from position t, as the README's usage calls it
    (``timing.loop``): ``cache`` must hold tokens 0..t−1 and have room for ``loop_rows`` more (on a GPU
    the loop is made twice: once timed by the clock and events, once for the host's cost). New random
    tokens x [B, 1, D]; their compressed spans complete every d tokens on the way. ``warmed``: called
    after the first warm-up call (``timing.loop``). The benches start at ``loop_start``. -> timing.LoopTiming."""
    from nsa_validate.measure import timing
    B, D = cache.k.shape[0], m.cfg.d_model
    n = loop_rows(calls, device, warmup)
    if t + n > cache.max_len:
        raise ValueError(f"the decode loop needs {t + n} rows, the cache has {cache.max_len}")
    # one tensor a token, made before the loop: the loop's body is the call, not an index into a batch of tokens
    # (~1 µs of the host's time a call on an H200 pod, which a user's loop making its next token does not spend)
    xs = torch.randn(n, B, 1, D, device=device).to(cache.k.dtype).unbind(0)
    cache.length = t
    with torch.no_grad():
        return timing.loop(lambda i: m.decode(xs[i], cache), calls, device=torch.device(device).type,
                           warmup=warmup, warmed=warmed)


READY, GO = "ready", "go"       # ``FreshLoop``'s handshake, one line each way


class FreshLoop:
    """``decode_loop`` (B, S, a cache of ``capacity`` rows, ``calls`` tokens up to S−1, the layer's weights from
    ``seed``) in a new Python process, ``python -m nsa_validate.bench.decode --loop N --wait``: as a user's script
    runs it, with none of the harness's state (inside a suite's process the host's cost a call came out up to twice
    a fresh process's: docs/decisions.md). The process starts, builds its cache (``capacity`` rows) and layer, makes
    the loop's first warm-up call (it compiles and captures; ``ready`` waits for that), then waits: ``run`` lets
    it make the other warm-up calls and time the loop, and returns its ``timing.LoopTiming``. So a suite starts it
    beside other suites' cases and only the loop runs while the case holds the GPU alone. ``close`` ends it (a
    process never told to go)."""

    def __init__(self, paper: bool, B: int, S: int, capacity: int, dtype: str, calls: int, seed: int,
                 timeout_s: float = 300, device: str = "cuda"):
        import subprocess
        import sys
        import tempfile
        import threading

        from nsa_validate import orphans
        cmd = [sys.executable, "-m", "nsa_validate.bench.decode", "--batch", str(B), "--context", str(S), "--dtype",
               dtype, "--config", "paper" if paper else "tiny", "--capacity", str(capacity), "--loop", str(calls),
               "--seed", str(seed), "--device", device, "--wait"]
        self.timeout_s = timeout_s
        self.err = tempfile.TemporaryFile(mode="w+")        # a file, not a pipe: warnings never fill it and block
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     preexec_fn=orphans.die_with_parent())
        self.lines: list[str] = []
        self._said_ready = False
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, name="fresh-loop-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:                      # whatever the process prints; READY sets the event
            self.lines.append(line)
            if line.strip() == READY:
                self._said_ready = True
                self._ready.set()
        self._ready.set()                                  # ended: ``ready`` then finds it gone

    def _end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def _fail(self, what: str) -> RuntimeError:
        self._end()                                        # its last words are in the file once it has ended
        self.err.seek(0)
        tail = " | ".join(self.err.read().strip().splitlines()[-3:])
        self.close()
        return RuntimeError(f"the decode loop's process {what} (exit code {self.proc.returncode}): {tail}")

    def ready(self) -> None:
        """Wait until the process has warmed up and waits for ``run``."""
        if not self._ready.wait(self.timeout_s):
            raise self._fail(f"was not ready in {self.timeout_s:.0f} s")
        if not self._said_ready:
            raise self._fail("ended before it was ready")

    def run(self):
        """The timed loop: -> timing.LoopTiming."""
        import json
        import subprocess

        from nsa_validate.measure import timing
        self.ready()
        try:
            self.proc.stdin.write(GO + "\n")
            self.proc.stdin.close()
            self.proc.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            raise self._fail(f"did not finish its loop in {self.timeout_s:.0f} s") from None
        except OSError:                                    # it died before reading the go
            raise self._fail("ended before it was told to go") from None
        self._reader.join(10)
        last = next((x for x in reversed(self.lines) if x.lstrip().startswith("{")), None)
        try:
            if self.proc.returncode != 0 or last is None:
                raise ValueError
            return timing.LoopTiming(**json.loads(last))
        except (ValueError, TypeError):
            raise self._fail("ended without its timing") from None

    def close(self) -> None:
        """End the process (if it still runs) and let go of its pipes and files."""
        self._end()
        self._reader.join(10)                             # it reads to the end of the pipe, then stops
        for f in (self.proc.stdin, self.proc.stdout, self.err):
            try:
                f.close()
            except (OSError, ValueError):
                pass


def probe_seed(B: int, S: int) -> int:
    return B * 7919 + S


def _handshake() -> None:
    """``--wait``: say ready, then wait for the go (a closed stdin, the parent gone, ends the process)."""
    import sys
    print(READY, flush=True)
    if sys.stdin.readline().strip() != GO:
        raise SystemExit("the decode loop was not told to go")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="one eager NSA decode step inside cudaProfilerStart/Stop (for ncu); "
                                             "with --loop, the decode loop users write, timed (decode_loop), as JSON")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--config", default="paper", choices=["paper", "tiny"])
    ap.add_argument("--capacity", type=int, default=None, help="the cache's capacity (default: the context)")
    ap.add_argument("--loop", type=int, default=None, help="time this many NSAAttention.decode calls instead")
    ap.add_argument("--seed", type=int, default=0, help="the layer's weights (--loop)")
    ap.add_argument("--wait", action="store_true", help=f"--loop: after the warm-up, print {READY!r} and wait for a "
                                                         f"{GO!r} line on stdin before the timed loop (FreshLoop)")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    cfg = layer_config(a.config == "paper")
    if a.loop is not None:
        import json
        import kernels  # noqa: F401  (registers the Triton routes NSAAttention.decode takes)
        dt = DTYPES[a.dtype]
        try:                    # before the cache is made: a loop longer than the context is the caller's mistake
            start = loop_start(a.context, a.loop, a.device)
        except ValueError as e:
            ap.error(str(e))
        cache, _ = make_inputs(cfg, a.batch, a.context, dt, a.device, probe_seed(a.batch, a.context),
                               capacity=a.capacity)
        t = decode_loop(nsa_layer(cfg, dt, a.device, seed=a.seed), cache, start, a.loop, a.device,
                        warmed=_handshake if a.wait else None)
        print(json.dumps(t.summary()), flush=True)
        if a.wait:              # FreshLoop waits for this process's end inside the bench's GPU hold:
            os._exit(0)         # no Python shutdown of torch and the CUDA context to wait for
        return
    from kernels import decode
    cache, new = make_inputs(cfg, a.batch, a.context, DTYPES[a.dtype], a.device, probe_seed(a.batch, a.context),
                             capacity=a.capacity)
    step = decode.step_at(cfg, cache, a.context - 1)
    with torch.no_grad():
        step(**new)                       # compiles the kernels outside the profiled region
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step(**new)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
