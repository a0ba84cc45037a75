"""PyTorch implementation of the three NSA branches and of block selection (default backend).

Each function takes query rows at absolute positions ``start .. start+Sq-1`` and the key/value
tensors holding (at least) every position those rows may see, so the same code serves prefill
(start = 0, all rows) and a decode step (start = t, one row, keys = the cache). Work is
chunked over query rows and touches only the key range a chunk can use, so memory stays
O(chunk · keys-per-row), never O(S²) (and each chunk in pieces of bounded bytes).

With ``want_used=True`` a function also returns ``used`` [B, Sq, G]: how many KV tokens each
row actually attended over, counted from the slice / gather-index tensors it used. These are
the measured read counters of docs/nsa.md.

Layouts: q [B, Sq, H, d_k]; k/v [B, S, G, d]; k_cmp/v_cmp [B, N, G, d]; idx [B, Sq, G, n].
"""
from __future__ import annotations

import torch

from nsa_core import routing
from nsa_core.config import NSAConfig

CHUNK = 128
# A chunk's rows are attended in pieces whose scores and gathered (or re-laid) keys and values take at
# most this many bytes. On a CPU small pieces: the allocator hands a large block back to the OS when it
# is freed, so every large temporary faulted its pages in afresh, and a piece this size is still in
# cache when the next einsum reads it (one thread, paper heads, B=65 decode rows: the selection over
# 1,024 tokens 0.52 -> 0.28 s, the window 0.25 -> 0.11 s; the selection of a 1,100-token prefill
# 13 -> 3-4 s). On a GPU, whose allocator keeps its blocks, pieces only bound a chunk's memory.
PIECE_BYTES_CPU = 8 << 20
PIECE_BYTES = 1 << 30


def _chunks(Sq: int, start: int, device):
    """The query rows CHUNK at a time: (c0, c1, their absolute positions [c1 − c0])."""
    for c0 in range(0, Sq, CHUNK):
        c1 = min(Sq, c0 + CHUNK)
        yield c0, c1, torch.arange(start + c0, start + c1, device=device)


def _budget(device: torch.device) -> int:
    return PIECE_BYTES_CPU if device.type == "cpu" else PIECE_BYTES


def _pieces(B: int, c: int, pair_bytes: int, budget: int):
    """(b0, b1, q0, q1): the [B, c] grid of (batch row, query row) pairs in rectangles of at most
    ``budget`` bytes, ``pair_bytes`` a pair (one pair at least): whole rows of c where they fit."""
    pairs = max(1, budget // pair_bytes)
    nb, nq = (max(1, pairs // c), c) if pairs >= c else (1, pairs)
    for b0 in range(0, B, nb):
        for q0 in range(0, c, nq):
            yield b0, min(B, b0 + nb), q0, min(c, q0 + nq)


def _softmax_rows(s: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim; rows with nothing allowed give zeros, not NaN."""
    s = s.float().masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.where(allowed.any(-1, keepdim=True), p, torch.zeros_like(p))


def _grouped(q: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    B, Sq = q.shape[:2]
    return q.view(B, Sq, cfg.n_kv_heads, cfg.heads_per_group, q.shape[-1])


def _attend(qc, k, v, allowed, cfg: NSAConfig) -> torch.Tensor:
    """Rows qc [B, c, H, d_k] over keys k/v [B, Sk, G, d] with mask allowed [c, Sk] -> [B, c, H, d_v]."""
    B, c, H, _ = qc.shape
    Sk = k.shape[1]
    out = qc.new_empty(B, c, H, cfg.d_v)
    # a (batch row, query row)'s fp32 scores and probabilities, and its share of the keys and values
    # (the einsums copy them into a layout per KV head)
    pair = H * Sk * 8 + -(-Sk * cfg.n_kv_heads * (cfg.d_k + cfg.d_v) * k.element_size() // c)
    for b0, b1, q0, q1 in _pieces(B, c, pair, _budget(qc.device)):
        s = torch.einsum("bqghd,bkgd->bqghk", _grouped(qc[b0:b1, q0:q1], cfg), k[b0:b1]) * cfg.scale
        p = _softmax_rows(s, allowed[None, q0:q1, None, None, :])
        o = torch.einsum("bqghk,bkgd->bqghd", p.to(v.dtype), v[b0:b1])
        out[b0:b1, q0:q1] = o.reshape(b1 - b0, q1 - q0, H, cfg.d_v)
    return out


def _cmp_allowed(cfg: NSAConfig, pos: torch.Tensor) -> torch.Tensor:
    """[c, n] bool for rows at ascending positions pos [c] over the n = n_cmp(pos[−1]) compressed
    tokens the chunk can use."""
    i = torch.arange(cfg.n_cmp(int(pos[-1])), device=pos.device)
    return (i * cfg.cmp_stride + cfg.cmp_len - 1)[None, :] <= pos[:, None]


def cmp_probs(q: torch.Tensor, k_cmp: torch.Tensor, cfg: NSAConfig, pos: torch.Tensor):
    """Compressed-branch probabilities of rows at positions pos [c]: (p [B, c, G, h, n] fp32, allowed [c, n])."""
    allowed = _cmp_allowed(cfg, pos)
    n = allowed.shape[1]
    s = torch.einsum("bqghd,bkgd->bqghk", _grouped(q, cfg), k_cmp[:, :n]) * cfg.scale
    return _softmax_rows(s, allowed[None, :, None, None, :]), allowed


def cmp_attention(q, k_cmp, v_cmp, cfg: NSAConfig, start: int = 0, phase: str = routing.PREFILL,
                  want_used: bool = False):
    """Compressed branch. Returns o [B, Sq, H, d_v] (and used [B, Sq, G])."""
    routing.note(phase, "cmp", routing.TORCH)
    B, Sq, H, _ = q.shape
    out = q.new_zeros(B, Sq, H, cfg.d_v)
    used = torch.zeros(B, Sq, cfg.n_kv_heads, dtype=torch.int64, device=q.device)
    for c0, c1, pos in _chunks(Sq, start, q.device):
        n = cfg.n_cmp(int(pos[-1]))
        if n == 0:
            continue
        allowed = _cmp_allowed(cfg, pos)
        out[:, c0:c1] = _attend(q[:, c0:c1], k_cmp[:, :n], v_cmp[:, :n], allowed, cfg)
        used[:, c0:c1] = allowed.sum(-1)[None, :, None]
    return (out, used) if want_used else out


def topn_blocks(scores: torch.Tensor, pos: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """scores [B, c, G, NB] for rows at positions pos [c] -> idx [B, c, G, n], ascending, -1 padded."""
    NB = scores.shape[-1]
    j = torch.arange(NB, device=scores.device)[None, None, None, :]            # [1, 1, 1, NB]
    cur = (pos // cfg.block_size)[None, :, None, None]                          # [1, c, 1, 1]
    causal = j <= cur
    forced = (j == 0) | (j == cur) | (j == cur - 1)
    key = torch.where(forced, torch.inf, torch.where(causal, scores, -torch.inf))
    k = min(cfg.n_selected, NB)
    top = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]
    top = torch.where(torch.arange(k, device=pos.device) < cur + 1, top, NB)
    top = torch.nn.functional.pad(top, (0, cfg.n_selected - k), value=NB)
    top = torch.sort(top, dim=-1).values
    return torch.where(top == NB, -1, top)


def select_blocks(q, k_cmp, cfg: NSAConfig, start: int = 0) -> torch.Tensor:
    """Block selection for rows at start..start+Sq-1: idx [B, Sq, G, n] (int64, -1 padded)."""
    B, Sq = q.shape[:2]
    idx = torch.full((B, Sq, cfg.n_kv_heads, cfg.n_selected), -1, dtype=torch.int64, device=q.device)
    for c0, c1, pos in _chunks(Sq, start, q.device):
        t1 = start + c1
        NB = cfg.n_blocks(t1)
        n = cfg.n_cmp(t1 - 1)
        if n > 0:
            p, _ = cmp_probs(q[:, c0:c1], k_cmp, cfg, pos)
            # a compressed span [i·d, i·d+l) feeds blocks ⌊i·d/l'⌋ .. ⌊(i·d+l−1)/l'⌋
            i = torch.arange(n, device=q.device)
            first = (i * cfg.cmp_stride) // cfg.block_size
            last = (i * cfg.cmp_stride + cfg.cmp_len - 1) // cfg.block_size
            jj = torch.arange(NB, device=q.device)
            span_to_block = ((jj[None, :] >= first[:, None]) & (jj[None, :] <= last[:, None])).float()
            scores = p.sum(dim=3) @ span_to_block                               # [B, c, G, NB]
        else:
            scores = torch.zeros(B, c1 - c0, cfg.n_kv_heads, NB, device=q.device)
        idx[:, c0:c1] = topn_blocks(scores, pos, cfg)
    return idx


def _rows(x: torch.Tensor, b: torch.Tensor, t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x[b, t, g] for x [B, S, G, d] and index tensors broadcasting to one shape -> [*shape, d]."""
    if not x.is_contiguous():
        return x[b, t, g]
    S, G = x.shape[1], x.shape[2]
    flat = (b * S + t) * G + g
    return x.view(-1, x.shape[3]).index_select(0, flat.reshape(-1)).view(*flat.shape, x.shape[3])


def sel_attention(q, k, v, idx, cfg: NSAConfig, start: int = 0, phase: str = routing.PREFILL,
                  want_used: bool = False):
    """Selected-block attention by gathering the selected tokens (<= t) of each row."""
    routing.note(phase, "sel", routing.TORCH)
    idx = idx.long()                  # the Triton scorer gives int32; gather takes int64
    B, Sq, H, _ = q.shape
    G, L = cfg.n_kv_heads, cfg.block_size
    out = q.new_empty(B, Sq, H, cfg.d_v)
    used = torch.zeros(B, Sq, G, dtype=torch.int64, device=q.device)
    b_i = torch.arange(B, device=q.device)[:, None, None]
    g_i = torch.arange(G, device=q.device)[None, :, None]
    for c0, c1, pos in _chunks(Sq, start, q.device):
        ic = idx[:, c0:c1]                                                       # [B, c, G, n]
        tok = ic[..., None] * L + torch.arange(L, device=q.device)              # [B, c, G, n, L]
        valid = (ic[..., None] >= 0) & (tok <= pos[None, :, None, None, None])
        tok = torch.where(valid, tok, 0).flatten(-2).transpose(1, 2)             # [B, G, c, K]
        valid = valid.flatten(-2)                                                # [B, c, G, K]
        used[:, c0:c1] = valid.sum(-1)
        K = tok.shape[-1]
        pair = G * K * (cfg.d_k + cfg.d_v) * k.element_size() + H * K * 8     # gathered k, v; scores, probs
        for b0, b1, q0, q1 in _pieces(B, c1 - c0, pair, _budget(q.device)):
            nb, nq = b1 - b0, q1 - q0
            # rows k[b, t, g] (d contiguous values each): a gather along dim 1 of the transposed cache walked it
            # element by element, ~1.6x slower on a CPU (B=65, paper heads); advanced indexing another ~1.6x
            # slower than index_select on the rows' flat index, where the cache is contiguous (docs/decisions.md)
            flat = tok[b0:b1, :, q0:q1].reshape(nb, G, nq * K)
            kg = _rows(k, b_i[b0:b1], flat, g_i).view(nb, G, nq, K, cfg.d_k)
            vg = _rows(v, b_i[b0:b1], flat, g_i).view(nb, G, nq, K, cfg.d_v)
            s = torch.einsum("bqghd,bgqkd->bqghk", _grouped(q[b0:b1, c0 + q0:c0 + q1], cfg), kg) * cfg.scale
            p = _softmax_rows(s, valid[b0:b1, q0:q1, :, None, :])
            o = torch.einsum("bqghk,bgqkd->bqghd", p.to(vg.dtype), vg)
            out[b0:b1, c0 + q0:c0 + q1] = o.reshape(nb, nq, H, cfg.d_v)
    return (out, used) if want_used else out


def win_attention(q, k, v, cfg: NSAConfig, start: int = 0, phase: str = routing.PREFILL,
                  want_used: bool = False):
    """Sliding-window attention over positions max(0, t−w+1) .. t of each row."""
    routing.note(phase, "win", routing.TORCH)
    B, Sq, H, _ = q.shape
    out = q.new_empty(B, Sq, H, cfg.d_v)
    used = torch.zeros(B, Sq, cfg.n_kv_heads, dtype=torch.int64, device=q.device)
    for c0, c1, pos in _chunks(Sq, start, q.device):
        t0, t1 = start + c0, start + c1
        lo = max(0, t0 - cfg.window + 1)
        kpos = torch.arange(lo, t1, device=q.device)[None, :]
        allowed = (kpos <= pos[:, None]) & (kpos > pos[:, None] - cfg.window)   # [c, Sk]
        out[:, c0:c1] = _attend(q[:, c0:c1], k[:, lo:t1], v[:, lo:t1], allowed, cfg)
        used[:, c0:c1] = allowed.sum(-1)[None, :, None]
    return (out, used) if want_used else out
