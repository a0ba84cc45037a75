"""Plugs the kernels into ``NSAAttention`` through ``nsa_core.routing``.

An adapter turns the module's batch-first tensors into a kernel's layout, runs it, and notes in
the dispatch log that it ran. Each registration carries an availability check that returns a
one-line reason when the kernel cannot run for this query (so a fallback is always explained).
"""
from __future__ import annotations

import torch

from nsa_core import routing
from nsa_core.config import NSAConfig
from kernels import fa2
from kernels.interpreter import interpreting, probe

try:
    import triton

    from kernels import decode, selection
    _TRITON_MISSING = None
except ImportError as e:                      # a pod without triton still runs the torch path
    decode = selection = None
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
    if cfg is not None and cfg.block_size & (cfg.block_size - 1):
        return f"selection block size l'={cfg.block_size} is not a power of two"
    return None


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
    routing.note("prefill", "sel", "triton")
    return o.view(B, S, H, cfg.d_v)


routing.register("prefill", "sel", "triton", prefill_selection, triton_unavailable)


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
        routing.note("prefill", branch, f"fa2:{backend}")
        return o.view(B, S, H, cfg.d_v)
    return run


for _backend in ("auto", *fa2.BACKENDS):
    for _branch in ("cmp", "win"):
        routing.register("prefill", _branch, f"fa2:{_backend}", _fa2_prefill(_backend, _branch),
                         _fa2_unavailable(_backend, _branch))


# -- decode step ------------------------------------------------------------------------------
def decode_step(cfg: NSAConfig, q, cache, t: int):
    """q [B, H, d_k] of token t (already appended to ``cache``) -> ({branch: o [B, H, d_v]},
    {branch: reads [B, G]}, idx [B, G, n]) from the Triton decode kernels, selection included."""
    pos = torch.full((q.shape[0],), t, dtype=torch.int32, device=q.device)
    r = decode.decode_attention(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, pos, cfg)
    return r.out, {br: x.long() for br, x in r.reads.items()}, r.idx.long()


routing.register("decode", "step", "triton", decode_step, triton_unavailable)
