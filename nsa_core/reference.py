"""The fp32 reference oracle of NSA (docs/nsa.md). Slow, plain, explicit masks.

Everything here runs in float32 (or float64 if given), builds its masks from the definitions
word for word, and shares no code with the fast paths in ``nsa_core.module`` or ``kernels``
— only the weights. Rows are processed in chunks of queries purely to bound memory; every
chunk is computed exactly as the whole would be.

Layouts (batch-first, "BSHD"):
    x      [B, S, D]          layer input
    q      [B, S, H, d_k]     H = G·h query heads; head ``g*h + j`` belongs to KV group g
    k, v   [B, S, G, d_k|d_v] raw keys / values (shared by the selection and window branches)
    k_cmp  [B, N, G, d_k]     compressed keys, N = n_cmp_total(S); v_cmp likewise with d_v
    idx    [B, S, G, n]       selected block indices per query and KV group, ascending,
                              -1 marks an unused slot
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nsa_core.config import BRANCHES, NSAConfig

_CHUNK = 256


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale, masked) · v with GQA; a row with no allowed key gives exactly 0.

    q [B, Sq, G, h, dk]; k [B, Sk, G, dk]; v [B, Sk, G, dv]; mask [B|1, Sq, G|1, Sk] bool
    (True = may attend). Returns [B, Sq, G, h, dv].
    """
    s = torch.einsum("bqghd,bkgd->bqghk", q, k) * scale
    m = mask.unsqueeze(3)                                   # [B, Sq, G, 1, Sk]
    s = s.masked_fill(~m, float("-inf"))
    any_allowed = m.any(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~any_allowed, 0.0), dim=-1) * any_allowed
    return torch.einsum("bqghk,bkgd->bqghd", p, v)


# -- compression ------------------------------------------------------------------------
def compress(kv: torch.Tensor, cfg: NSAConfig, pe: torch.Tensor | None,
             w1: torch.Tensor | None, b1: torch.Tensor | None,
             w2: torch.Tensor | None, b2: torch.Tensor | None) -> torch.Tensor:
    """φ over every complete span: token i covers positions [i·d, i·d + l).

    kv [B, S, G, dd] -> [B, N, G, dd]. With cfg.compress == "mlp":
    φ(span) = W2 · silu(W1 · flatten(span + pe) + b1) + b2, pe [l, dd] (intra-block position).
    With "mean": the mean of the span.
    """
    B, S, G, dd = kv.shape
    N = cfg.n_cmp_total(S)
    out = kv.new_zeros(B, N, G, dd)
    for i in range(N):
        span = kv[:, i * cfg.cmp_stride: i * cfg.cmp_stride + cfg.cmp_len]      # [B, l, G, dd]
        if cfg.compress == "mean":
            out[:, i] = span.mean(dim=1)
        else:
            flat = (span + pe[None, :, None, :]).permute(0, 2, 1, 3).reshape(B, G, cfg.cmp_len * dd)
            hidden = F.silu(flat @ w1.T + b1)
            out[:, i] = hidden @ w2.T + b2
    return out


# -- masks, straight from the definitions -----------------------------------------------
def cmp_mask(cfg: NSAConfig, positions: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """[Sq, N] bool: query at position t may use compressed token i iff i·d + l − 1 <= t."""
    i = torch.arange(n_tokens, device=positions.device)
    return (i[None, :] * cfg.cmp_stride + cfg.cmp_len - 1) <= positions[:, None]


def window_mask(cfg: NSAConfig, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[Sq, S] bool: key s is in query t's window iff max(0, t−w+1) <= s <= t."""
    s = torch.arange(seq_len, device=positions.device)
    t = positions[:, None]
    return (s[None, :] <= t) & (s[None, :] >= t - cfg.window + 1)


def compressed_probs(q: torch.Tensor, k_cmp: torch.Tensor, cfg: NSAConfig, positions: torch.Tensor) -> torch.Tensor:
    """The compressed branch's attention probabilities: q [B, Sq, G, h, dk] at ``positions`` [Sq],
    k_cmp [B, N, G, dk] -> p [B, Sq, G, h, N] over the tokens ``cmp_mask`` allows; a row with none is 0."""
    cm = cmp_mask(cfg, positions, k_cmp.shape[1])                              # [Sq, N]
    s = torch.einsum("bqghd,bkgd->bqghk", q, k_cmp) * cfg.scale
    s = s.masked_fill(~cm[None, :, None, None, :], float("-inf"))
    has = cm.any(-1)[None, :, None, None, None]
    return torch.softmax(s.masked_fill(~has, 0.0), dim=-1) * has


def overlap_matrix(cfg: NSAConfig, n_tokens: int, n_blocks: int, device=None) -> torch.Tensor:
    """[N, NB] float: 1 where compressed span [i·d, i·d+l) intersects block [j·l', (j+1)·l')."""
    i = torch.arange(n_tokens, device=device)[:, None]
    j = torch.arange(n_blocks, device=device)[None, :]
    start, end = i * cfg.cmp_stride, i * cfg.cmp_stride + cfg.cmp_len
    return ((start < (j + 1) * cfg.block_size) & (end > j * cfg.block_size)).float()


def selection_mask(cfg: NSAConfig, idx: torch.Tensor, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, Sq, G, S] bool: key s is attended iff its block is in idx[b, t, g] and s <= t."""
    block_of_key = torch.arange(seq_len, device=idx.device) // cfg.block_size     # [S]
    chosen = (idx[..., None] == block_of_key).any(dim=-2)                         # [B, Sq, G, S]
    causal = torch.arange(seq_len, device=idx.device)[None, :] <= positions[:, None]
    return chosen & causal[None, :, None, :]


# -- selection --------------------------------------------------------------------------
def block_scores(p_cmp: torch.Tensor, cfg: NSAConfig, seq_len: int) -> torch.Tensor:
    """Selection-block importance, summed over the h heads of each group.

    p_cmp [B, Sq, H, N] (compressed-branch attention probabilities) -> [B, Sq, G, NB].
    A compressed token adds its probability to every block its span overlaps (unweighted).
    """
    B, Sq, H, N = p_cmp.shape
    ov = overlap_matrix(cfg, N, cfg.n_blocks(seq_len), p_cmp.device).to(p_cmp.dtype)
    per_head = p_cmp @ ov                                                       # [B, Sq, H, NB]
    return per_head.view(B, Sq, cfg.n_kv_heads, cfg.heads_per_group, per_head.shape[-1]).sum(dim=3)


def select_blocks(scores: torch.Tensor, positions: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """Top-n blocks per query and group (docs/nsa.md).

    scores [B, Sq, G, NB]; positions [Sq]. Returns idx [B, Sq, G, n] int64, ascending, -1 padded.
    Block 0 and the local blocks ⌊t/l'⌋ and ⌊t/l'⌋−1 are always selected; the remaining slots go
    to the highest-scoring other causal blocks (start <= t); ties go to the lower index.
    """
    NB = scores.shape[-1]
    j = torch.arange(NB, device=scores.device)
    t = positions[:, None]                                                      # [Sq, 1]
    cur = t // cfg.block_size
    causal = j[None, :] * cfg.block_size <= t                                   # [Sq, NB]
    forced = causal & ((j[None, :] == 0) | (j[None, :] == cur) | (j[None, :] == cur - 1))
    key = scores.masked_fill(~causal[None, :, None, :], float("-inf"))
    key = key.masked_fill(forced[None, :, None, :], float("inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices     # ties: lower j first
    n = cfg.n_selected
    if NB < n:
        order = F.pad(order, (0, n - NB), value=-1)
    top = order[..., :n]
    n_causal = causal.sum(-1)                                                   # [Sq]
    slot = torch.arange(n, device=scores.device)
    top = top.masked_fill(slot[None, None, None, :] >= n_causal[None, :, None, None], -1)
    # ascending with the -1 padding last
    big = torch.iinfo(torch.int64).max
    top = torch.sort(top.masked_fill(top < 0, big), dim=-1).values
    return top.masked_fill(top == big, -1)


# -- one decode row from a cache ---------------------------------------------------------------
def decode_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
               t: int, cfg: NSAConfig, idx: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Row t of NSA attention for a decode step, from cache contents, computed in ``dtype``.

    q [B, H, d_k] (token t); k/v [B, >t, G, d] (only positions 0..t are read); k_cmp/v_cmp
    [B, >=n_cmp(t), G, d]. ``idx`` [B, G, n] overrides the selection (to compare attention given
    the same blocks). Returns {"o_cmp"/"o_sel"/"o_win": [B, H, d_v], "idx": [B, G, n],
    "scores": [B, G, NB]} — the same definitions as ``forward``, for one query row.
    """
    B, H, _ = q.shape
    G, h = cfg.n_kv_heads, cfg.heads_per_group
    S, N = t + 1, cfg.n_cmp(t)
    qg = q.to(dtype).view(B, 1, G, h, -1)
    k, v = k[:, :S].to(dtype), v[:, :S].to(dtype)
    k_cmp, v_cmp = k_cmp[:, :N].to(dtype), v_cmp[:, :N].to(dtype)
    pos = torch.tensor([t], device=q.device)
    s = torch.einsum("bqghd,bkgd->bqghk", qg, k_cmp) * cfg.scale
    p = torch.softmax(s, dim=-1) if N else s.new_zeros(s.shape)                # [B, 1, G, h, N]
    o_cmp = torch.einsum("bqghk,bkgd->bqghd", p, v_cmp)
    scores = block_scores(p.reshape(B, 1, H, N).float(), cfg, S)             # [B, 1, G, NB]
    idx = select_blocks(scores, pos, cfg)[:, 0] if idx is None else idx
    o_sel = masked_attention(qg, k, v, selection_mask(cfg, idx[:, None], pos, S), cfg.scale)
    o_win = masked_attention(qg, k, v, window_mask(cfg, pos, S)[None, :, None, :], cfg.scale)
    flat = {"o_cmp": o_cmp, "o_sel": o_sel, "o_win": o_win}
    return {**{n: o.reshape(B, H, cfg.d_v) for n, o in flat.items()}, "idx": idx, "scores": scores[:, 0]}


# -- the layer --------------------------------------------------------------------------
def gates(x: torch.Tensor, w1, b1, w2, b2, cfg: NSAConfig) -> torch.Tensor:
    """g = sigmoid(MLP(x)) : [B, S, D] -> [B, S, H, 3] (order cmp, sel, win)."""
    g = torch.sigmoid(F.silu(x @ w1.T + b1) @ w2.T + b2)
    return g.view(*x.shape[:2], cfg.n_heads, 3)


def mix(g: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor) -> torch.Tensor:
    """The gated sum: g [..., H, 3] (cmp, sel, win) over o_* [..., H, d_v] -> [..., H, d_v]."""
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win


def forward(module, x: torch.Tensor, only: str | None = None, idx: torch.Tensor | None = None,
            dtype: torch.dtype = torch.float32, with_scores: bool = False,
            params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Oracle forward of ``nsa_core.module.NSAAttention`` weights on x [B, S, D].

    Computes in ``dtype`` (float32 for the oracle; the test dtype for the low-precision oracle
    of the tolerance rule). ``only`` forces the gate one-hot on a branch. ``idx`` [B, S, G, n]
    overrides the selected blocks (to compare a kernel that was given indices).
    Returns {"out": [B, S, D], "o_cmp"/"o_sel"/"o_win": [B, S, H, dv], "idx": [B, S, G, n],
    "gate": [B, S, H, 3]} and, with ``with_scores``, "scores": [B, S, G, NB] block importance.
    ``params`` (name -> tensor, as ``module.named_parameters()``) replaces the module's detached
    weights, e.g. with leaf tensors that require grad to obtain the oracle's gradients.
    """
    cfg: NSAConfig = module.cfg
    P = {name: p.detach().to(dtype) for name, p in module.named_parameters()} if params is None else \
        {name: p.to(dtype) for name, p in params.items()}
    x = x.to(dtype)
    B, S, _ = x.shape
    G, h = cfg.n_kv_heads, cfg.heads_per_group
    q = (x @ P["q_proj.weight"].T).view(B, S, G, h, cfg.d_k)
    k = (x @ P["k_proj.weight"].T).view(B, S, G, cfg.d_k)
    v = (x @ P["v_proj.weight"].T).view(B, S, G, cfg.d_v)

    def phi(kind, kv):
        if cfg.compress == "mean":
            return compress(kv, cfg, None, None, None, None, None)
        pre = f"cmp_{kind}."
        return compress(kv, cfg, P[pre + "pe"], P[pre + "fc1.weight"], P[pre + "fc1.bias"],
                        P[pre + "fc2.weight"], P[pre + "fc2.bias"])

    k_cmp, v_cmp = phi("k", k), phi("v", v)
    N = k_cmp.shape[1]
    o_cmp, o_sel, o_win, idx_all, scores = [], [], [], [], []
    for t0 in range(0, S, _CHUNK):
        pos = torch.arange(t0, min(S, t0 + _CHUNK), device=x.device)
        qc = q[:, pos]
        # compressed branch, and its probabilities for selection
        p = compressed_probs(qc, k_cmp, cfg, pos)                               # [B, c, G, h, N]
        o_cmp.append(torch.einsum("bqghk,bkgd->bqghd", p, v_cmp))
        if idx is None or with_scores:
            sc = block_scores(p.reshape(B, len(pos), G * h, N).float(), cfg, S)
            scores.append(sc)
        idx_c = select_blocks(sc, pos, cfg) if idx is None else idx[:, pos]
        idx_all.append(idx_c)
        o_sel.append(masked_attention(qc, k, v, selection_mask(cfg, idx_c, pos, S), cfg.scale))
        o_win.append(masked_attention(qc, k, v, window_mask(cfg, pos, S)[None, :, None, :], cfg.scale))
    parts = {name: torch.cat(chunks, 1).reshape(B, S, G * h, cfg.d_v)
             for name, chunks in (("o_cmp", o_cmp), ("o_sel", o_sel), ("o_win", o_win))}
    g = gates(x, P["gate.fc1.weight"], P["gate.fc1.bias"], P["gate.fc2.weight"], P["gate.fc2.bias"], cfg)
    if only is not None:
        g = F.one_hot(torch.tensor(BRANCHES.index(only)), 3).to(g)[None, None, None, :].expand_as(g)
    o = mix(g, parts["o_cmp"], parts["o_sel"], parts["o_win"])
    out = o.reshape(B, S, -1) @ P["o_proj.weight"].T
    extra = {"scores": torch.cat(scores, 1)} if with_scores else {}
    return {"out": out, "gate": g, "idx": torch.cat(idx_all, 1), **parts, **extra}
