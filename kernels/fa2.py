"""FA-2 varlen attention for NSA's sliding-window and compressed branches, on two backends.

Backends: ``flash_attn`` (``flash_attn.flash_attn_varlen_func``, the real flash-attn) and
``varlen`` (``torch.nn.attention.varlen.varlen_attn``, PyTorch's own FA-2 kernel). Each is used
only where it can run; ``unavailable(backend, ...)`` says why not, in one line, and nothing here
ever falls back silently to another implementation.

Layouts (packed variable length): q [T, H, d_k], k [T, G, d_k], v [T, G, d_v] with
``cu_seqlens`` [B+1] int32; the compressed keys k_cmp [N, G, d_k], v_cmp [N, G, d_v] are packed
the same way with ``cu_cmp`` [B+1] (N_b = n_cmp_total(S_b) per sequence).

The compressed branch's causal rule (query t sees compressed tokens i with i·d + l − 1 <= t,
docs/nsa.md) is a staircase, one more key every d queries, which FA's causal mask (one more key per
query) cannot express directly. The mapping used here: split each sequence's queries t >= l−1 by
the residue r = (t − l + 1) mod d. Within residue r the m-th query (t = l−1+r+m·d) sees exactly
compressed tokens 0..m: plain causal attention with as many keys as queries. So each (sequence,
residue) becomes one varlen sequence whose keys are the first Sq compressed tokens; the
compressed K/V are laid out once per residue (d copies of N_b ≤ S_b/d tokens: O(S) memory).
Queries t < l−1 see no compressed token and get a zero output, as the oracle defines.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect

import torch

from nsa_core import dispatch, routing
from nsa_core.config import NSAConfig

BACKENDS = routing.FA2_BACKENDS[1:]            # ("flash_attn", "varlen"); "auto" picks one


# -- availability -------------------------------------------------------------------------
def _flash_attn_func():
    from flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func


def _varlen_func():
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn


@functools.lru_cache(maxsize=1)
def _varlen_params() -> frozenset:
    """The keyword names this torch's varlen_attn takes (its API grew between releases)."""
    return frozenset(inspect.signature(_varlen_func()).parameters)


def unavailable(backend: str, device=None, dtype=None, d_k: int | None = None, d_v: int | None = None,
                window: bool = False, **_) -> str | None:
    """Why ``backend`` cannot run this query (None: it can)."""
    if backend not in BACKENDS:
        return f"unknown FA-2 backend {backend!r} (known: {', '.join(BACKENDS)})"
    if not torch.cuda.is_available():
        installed = backend != "flash_attn" or importlib.util.find_spec("flash_attn") is not None
        return "no CUDA GPU (FA-2 kernels are GPU-only)" + ("" if installed else "; flash-attn is not installed")
    if device is not None and torch.device(device).type != "cuda":
        return "tensors are not on a CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 0):
        return f"GPU sm{cap[0]}{cap[1]} is older than sm80 (FA-2 needs Ampere or newer)"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} is not supported by FA-2 (fp16/bf16 only)"
    for name, d in (("d_k", d_k), ("d_v", d_v)):
        if d is not None and (d > 256 or d % 8):
            return f"head dim {name}={d} is not supported (FA-2: a multiple of 8, at most 256)"
    if backend == "flash_attn":
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed"
        try:
            _flash_attn_func()
        except Exception as e:             # e.g. an extension built for another torch
            return f"flash-attn does not import: {str(e).splitlines()[0][:200]}"
    else:
        try:
            params = _varlen_params()
        except ImportError:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
        if window and "window_size" not in params:
            return f"torch {torch.__version__} varlen_attn has no window_size (sliding window unsupported)"
    return None


# -- one varlen call per backend ----------------------------------------------------------
def _call(backend, q, k, v, cu_q, cu_k, max_q, max_k, scale, left: int):
    """Causal varlen attention (bottom-right aligned), keys limited to ``left`` before the query
    (-1: unlimited). GQA: k/v may have fewer heads. d_v < d_k is handled by zero-padding v to
    d_k (the padded output columns are dropped). Returns [Tq, H, d_v]."""
    d_v = v.shape[-1]
    if d_v != k.shape[-1]:
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - d_v))
    if backend == "flash_attn":
        o = _flash_attn_func()(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True,
                               window_size=(left, 0))
    else:
        params = _varlen_params()
        if "window_size" in params:
            kw = {"scale": scale, "window_size": (left, 0)}
        elif left == -1 and "is_causal" in params:     # an older varlen_attn: causal flag only
            kw = {"scale": scale, "is_causal": True}
        else:
            raise ValueError(f"torch {torch.__version__} varlen_attn cannot express a sliding window")
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            else:       # older torch: share KV heads by replication
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        o = _varlen_func()(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    return o[..., :d_v]


@dispatch.ranged("kernel", "causal")
def causal_attention(q, k, v, cu_seqlens, max_seqlen: int, backend: str, scale: float | None = None):
    """Plain causal varlen attention: [T, H, d_v]."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    o = _call(backend, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale, -1)
    dispatch.note("kernel", "causal", f"fa2:{backend}")
    return o


SPLIT_HEADS_FROM = 2 ** 28
"""Elements of q (T·H·d_k) from which the window branch runs one call per KV head: flash-attn's
GQA backward allocates dk/dv per *query* head plus an fp32 dq accumulator (at 64k, 64 heads,
d 192: ~7.5 GiB at once); one KV head's group at a time needs 1/G of that."""


@dispatch.ranged("kernel", "win")
def window_attention(q, k, v, cu_seqlens, max_seqlen: int, window: int, backend: str,
                     scale: float | None = None, split_heads_from: int = SPLIT_HEADS_FROM):
    """Sliding window: query t attends to positions max(0, t−w+1) .. t. [T, H, d_v]. Large inputs
    (q.numel() >= ``split_heads_from``) that autograd will differentiate run as one call per KV
    head (same result, less memory in the backward); without a backward to come, one call (the
    split and its stacking only cost time there: docs/decisions.md)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    G = k.shape[1]
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if G > 1 and backward and q.numel() >= split_heads_from:
        # unbind, not slices: the backward stacks the G gradients once (a slice's backward would
        # write a zero-filled full-size gradient per group)
        qs, ks, vs = q.unflatten(1, (G, -1)).unbind(1), k.unbind(1), v.unbind(1)
        o = torch.stack([_call(backend, qs[g], ks[g][:, None], vs[g][:, None], cu_seqlens, cu_seqlens,
                               max_seqlen, max_seqlen, scale, window - 1) for g in range(G)], dim=1).flatten(1, 2)
    else:
        o = _call(backend, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale, window - 1)
    dispatch.note("kernel", "win", f"fa2:{backend}")
    return o


@functools.lru_cache(maxsize=16)
def compressed_layout(lens: tuple[int, ...], cfg: NSAConfig, device) -> dict:
    """Index tensors of the residue mapping (see the module docstring) for sequence lengths
    ``lens``; built once per batch shape, outside any timed region.

    Returns q_index [Tq'] (packed query row of each mapped query), k_index [Tk'] (packed
    compressed-token row of each mapped key; as many as queries, since every mapped sequence has
    Sq = Sk), cu [B·d + 1] int32 (the same for queries and keys) and max_len. Query rows left out
    (t < l−1) see no compressed token."""
    l, d = cfg.cmp_len, cfg.cmp_stride
    q_idx, k_idx, cu = [], [], [0]
    q0 = c0 = 0
    max_len = 0
    for S in lens:
        for r in range(d):
            ts = list(range(l - 1 + r, S, d))
            if not ts:
                continue
            q_idx.extend(q0 + t for t in ts)
            k_idx.extend(range(c0, c0 + len(ts)))        # the first len(ts) <= n_b compressed tokens
            cu.append(cu[-1] + len(ts))
            max_len = max(max_len, len(ts))
        q0 += S
        c0 += cfg.n_cmp_total(S)
    as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return {"q_index": as_t(q_idx), "k_index": as_t(k_idx),
            "cu": torch.tensor(cu, dtype=torch.int32, device=device), "max_len": max_len}


@dispatch.ranged("kernel", "cmp")
def compressed_attention(q, k_cmp, v_cmp, layout: dict, backend: str, scale: float | None = None):
    """Compressed branch: q [T, H, d_k] over k_cmp/v_cmp [N, G, d] -> [T, H, d_v] (zero rows for
    queries with no compressed token). ``layout`` from ``compressed_layout``."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = q.new_zeros(q.shape[0], q.shape[1], v_cmp.shape[-1])
    if layout["q_index"].numel():
        o = _call(backend, q.index_select(0, layout["q_index"]), k_cmp.index_select(0, layout["k_index"]),
                  v_cmp.index_select(0, layout["k_index"]), layout["cu"], layout["cu"],
                  layout["max_len"], layout["max_len"], scale, -1)
        out = out.index_copy(0, layout["q_index"], o)
    dispatch.note("kernel", "cmp", f"fa2:{backend}")
    return out


@functools.lru_cache(maxsize=None)
def resolve(backend: str) -> str | None:
    """'auto' -> the first usable backend (flash_attn, then varlen); a named one as is. Cached:
    what is installed and which GPU this is do not change within a process, and the module asks
    on every forward."""
    if backend != "auto":
        return backend
    for b in BACKENDS:
        if unavailable(b) is None:
            return b
    return None
