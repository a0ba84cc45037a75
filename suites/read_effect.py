"""Which cached tokens a decode step reads, measured by their effect on its output.

Read counters that the step computes about itself can agree with the formula and still be wrong
(a path that simply reports the formula's numbers passes any comparison of numbers). This
measures the reads from outside, with nothing but the step's output: for one step at position t
and one branch alone (the module's gate forced one-hot on it, or the decode kernel run for that
branch only), per KV head g,

* every cached token the formula says the branch reads (compressed tokens 0..n_cmp(t)−1; the
  tokens of the selected blocks up to t; the window max(0, t−w+1)..t) is perturbed on its own,
  one batch row per token, and the step's output for that row must change;
* every other cached token is poisoned with NaN, all at once in one row, and the output must stay
  finite and unchanged.

Together: the set of tokens that matter is exactly the formula's set. It must also equal, token
for token, the set the step reports having read (its counts and selected blocks), so counts that
were not measured from what the step gathered cannot pass. Token t itself (written by the step)
and a compressed token the step itself completes are not in the cache before the step, so they
are left out of both sides.
"""
from __future__ import annotations

from typing import Callable

import torch

from nsa_core import DecodeCache, NSAAttention
from nsa_core.config import NSAConfig

ROWS_PER_CALL = 64          # perturbation rows per decode call (memory: a cache copy per row)
ROWS_PER_CALL_GPU = 512

Runner = Callable[[DecodeCache, str], torch.Tensor]   # (cache of n rows, branch) -> output [n, …]


def formula_sets(cfg: NSAConfig, t: int, blocks: torch.Tensor) -> dict[str, list[set[int]]]:
    """Per branch, per KV head: the cache positions (compressed index for cmp) the formula says
    the step at t reads. ``blocks`` [G, n]: the selected blocks (−1 = unused)."""
    lo = max(0, t - cfg.window + 1)
    sel = []
    for g in range(blocks.shape[0]):
        toks = {j * cfg.block_size + i for j in blocks[g].tolist() if j >= 0 for i in range(cfg.block_size)}
        sel.append({x for x in toks if x <= t})
    G = blocks.shape[0]
    return {"cmp": [set(range(cfg.n_cmp(t)))] * G, "sel": sel, "win": [set(range(lo, t + 1))] * G}


def reported_sets(cfg: NSAConfig, t: int, reads: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, list[set[int]]]:
    """What the step says it read (its ``StepInfo``: reads [1, G] per branch, idx [1, G, n]),
    as sets: the first reads[cmp] compressed tokens, the selected blocks up to t, the last
    reads[win] tokens."""
    G = idx.shape[1]
    sel = formula_sets(cfg, t, idx[0])["sel"]
    return {"cmp": [set(range(int(reads["cmp"][0, g]))) for g in range(G)], "sel": sel,
            "win": [set(range(t + 1 - int(reads["win"][0, g]), t + 1)) for g in range(G)]}


def copy_rows(cache: DecodeCache, n: int) -> DecodeCache:
    """A cache of n identical batch rows copied from row 0 of ``cache``."""
    return cache.copy_rows(n)


def module_step(m: NSAAttention, x_t: torch.Tensor) -> Runner:
    """A runner for ``check_step``: ``m.decode`` of token x_t [1, 1, D] (row 0 used) on every batch
    row of a cache, with the gate forced one-hot on ``branch``. Returns [n, 1, D] fp32."""
    def run(cache: DecodeCache, branch: str) -> torch.Tensor:
        with torch.no_grad():
            return m.decode(x_t[:1].expand(cache.k.shape[0], -1, -1), cache, only=branch)[0].float()
    return run


def check_step(run: Runner, cfg: NSAConfig, t: int, cache: DecodeCache, branch: str,
               reported: list[set[int]], formula: list[set[int]], n_cached: int) -> dict:
    """Run the checks above for the step at position t of one branch. ``cache`` holds the tokens
    before the step (batch row 0 is used; it is left as it was): ``n_cached`` rows of the branch's
    buffers (raw tokens for sel/win, compressed tokens for cmp). ``run(cache, branch)`` runs the
    step on every batch row of a cache and returns its output [n, …]. Returns counts; raises
    AssertionError naming the first disagreement."""
    raw = branch != "cmp"
    names = ("k", "v") if raw else ("k_cmp", "v_cmp")
    G = cfg.n_kv_heads
    want = [{x for x in formula[g] if x < n_cached} for g in range(G)]
    said = [{x for x in reported[g] if x < n_cached} for g in range(G)]
    for g in range(G):
        assert said[g] == want[g], (
            f"{branch} KV head {g} at t={t}: the step reports reading {len(said[g])} tokens, the formula "
            f"{len(want[g])}; reported-not-formula {sorted(said[g] - want[g])[:8]}, "
            f"formula-not-reported {sorted(want[g] - said[g])[:8]}")
    gen = torch.Generator(device=cache.k.device).manual_seed(t)
    # row 0: unchanged; row 1: every token the formula says is not read poisoned with NaN
    base = copy_rows(cache, 2)
    for g in range(G):
        unread = [x for x in range(n_cached) if x not in want[g]]
        for name in names:
            getattr(base, name)[1, unread, g] = float("nan")
    out = run(base, branch).flatten(1).float()
    assert torch.isfinite(out[1]).all(), f"{branch} at t={t}: NaN in an unread cached token reached the output"
    scale = 1.0 + out[0].abs().max().item()
    drift = (out[1] - out[0]).abs().max().item()
    assert drift <= 1e-6 * scale, f"{branch} at t={t}: poisoning unread tokens changed the output by {drift:.3g}"
    # one row per (KV head, token the formula says is read): perturbed alone, the output must move
    todo = [(g, x) for g in range(G) for x in sorted(want[g])]
    silent = []
    gpu = cache.k.is_cuda
    per_call = ROWS_PER_CALL_GPU if gpu else ROWS_PER_CALL
    # every call of a branch has the same rows (the last call's spare rows unperturbed): one batch
    # size, so the Triton decode step compiles once per branch, not once per chunk size (~3 s a
    # compile). On a GPU per_call + 1 at every step and position, so that all of a layer's checks
    # share one compile per branch (a cold run's warming compiled 10 batch sizes' kernels for them);
    # on the CPU, where nothing compiles and a row costs interpreter time, min(todo, per_call) + 1.
    # One copy serves every call: a call's perturbed entries are put back after it, and the cache
    # rewound to before the step (the step writes token t, and a compressed token it completes,
    # before reading them, the same in every call); a fresh copy of the whole cache per call was
    # most of a CPU paper-layer case's time
    c = copy_rows(cache, (per_call if gpu else min(len(todo), per_call)) + 1)
    for i in range(0, len(todo), per_call):
        part = todo[i:i + per_call]
        rows = torch.arange(1, len(part) + 1, device=c.k.device)
        pos = torch.tensor([x for _, x in part], device=c.k.device)
        heads = torch.tensor([g for g, _ in part], device=c.k.device)
        kept = []
        for name, amp in zip(names, (4.0, 1e3)):             # keys shifted, values far off
            buf = getattr(c, name)
            kept.append((buf, buf[rows, pos, heads].clone()))
            noise = torch.randn(len(part), buf.shape[-1], device=buf.device, generator=gen).to(buf.dtype)
            buf[rows, pos, heads] += amp * noise
        o = run(c, branch).flatten(1).float()
        for buf, was in kept:
            buf[rows, pos, heads] = was
        c.length = cache.length
        c.pos.copy_(cache.pos[:1].expand_as(c.pos))
        c.overflow.zero_()
        moved = (o[1:len(part) + 1] - o[:1]).abs().amax(-1).tolist()
        silent += [part[r] for r in range(len(part)) if moved[r] <= 1e-3 * scale]
    assert not silent, (f"{branch} at t={t}: {len(silent)} tokens the formula says are read did not change the "
                        f"output when perturbed (KV head, position): {silent[:8]}")
    return {"read": sum(map(len, want)), "unread_poisoned": G * n_cached - sum(map(len, want))}
