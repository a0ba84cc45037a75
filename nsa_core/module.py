"""``NSAAttention``: the bundled NSA layer (prefill and decode), routed per branch.

Forward pass (docs/nsa.md): project q/k/v, compress k/v with φ, score and select blocks from the
compressed-branch probabilities, run the three branches through the backend the routing policy
picks (every backend notes what ran in ``routing``), and mix them with the sigmoid gate.
``only=`` forces the gate one-hot on a branch and runs only that branch's work — the API the
suites and the decode bench use to isolate a branch.

Shapes: x [B, S, D] -> out [B, S, D]; H = G·h query heads of size d_k, G KV heads.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nsa_core import routing
from nsa_core import torch_branches as tb
from nsa_core.cache import DecodeCache
from nsa_core.config import NSAConfig
from nsa_core.routing import BRANCHES, RoutingPolicy


RECOMPUTE_PHI_FROM = 2 ** 25
"""Elements of φ's spans (B·N·G·l·dd) from which the training forward recomputes the MLP's input in the
backward instead of keeping it (with the paper's l=32, d=16 and G=4: from 64k tokens at d 128,
6.7e7; 32k tokens have 3.35e7, just under). Not below: the recompute costs ~1 ms of host time, which
a short, launch-bound backward would feel."""


def _on_input_device(method):
    """Run ``method(self, x, ...)`` with x's GPU as the current device. Triton launches a kernel on
    the current device's stream, whatever its tensors' device: a layer placed on a GPU other than
    the current one (``.to("cuda:1")``, as pipeline-parallel code does) would otherwise launch its
    kernels on the wrong GPU. The autograd engine makes each backward's GPU current itself."""
    @functools.wraps(method)
    def run(self, x, *args, **kwargs):
        d = x.get_device()                 # (-1 on the CPU; an int, not a device object: a decode loop's host time)
        if d >= 0 and d != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return method(self, x, *args, **kwargs)
        return method(self, x, *args, **kwargs)
    return run


class StepInfo:
    """What one decode step read, from the tensors and indices it used (not from the formula):
    reads[branch] [B, G] int64 tokens per KV head (compressed tokens for cmp), for the branches
    that ran; idx [B, G, n] int64 the blocks it selected (ascending, −1 padded; None when the
    selection branch did not run). The whole-layer step hands them over packed (``packed``): one
    int64 tensor [B, G, branches + n], each branch's reads then the blocks, split into those views
    when first asked for (a decode loop that never looks pays no host time for them)."""
    __slots__ = ("_reads", "_idx", "_packed")

    def __init__(self, reads: dict[str, torch.Tensor], idx: torch.Tensor | None) -> None:
        self._reads, self._idx, self._packed = reads, idx, None

    @classmethod
    def packed(cls, make: Callable[[], torch.Tensor], names: list[str]) -> StepInfo:
        """From ``make()`` -> the packed int64 tensor (called on first access) and the branches' names."""
        info = cls({}, None)
        info._packed = (make, names)
        return info

    def _unpack(self) -> None:
        make, names = self._packed
        t = make()
        self._reads, self._idx, self._packed = {br: t[..., i] for i, br in enumerate(names)}, t[..., len(names):], None

    @property
    def reads(self) -> dict[str, torch.Tensor]:
        if self._packed is not None:
            self._unpack()
        return self._reads

    @property
    def idx(self) -> torch.Tensor | None:
        if self._packed is not None:
            self._unpack()
        return self._idx

    def __repr__(self) -> str:
        return f"StepInfo(reads={self.reads!r}, idx={self.idx!r})"


class Compressor(nn.Module):
    """φ: [B, S, G, dd] -> [B, N, G, dd] over spans [i·d, i·d+l) (MLP with intra-block PE, or mean)."""

    def __init__(self, cfg: NSAConfig, dd: int) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.compress == "mlp":
            self.pe = nn.Parameter(torch.randn(cfg.cmp_len, dd) * 0.02)
            self.fc1 = nn.Linear(cfg.cmp_len * dd, dd)
            self.fc2 = nn.Linear(dd, dd)

    def forward(self, kv: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, S, G, dd = kv.shape
        N = cfg.n_cmp_total(S)
        if N == 0:
            return kv.new_zeros(B, 0, G, dd)
        # the MLP's input is recomputed in the backward rather than kept through it (``RECOMPUTE_PHI_FROM``)
        recompute = torch.is_grad_enabled() and B * N * G * cfg.cmp_len * dd >= RECOMPUTE_PHI_FROM
        if cfg.compress == "mlp" and cfg.cmp_len % cfg.cmp_stride == 0:
            # spans made of whole strides (the paper's l = 2d): fc1 over the strides (one copy of kv: 0.16 GiB
            # for k and v at 64k, d_k 192 / d_v 128, where the layer peaks), not over the spans
            covered = kv[:, :(N - 1 + cfg.cmp_len // cfg.cmp_stride) * cfg.cmp_stride]
            if recompute:
                return checkpoint(self._mlp_strides, covered, N, use_reentrant=False)
            return self._mlp_strides(covered, N)
        spans = kv[:, :(N - 1) * cfg.cmp_stride + cfg.cmp_len].unfold(1, cfg.cmp_len, cfg.cmp_stride)
        spans = spans.permute(0, 1, 2, 4, 3)                                    # [B, N, G, l, dd]
        if cfg.compress == "mean":
            return spans.mean(dim=3)
        if recompute:                   # the spans are l/d = 2x the size of kv
            return checkpoint(self._mlp, spans, use_reentrant=False)
        return self._mlp(spans)

    def _fc1_bias(self) -> torch.Tensor:
        # fc1(flatten(span + pe)) = W1·flatten(span) + (W1·flatten(pe) + b1): the position embedding
        # folds into fc1's bias, so no pass adds it to the spans, and its gradient is a reduction of
        # fc1's, not of the spans'
        return torch.addmv(self.fc1.bias, self.fc1.weight, self.pe.reshape(-1))

    def _mlp(self, spans: torch.Tensor) -> torch.Tensor:
        B, N, G, l, dd = spans.shape
        return self.fc2(F.silu(F.linear(spans.reshape(B, N, G, l * dd), self.fc1.weight, self._fc1_bias())))

    def _mlp_strides(self, kv: torch.Tensor, N: int) -> torch.Tensor:
        """φ's MLP where a span is R = l/d whole strides: kv [B, M·d, G, dd] (M = N + R − 1 strides of d
        tokens) -> [B, N, G, dd]. fc1's weight is R column blocks W1_r, one per stride of a span
        (flatten(span) is its strides' flattenings in order), so fc1(span_i) = Σ_r W1_r·flatten(stride_{i+r}):
        one GEMM of every stride by all R blocks at once, then R shifted adds of its [B, M, G, R, hidden]
        output. The strides are one copy of kv ([B, M, G, d·dd]: a transposed view made contiguous),
        where the spans were two (each token is in R spans) gathered by a strided copy, and in the
        backward no overlapping spans are folded back into kv."""
        cfg = self.cfg
        B, S, G, dd = kv.shape
        d, R = cfg.cmp_stride, cfg.cmp_len // cfg.cmp_stride
        M, hidden = S // d, self.fc1.out_features
        strides = kv.reshape(B, M, d, G, dd).transpose(2, 3).reshape(B, M, G, d * dd)
        w = self.fc1.weight.view(hidden, R, d * dd).transpose(0, 1).reshape(R * hidden, d * dd)
        y = F.linear(strides, w).view(B, M, G, R, hidden)
        h = self._fc1_bias() + y[:, :N, :, 0]
        for r in range(1, R):
            h = h + y[:, r:r + N, :, r]
        return self.fc2(F.silu(h))


class Gate(nn.Module):
    """g = sigmoid(MLP(x)): [B, S, D] -> [B, S, H, 3] (cmp, sel, win)."""

    def __init__(self, cfg: NSAConfig) -> None:
        super().__init__()
        hidden = max(16, cfg.d_model // 4)
        self.fc1 = nn.Linear(cfg.d_model, hidden)
        self.fc2 = nn.Linear(hidden, 3 * cfg.n_heads)
        self.n_heads = cfg.n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc2(F.silu(self.fc1(x)))).view(*x.shape[:-1], self.n_heads, 3)


class NSAAttention(nn.Module):
    def __init__(self, cfg: NSAConfig, policy: RoutingPolicy | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.policy = policy or RoutingPolicy()
        H, G = cfg.n_heads, cfg.n_kv_heads
        self.q_proj = nn.Linear(cfg.d_model, H * cfg.d_k, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, G * cfg.d_k, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, G * cfg.d_v, bias=False)
        self.o_proj = nn.Linear(H * cfg.d_v, cfg.d_model, bias=False)
        self.cmp_k = Compressor(cfg, cfg.d_k)
        self.cmp_v = Compressor(cfg, cfg.d_v)
        self.gate = Gate(cfg)

    # -- pieces --------------------------------------------------------------------------
    def project(self, x):
        """q [B, S, H, d_k], k [B, S, G, d_k], v [B, S, G, d_v] from x [B, S, D]."""
        B, S, _ = x.shape
        cfg = self.cfg
        return (self.q_proj(x).view(B, S, cfg.n_heads, cfg.d_k),
                self.k_proj(x).view(B, S, cfg.n_kv_heads, cfg.d_k),
                self.v_proj(x).view(B, S, cfg.n_kv_heads, cfg.d_v))

    def gates(self, x, only: str | None = None):
        """g [B, S, H, 3] (cmp, sel, win): the sigmoid gate, or one-hot on ``only``."""
        if only is None:
            return self.gate(x)
        if only not in BRANCHES:
            raise ValueError(f"only must be one of {BRANCHES} or None, got {only!r}")
        g = torch.zeros(*x.shape[:2], self.cfg.n_heads, 3, device=x.device, dtype=x.dtype)
        g[..., BRANCHES.index(only)] = 1
        return g

    def routes(self, seq_len: int, device=None, dtype=None) -> dict[str, routing.Decision]:
        """The backend each prefill branch will use at this length, and why."""
        return routing.prefill_routes(self.policy, seq_len, cfg=self.cfg, device=device, dtype=dtype)

    def mix(self, g, parts: dict[str, torch.Tensor], routes=None, phase: str = routing.PREFILL) -> torch.Tensor:
        """o_proj(Σ g·o_branch) over the branches in ``parts`` (each [B, S, H, d_v]) -> [B, S, D];
        one fused pass on the routed backend when all three branches ran, else a multiply-add per
        branch (a zero output when none ran). ``phase``: whose mix this is (the profiler range and
        the dispatch log name ``<phase>/mix``)."""
        B, S = g.shape[:2]
        d = (routes or {}).get("mix")
        with routing.profiler_range(phase, "mix"):
            if d is not None and d.backend != routing.TORCH and all(br in parts for br in BRANCHES):
                impl, _ = routing.lookup(routing.PREFILL, "mix", d.backend)
                o = impl(g, *(parts[br] for br in BRANCHES))
            else:
                o = None
                for i, br in enumerate(BRANCHES):          # one fused multiply-add per branch
                    if br in parts:
                        o = g[..., i:i + 1] * parts[br] if o is None else torch.addcmul(o, g[..., i:i + 1], parts[br])
                if o is None:
                    o = g.new_zeros(B, S, self.cfg.n_heads, self.cfg.d_v)
                routing.note(phase, "mix", routing.TORCH)
        return self.o_proj(o.reshape(B, S, -1))

    # -- prefill -------------------------------------------------------------------------
    @_on_input_device
    def forward(self, x: torch.Tensor, *, only: str | None = None,
                cache: DecodeCache | None = None, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill x [B, S, D] -> [B, S, D]. ``cache`` (empty) is filled for later decode steps.
        ``idx`` [B, S, G, n] overrides block selection (to feed a kernel fixed indices)."""
        B, S, _ = x.shape
        q, k, v = self.project(x)
        # (φ(v) and the gate on streams of their own beside φ(k), all three being short chains of small
        # launches: no faster in the layer, H100, do_bench, four rounds, ms, one stream vs three: fwd 3.939-3.994
        # vs 3.942-3.981 at 8k, 45.76-46.15 vs 45.73-45.96 at 64k; fwd+bwd 12.81-13.00 vs 12.78-13.01, 139.7-140.7
        # vs 140.3-141.2)
        k_cmp, v_cmp = self.cmp_k(k), self.cmp_v(v)
        if cache is not None:
            cache.write_prefill(k, v, k_cmp, v_cmp)
        g = self.gates(x, only)
        want = BRANCHES if only is None else (only,)
        routes = self.routes(S, x.device, x.dtype)
        one = self.one_op(routes) if only is None and idx is None else None
        if one is not None:
            o = one(cfg=self.cfg, g=g, q=q, k=k, v=v, k_cmp=k_cmp, v_cmp=v_cmp)
            return self.o_proj(o.reshape(B, S, -1))
        parts, lse = {}, None
        if "cmp" in want:
            parts["cmp"], lse = self.run_branch("cmp", routes, with_lse=True, q=q, k_cmp=k_cmp, v_cmp=v_cmp)
        if "sel" in want:
            if idx is None:
                idx = self.select_from(q, k_cmp, routes, lse=lse)
            parts["sel"] = self.run_branch("sel", routes, q=q, k=k, v=v, idx=idx)
        if "win" in want:
            parts["win"] = self.run_branch("win", routes, q=q, k=k, v=v)
        return self.mix(g, parts, routes)

    def one_op(self, routes):
        """With every prefill stage on the Triton kernels (``routes`` from ``routes()``), the op the
        layer runs its three branches, block selection and gated mix through: one op whose backward
        needs no mix pass and no gradient sums between the branches (kernels/branches.py; called
        with cfg, g [B, S, H, 3], q, k, v, k_cmp, v_cmp -> Σ g·o [B, S, H, d_v]). Else None."""
        if all(d.backend == routing.TRITON for d in routes.values()):
            return routing.lookup(routing.PREFILL, "branches", routing.TRITON)[0]
        return None

    def run_branch(self, branch: str, routes, *, with_lse: bool = False, **tensors):
        """One prefill branch on the backend ``routes`` (from ``routes()``) picked -> o [B, S, H, d_v];
        ``with_lse``: (o, lse [B, S, H] fp32 or None), the log-sum-exp where the backend gives one
        (the Triton compressed kernel: block scoring reuses it)."""
        d = routes[branch]
        with routing.profiler_range(routing.PREFILL, branch):
            if d.backend != routing.TORCH:    # decide() already checked that this implementation is usable
                impl, _ = routing.lookup(routing.PREFILL, branch, d.backend)
                out = impl(cfg=self.cfg, **tensors)
            else:
                fn = {"cmp": tb.cmp_attention, "sel": tb.sel_attention, "win": tb.win_attention}[branch]
                out = fn(cfg=self.cfg, **tensors)
        o, lse = out if isinstance(out, tuple) else (out, None)
        return (o, lse) if with_lse else o

    def select_from(self, q: torch.Tensor, k_cmp: torch.Tensor, routes=None, lse=None) -> torch.Tensor:
        """Block selection from q [B, S, H, d_k] and the compressed keys [B, N, G, d_k] on the routed
        backend: idx [B, S, G, n] (ascending, -1 padded; int32 from the kernel, int64 from torch).
        ``lse`` [B, S, H]: the compressed branch's log-sum-exp when it has one (saves the scorer a pass)."""
        routes = routes or self.routes(q.shape[1], q.device, q.dtype)
        d = routes["select"]
        with routing.profiler_range(routing.PREFILL, "select"):
            if d.backend != routing.TORCH:
                impl, _ = routing.lookup(routing.PREFILL, "select", d.backend)
                return impl(cfg=self.cfg, q=q, k_cmp=k_cmp, lse=lse)
            routing.note(routing.PREFILL, "select", routing.TORCH)
            return tb.select_blocks(q, k_cmp, self.cfg)

    @_on_input_device
    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks prefill would select for x [B, S, D]: idx [B, S, G, n] (ascending, -1 padded)."""
        q, k, _ = self.project(x)
        return self.select_from(q, self.cmp_k(k))

    def fill_cache(self, x: torch.Tensor, cache: DecodeCache) -> None:
        """Prefill only the cache (raw and compressed K/V) from x [B, S, D], no attention."""
        _, k, v = self.project(x)
        cache.write_prefill(k, v, self.cmp_k(k), self.cmp_v(v))

    # -- decode --------------------------------------------------------------------------
    @_on_input_device
    def decode(self, x: torch.Tensor, cache: DecodeCache, *,
               only: str | None = None) -> tuple[torch.Tensor, StepInfo]:
        """One decode step: x [B, 1, D] is token t = cache.length. Appends it to the cache and
        returns (o_t [B, 1, D], exactly row t of a prefill over tokens 0..t, and the step's
        ``StepInfo``: what each branch read and the blocks it selected). On the Triton route the
        whole step (projections, append, φ, gate, attention, mix, output projection) is one
        fixed-shape device step set up once per cache (``kernels/decode_layer.py``): the position
        lives on the device and the call can be captured in a caller's CUDA graph, after one call
        outside it (``kernels.routes.decode_layer``). With ``only`` the Triton route runs that
        branch's kernels alone and the rest on the host (not capturable, nor is the torch route)."""
        cfg = self.cfg
        t = cache.length
        route, layer = routing.decode_route(self.policy, cfg, x.device, x.dtype)
        if layer is not None and only is None:       # the backend's whole-layer step
            with routing.profiler_range(routing.DECODE, "step"):
                return layer(m=self, x=x, cache=cache, t=t)
        # below, the host writes token t's row at a host position: a replay of a captured call would write that row
        # again, and a graph that already decodes into this cache (device_owned) would not see the row
        runs = f"the branch {only!r} alone" if only else f"the {route.backend} route"
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"NSAAttention.decode under CUDA graph capture needs the whole-layer Triton step "
                             f"(decode_backend='triton', no only=); this call runs {runs}, which keeps the position "
                             f"on the host")
        if cache.device_owned:
            raise ValueError(f"NSAAttention.decode: this cache's position is kept on the GPU by a decode step recorded "
                             f"into a CUDA graph; this call runs {runs}, which would write where that graph does not look")
        q, k, v = self.project(x)
        span = cache.append(k, v)
        if span is not None:
            i = (span[0]) // cfg.cmp_stride
            cache.k_cmp[:, i:i + 1] = self.cmp_k(cache.k[:, span[0]:span[1]])
            cache.v_cmp[:, i:i + 1] = self.cmp_v(cache.v[:, span[0]:span[1]])
        g = self.gates(x, only)
        want = BRANCHES if only is None else (only,)
        if route.backend != routing.TORCH:      # one fused step for the three branches (kernels/decode.py)
            impl, _ = routing.lookup(routing.DECODE, "step", route.backend)
            with routing.profiler_range(routing.DECODE, "step"):
                outs, reads, idx = impl(cfg=cfg, q=q[:, 0], cache=cache, branches=want)
            return self.mix(g, {br: outs[br][:, None] for br in want}, phase=routing.DECODE), StepInfo(reads, idx)
        K, V, Kc, Vc = cache.k[:, :t + 1], cache.v[:, :t + 1], cache.k_cmp, cache.v_cmp
        parts, reads, idx = {}, {}, None
        if "cmp" in want:
            parts["cmp"], used = tb.cmp_attention(q, Kc, Vc, cfg, start=t, phase=routing.DECODE, want_used=True)
            reads["cmp"] = used[:, 0]
        if "sel" in want:
            idx = tb.select_blocks(q, Kc, cfg, start=t)
            parts["sel"], used = tb.sel_attention(q, K, V, idx, cfg, start=t, phase=routing.DECODE, want_used=True)
            reads["sel"] = used[:, 0]
            idx = idx[:, 0]
        if "win" in want:
            parts["win"], used = tb.win_attention(q, K, V, cfg, start=t, phase=routing.DECODE, want_used=True)
            reads["win"] = used[:, 0]
        return self.mix(g, parts, phase=routing.DECODE), StepInfo(reads, idx)
