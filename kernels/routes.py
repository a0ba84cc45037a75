"""Plugs the kernels into ``NSAAttention`` through ``nsa_core.routing``.

An adapter turns the module's batch-first tensors into a kernel's layout, runs it, and notes in
the dispatch log that it ran. Each registration carries an availability check that returns a
one-line reason when the kernel cannot run for this query (so a fallback is always explained).
"""
from __future__ import annotations

import torch

from kernels import fa2
from kernels.interpreter import interpreting, probe
from nsa_core import routing
from nsa_core.config import NSAConfig

try:
    import triton

    from kernels import branches, compressed, decode, mix, scoring, selection, window
    _TRITON_MISSING = None
except ImportError as e:                      # a pod without triton still runs the torch path
    branches = compressed = decode = mix = scoring = selection = window = None
    _TRITON_MISSING = f"triton does not import ({e})"


def triton_unavailable(cfg: NSAConfig | None = None, device=None, dtype=None, **_) -> str | None:
    """Why a Triton kernel cannot run for this query (None: it can)."""
    if _TRITON_MISSING:
        return _TRITON_MISSING
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cpu":
        if not interpreting():
            return "tensors are on the CPU and TRITON_INTERPRET is not set"
        broken = probe()
        if broken:
            return f"the interpreter of triton {triton.__version__} failed the capability probe: {broken}"
        if dtype == torch.bfloat16:
            return "bf16 under the Triton interpreter gives wrong results (fp32/fp16 only)"
    if dev is not None and dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        if cap < (8, 0):
            return f"GPU sm{cap[0]}{cap[1]} is older than sm80"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype} is not supported (fp16/bf16/fp32)"
    return None


def selection_unavailable(cfg: NSAConfig | None = None, **query) -> str | None:
    if cfg is not None and cfg.block_size & (cfg.block_size - 1):
        return f"selection block size l'={cfg.block_size} is not a power of two"
    return triton_unavailable(cfg=cfg, **query)


def select_unavailable(cfg: NSAConfig | None = None, **query) -> str | None:
    why = triton_unavailable(cfg=cfg, **query)
    if why is None and cfg is not None:
        why = scoring.unavailable(cfg.cmp_len, cfg.cmp_stride, cfg.block_size, cfg.n_selected)
    return why


def _batch_cu(B: int, S: int, device) -> torch.Tensor:
    """cu_seqlens [B+1] int32 of B equal sequences of S tokens packed one after another."""
    return torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=device)


def prefill_selection(cfg: NSAConfig, q, k, v, idx):
    """q [B, S, H, d_k], k/v [B, S, G, d], idx [B, S, G, n] -> o [B, S, H, d_v] on the Triton kernel."""
    B, S, H, _ = q.shape
    cu = _batch_cu(B, S, q.device)
    o = selection.selection_attention(q.reshape(B * S, H, -1), k.reshape(B * S, cfg.n_kv_heads, -1),
                                      v.reshape(B * S, cfg.n_kv_heads, -1),
                                      idx.reshape(B * S, cfg.n_kv_heads, -1), cfg.block_size, cu,
                                      scale=cfg.scale, max_seqlen=S)
    routing.note(routing.PREFILL, "sel", routing.TRITON)
    return o.view(B, S, H, cfg.d_v)


routing.register(routing.PREFILL, "sel", routing.TRITON, prefill_selection, selection_unavailable)


def prefill_compressed(cfg: NSAConfig, q, k_cmp, v_cmp):
    """q [B, S, H, d_k], k_cmp/v_cmp [B, N, G, d] -> (o [B, S, H, d_v], lse [B, S, H] fp32) on the
    Triton kernel (differentiable in q, k_cmp, v_cmp)."""
    B, S, H, _ = q.shape
    N, G = k_cmp.shape[1], cfg.n_kv_heads
    o, lse = compressed.compressed_attention(q.reshape(B * S, H, -1), k_cmp.reshape(B * N, G, -1),
                                             v_cmp.reshape(B * N, G, -1), cfg.cmp_len, cfg.cmp_stride,
                                             _batch_cu(B, S, q.device), _batch_cu(B, N, q.device),
                                             scale=cfg.scale, max_seqlen=S)
    routing.note(routing.PREFILL, "cmp", routing.TRITON)
    return o.view(B, S, H, cfg.d_v), lse.view(B, S, H)


routing.register(routing.PREFILL, "cmp", routing.TRITON, prefill_compressed, triton_unavailable)


def prefill_window(cfg: NSAConfig, q, k, v):
    """q [B, S, H, d_k], k/v [B, S, G, d] -> o [B, S, H, d_v]: the sliding window on the Triton
    kernel (differentiable in q, k, v)."""
    B, S, H, _ = q.shape
    G = cfg.n_kv_heads
    o = window.window_attention(q.reshape(B * S, H, -1), k.reshape(B * S, G, -1), v.reshape(B * S, G, -1),
                                cfg.window, _batch_cu(B, S, q.device), scale=cfg.scale, max_seqlen=S)
    routing.note(routing.PREFILL, "win", routing.TRITON)
    return o.view(B, S, H, cfg.d_v)


routing.register(routing.PREFILL, "win", routing.TRITON, prefill_window, triton_unavailable)


def prefill_select(cfg: NSAConfig, q, k_cmp, lse=None):
    """q [B, S, H, d_k], k_cmp [B, N, G, d_k] (and the compressed branch's lse [B, S, H] when it
    ran on the Triton kernel; else computed here) -> idx [B, S, G, n] int32 from the Triton scorer."""
    B, S, H, _ = q.shape
    N, G = k_cmp.shape[1], cfg.n_kv_heads
    qp, kp = q.detach().reshape(B * S, H, -1), k_cmp.detach().reshape(B * N, G, -1)
    cu, cu_c = _batch_cu(B, S, q.device), _batch_cu(B, N, q.device)
    if lse is None:
        _, lse = compressed.compressed_attention_fwd(qp, kp, kp, cfg.cmp_len, cfg.cmp_stride, cu, cu_c,
                                                     scale=cfg.scale, max_seqlen=S, with_o=False)
    idx = scoring.select_blocks(qp, kp, lse.reshape(B * S, H), cfg.cmp_len, cfg.cmp_stride, cfg.block_size,
                                cfg.n_selected, cu, cu_c, scale=cfg.scale, max_seqlen=S)
    routing.note(routing.PREFILL, "select", routing.TRITON)
    return idx.view(B, S, G, cfg.n_selected)


routing.register(routing.PREFILL, "select", routing.TRITON, prefill_select, select_unavailable)


def prefill_mix(g, o_cmp, o_sel, o_win):
    """g [B, S, H, 3], o_* [B, S, H, d_v] -> Σ g·o [B, S, H, d_v] in one Triton pass (and one backward)."""
    o = mix.gated_mix(g, o_cmp, o_sel, o_win)
    routing.note(routing.PREFILL, "mix", routing.TRITON)
    return o


routing.register(routing.PREFILL, "mix", routing.TRITON, prefill_mix, triton_unavailable)


def prefill_branches(cfg: NSAConfig, g, q, k, v, k_cmp, v_cmp):
    """All of a layer's attention where every prefill stage routes to Triton: g [B, S, H, 3], q
    [B, S, H, d_k], k/v [B, S, G, d], k_cmp/v_cmp [B, N, G, d] -> Σ g·o [B, S, H, d_v], one
    differentiable op whose backward feeds the gate to each branch's kernels and accumulates
    dq/dk/dv in place (``kernels.branches``)."""
    B, S, H, _ = q.shape
    N, G = k_cmp.shape[1], cfg.n_kv_heads
    sh = branches.Shape(cfg.cmp_len, cfg.cmp_stride, cfg.block_size, cfg.n_selected, cfg.window, cfg.scale, S)
    o, _ = branches.nsa_branches(g.reshape(B * S, H, 3), q.reshape(B * S, H, -1), k.reshape(B * S, G, -1),
                                 v.reshape(B * S, G, -1), k_cmp.reshape(B * N, G, -1), v_cmp.reshape(B * N, G, -1),
                                 _batch_cu(B, S, q.device), _batch_cu(B, N, q.device), sh)
    for stage in routing.PREFILL_STAGES:
        routing.note(routing.PREFILL, stage, routing.TRITON)
    return o.view(B, S, H, cfg.d_v)


routing.register(routing.PREFILL, "branches", routing.TRITON, prefill_branches, select_unavailable)


# -- FA-2 varlen for the compressed and window branches -------------------------------------
def _fa2_unavailable(backend: str, branch: str):
    def check(cfg: NSAConfig | None = None, device=None, dtype=None, **_) -> str | None:
        b = fa2.resolve(backend)
        if b is None:
            return "no FA-2 backend can run here: " + "; ".join(f"{x}: {fa2.unavailable(x)}" for x in fa2.BACKENDS)
        return fa2.unavailable(b, device=device, dtype=dtype, d_k=cfg.d_k if cfg else None,
                               d_v=cfg.d_v if cfg else None, window=branch == "win")
    return check


def _fa2_prefill(backend: str, branch: str):
    def run(cfg: NSAConfig, q, **t):
        """q [B, S, H, d_k]; cmp: k_cmp/v_cmp [B, N, G, d]; win: k/v [B, S, G, d] -> [B, S, H, d_v]."""
        B, S, H, _ = q.shape
        b = fa2.resolve(backend)
        qp = q.reshape(B * S, H, -1)
        if branch == "win":
            cu = _batch_cu(B, S, q.device)
            o = fa2.window_attention(qp, t["k"].reshape(B * S, cfg.n_kv_heads, -1),
                                     t["v"].reshape(B * S, cfg.n_kv_heads, -1), cu, S, cfg.window, b, cfg.scale)
        else:
            N = t["k_cmp"].shape[1]
            layout = fa2.compressed_layout((S,) * B, cfg, q.device)
            o = fa2.compressed_attention(qp, t["k_cmp"].reshape(B * N, cfg.n_kv_heads, -1),
                                         t["v_cmp"].reshape(B * N, cfg.n_kv_heads, -1), layout, b, cfg.scale)
        routing.note(routing.PREFILL, branch, routing.fa2_route(backend))
        return o.view(B, S, H, cfg.d_v)
    return run


for _backend in ("auto", *fa2.BACKENDS):
    for _branch in ("cmp", "win"):
        routing.register(routing.PREFILL, _branch, routing.fa2_route(_backend), _fa2_prefill(_backend, _branch),
                         _fa2_unavailable(_backend, _branch))


# -- decode step ------------------------------------------------------------------------------
def decode_step(cfg: NSAConfig, q, cache, branches=routing.BRANCHES):
    """q [B, H, d_k] of token t = cache.pos (its k/v already appended to ``cache``) -> ({branch:
    o [B, H, d_v]}, {branch: reads [B, G] int64}, idx [B, G, n] int64 or None) from the Triton
    decode kernels, selection included. The ``DecodeStep`` (plan and workspace) is made once per
    cache, branch set and plan (``decode.horizon`` of the position: the tokens held, not the cache's capacity);
    what is returned is copied out of its workspace (the next step reuses it)."""
    key = (routing.TRITON, tuple(branches), decode.horizon(cfg, cache.length - 1, cache.max_len))
    step = cache.kernel_state.get(key)
    if step is None:
        step = cache.kernel_state[key] = decode.DecodeStep(cfg, cache, branches=branches, held_by_cache=True,
                                                           horizon=key[2])
    r = step(q, pos=cache.pos)
    routing.note(routing.DECODE, "step", routing.TRITON)
    return (r.out, {br: x.long() for br, x in r.reads.items()},
            r.idx.long() if r.idx is not None else None)


routing.register(routing.DECODE, "step", routing.TRITON, decode_step, triton_unavailable)


_LAYER = (routing.TRITON, "layer")      # the key of a cache's layer step in ``DecodeCache.kernel_state``


def decode_layer(m, x, cache, t: int):
    """The whole layer's decode step for x [B, 1, D], token t = cache.length (read by the caller: on a
    ``device_owned`` cache each read is a sync, and this makes none) -> (out [B, 1, D], its
    ``nsa_core.module.StepInfo``) on ``LayerDecodeStep`` (position on the
    device, φ and the gate as fixed-shape device work), made once per cache and module. A cache
    written elsewhere since its last step (a prefill, the torch route) is picked up where it is.
    On a GPU the step is replayed from a CUDA graph (``LayerDecodeStep.decode``). Under a caller's
    own capture it is recorded into the caller's graph (``LayerDecodeStep.record``); that needs a
    call on this cache outside the capture first, which sets the step up (allocations, compiles,
    the position), as any capture needs a warm-up."""
    held = cache.kernel_state.get(_LAYER)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        if held is None or held[0] is not m or held[1].length != t:
            raise ValueError("NSAAttention.decode under CUDA graph capture: call it once on this cache outside the "
                             "capture first (a warm-up step: it sets up the step's buffers, kernels and position)")
        return held[1].record(x, t)       # recorded, not run: no note
    if held is None or held[0] is not m:
        from kernels.decode_layer import LayerDecodeStep
        held = cache.kernel_state[_LAYER] = (m, LayerDecodeStep(m, cache, held_by_cache=True))
    step = held[1]
    if step.length != t:                   # (a seek to a full cache stays on its last row; the step then refuses)
        step.seek(t)
    # on a GPU straight to the replay (``LayerDecodeStep.decode`` would ask again whether a capture is on, ~2 µs of a
    # decode loop's host time a token; the replay needs no ``no_grad``: nothing it makes has a gradient)
    out, info = step.replay(x, t) if x.is_cuda else step.decode(x, t)
    routing.note(routing.DECODE, "step", routing.TRITON)
    return out, info


routing.register(routing.DECODE, "layer", routing.TRITON, decode_layer, triton_unavailable)
