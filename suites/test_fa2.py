"""fa2: FA-2 varlen kernels (flash-attn and torch's varlen_attn) for the window and compressed
branches, against the fp32 oracle; FA-2 vs SDPA per branch; threshold recommendations.

Each backend is tested and reported on its own; a backend that cannot run here skips with the
precise reason (no CUDA, flash-attn not installed or not importable, GPU older than sm80, torch
without varlen_attn). Every case proves from the dispatch log that the FA-2 kernel ran. Method as
in the other suites: inputs made once in the test dtype, the oracle (explicit masks) on those
values in fp32 and in the test dtype, forward within 2x of the low-precision oracle's error.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nsa_core import NSAAttention, reference
from nsa_core.config import NSAConfig
from nsa_core.routing import RoutingPolicy
from nsa_validate.config import thresholds
from nsa_validate.measure import evidence, timing
from nsa_validate.suite.context import current
from nsa_validate.suite.plugin import profile_cases
from nsa_validate.measure.tolerance import DTYPES
from suites.varlen import cu_seqlens, oracle_attention

CTX = current()
CFG = CTX.profile.suites.fa2
DEV = CTX.device
BACKENDS = ("flash_attn", "varlen")
NSA = NSAConfig(d_model=128, n_kv_heads=2, heads_per_group=4, d_k=128, d_v=128)   # l=32, d=16, w=512
MIXED = [1, NSA.cmp_len - 1, 100, 777, 1500]          # includes 1 and l-1 tokens


def _require(backend, dtype, cfg=NSA, window=False):
    from kernels import fa2
    why = fa2.unavailable(backend, device=DEV, dtype=dtype, d_k=cfg.d_k, d_v=cfg.d_v, window=window)
    if why:
        pytest.skip(f"{backend}: {why}")
    return fa2


def _rand(*shape, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, generator=g).to(dtype)


def _oracle(q, k, v, lens_q, lens_k, mask_fn, dtype):
    """Per sequence, masked attention in ``dtype``: mask_fn(positions [c], n_keys) -> [c, n_keys]."""
    return oracle_attention(q, k, v, lens_q, lens_k, lambda rc, pos, n: mask_fn(pos, n)[None, :, None, :], dtype)


def _check(record, name, out, q, k, v, lens_q, lens_k, mask_fn, dtype):
    ref32 = _oracle(q, k, v, lens_q, lens_k, mask_fn, torch.float32)
    ref_lp = _oracle(q, k, v, lens_q, lens_k, mask_fn, dtype)
    record.check(name, out, ref32, ref_lp, dtype=dtype)
    record.metrics["lens"] = lens_q
    record.assert_ok()


CASES = [pytest.param(b, dt, id=f"{b}-{dt}") for b in BACKENDS for dt in CFG.dtypes]


@pytest.mark.parametrize("backend,dt", CASES)
def test_causal_varlen(backend, dt, record):
    dtype = DTYPES[dt]
    fa2 = _require(backend, dtype)
    T, G, H = sum(MIXED), NSA.n_kv_heads, NSA.n_heads
    q, k, v = (_rand(T, n, NSA.d_k, dtype=dtype, seed=i) for i, n in enumerate((H, G, G)))
    with record.capture() as log:
        o = fa2.causal_attention(q, k, v, cu_seqlens(MIXED, DEV), max(MIXED), backend)
    record.expect_ran(log, "kernel", "causal", f"fa2:{backend}")
    causal = lambda pos, n: torch.arange(n, device=DEV)[None, :] <= pos[:, None]  # noqa: E731
    _check(record, "o", o, q, k, v, MIXED, MIXED, causal, dtype)


@pytest.mark.parametrize("backend,dt", CASES)
def test_window_branch(backend, dt, record):
    dtype = DTYPES[dt]
    fa2 = _require(backend, dtype, window=True)
    T, G, H = sum(MIXED), NSA.n_kv_heads, NSA.n_heads
    q, k, v = (_rand(T, n, NSA.d_k, dtype=dtype, seed=10 + i) for i, n in enumerate((H, G, G)))
    with record.capture() as log:
        o = fa2.window_attention(q, k, v, cu_seqlens(MIXED, DEV), max(MIXED), NSA.window, backend)
    record.expect_ran(log, "kernel", "win", f"fa2:{backend}")
    _check(record, "o", o, q, k, v, MIXED, MIXED, lambda pos, n: reference.window_mask(NSA, pos, n), dtype)


@pytest.mark.parametrize("dims", ["128-128", "192-128"])
@pytest.mark.parametrize("backend,dt", CASES)
def test_window_branch_per_kv_head(backend, dt, dims, record):
    """The window branch as long prefills run it (one call per KV head, ``split_heads_from``):
    output and the gradients of q, k, v vs the oracle's autograd, with d_v = d_k and with the
    paper's d_v < d_k (v zero-padded for FA-2, the padding dropped from output and gradients)."""
    dtype = DTYPES[dt]
    d_k, d_v = map(int, dims.split("-"))
    cfg = NSAConfig(d_model=128, n_kv_heads=2, heads_per_group=4, d_k=d_k, d_v=d_v)
    fa2 = _require(backend, dtype, cfg, window=True)
    T, G, H = sum(MIXED), cfg.n_kv_heads, cfg.n_heads
    q, k, v = (_rand(T, n, d, dtype=dtype, seed=30 + i).requires_grad_(True)
               for i, (n, d) in enumerate(((H, d_k), (G, d_k), (G, d_v))))
    do = _rand(T, H, d_v, dtype=dtype, seed=33)
    cu = cu_seqlens(MIXED, DEV)
    with record.capture() as log:
        o = fa2.window_attention(q, k, v, cu, max(MIXED), cfg.window, backend, split_heads_from=0)
        grads = torch.autograd.grad(o, (q, k, v), do)
    record.expect_ran(log, "kernel", "win", f"fa2:{backend}")
    mask = lambda pos, n: reference.window_mask(cfg, pos, n)  # noqa: E731

    def oracle(dt_):
        leaves = [t.detach().to(dt_).requires_grad_(True) for t in (q, k, v)]
        ref = _oracle(*leaves, MIXED, MIXED, mask, dt_)
        return ref.detach(), torch.autograd.grad(ref, leaves, do.to(dt_))
    o32, g32 = oracle(torch.float32)
    olp, glp = oracle(dtype)
    record.check("o", o, o32, olp, dtype=dtype)
    for name, got, r32, rlp in zip(("dq", "dk", "dv"), grads, g32, glp):
        record.check(name, got, r32, rlp, dtype=dtype, factor=3.0)
    record.metrics["lens"] = MIXED
    record.assert_ok()


@pytest.mark.parametrize("backend,dt", CASES)
def test_compressed_branch(backend, dt, record):
    """The residue mapping of kernels/fa2.py: query t sees compressed tokens i with i·d+l−1 <= t."""
    dtype = DTYPES[dt]
    fa2 = _require(backend, dtype)
    T, G, H = sum(MIXED), NSA.n_kv_heads, NSA.n_heads
    n_cmp = [NSA.n_cmp_total(S) for S in MIXED]
    q = _rand(T, H, NSA.d_k, dtype=dtype, seed=20)
    kc, vc = _rand(sum(n_cmp), G, NSA.d_k, dtype=dtype, seed=21), _rand(sum(n_cmp), G, NSA.d_v, dtype=dtype, seed=22)
    layout = fa2.compressed_layout(tuple(MIXED), NSA, torch.device(DEV))
    with record.capture() as log:
        o = fa2.compressed_attention(q, kc, vc, layout, backend)
    record.expect_ran(log, "kernel", "cmp", f"fa2:{backend}")
    _check(record, "o", o, q, kc, vc, MIXED, n_cmp, lambda pos, n: reference.cmp_mask(NSA, pos, n), dtype)


@pytest.mark.parametrize("backend,dt", CASES)
def test_module_on_fa2(backend, dt, record):
    """NSAAttention (paper head dims 192/128: v is zero-padded to 192 for FA-2) with both the
    compressed and window branches routed to FA-2, vs the oracle."""
    dtype = DTYPES[dt]
    cfg = NSAConfig(d_model=128, n_kv_heads=2, heads_per_group=4, d_k=192, d_v=128)
    _require(backend, dtype, cfg, window=True)
    torch.manual_seed(0)
    m = NSAAttention(cfg, RoutingPolicy(fa2_min_len_cmp=0, fa2_min_len_win=0, fa2_backend=backend)).to(DEV).to(dtype)
    x = torch.randn(2, 1000, cfg.d_model, device=DEV).to(dtype)
    idx = m.select(x)
    with record.capture() as log:
        out = m(x, idx=idx)
    for br in ("cmp", "win"):
        record.expect_ran(log, "prefill", br, f"fa2:{backend}")
        record.expect_ran(log, "kernel", br, f"fa2:{backend}")
    ref32 = reference.forward(m, x, idx=idx)["out"]
    ref_lp = reference.forward(m, x, idx=idx, dtype=dtype)["out"]
    record.check("out", out, ref32, ref_lp, dtype=dtype)
    record.assert_ok()


# -- bench and recommendation (GPU) ---------------------------------------------------------
BENCH = dict(G=4, H=64, d=128)            # the reference heads of docs/method.md; bf16, B=1
TABLE = "FA-2 vs SDPA per branch (bf16, B=1, H=64, G=4, d=128, l=32, d=16, w=512)"
SPEEDUPS: dict[str, dict[str, dict[int, float]]] = {"cmp": {}, "win": {}}


def _sdpa(q, k, v, mask):
    """SDPA over [1, H, S, d] with an explicit boolean mask (the masked path SDPA takes)."""
    H, G = q.shape[1], k.shape[1]
    kk, vv = (t.repeat_interleave(H // G, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                          vv.transpose(0, 1)[None], attn_mask=mask)


BENCH_CASES = profile_cases([pytest.param(br, S, id=f"{br}-S{S}") for br in ("cmp", "win") for S in CFG.bench_seq_lens],
                            "fa2", "bench_seq_lens", 2)


@pytest.mark.parametrize("branch,S", BENCH_CASES)
@pytest.mark.nsa_exclusive
def test_bench(branch, S, record, extra):
    dtype = torch.bfloat16
    from kernels import fa2
    ran = [b for b in BACKENDS if fa2.unavailable(b, device=DEV, dtype=dtype, window=branch == "win") is None]
    if not ran:
        pytest.skip("no FA-2 backend can run here: " + "; ".join(
            f"{b}: {fa2.unavailable(b, device=DEV, dtype=dtype)}" for b in BACKENDS))
    G, H, d = BENCH["G"], BENCH["H"], BENCH["d"]
    cfg = NSAConfig(n_kv_heads=G, heads_per_group=H // G, d_k=d, d_v=d)
    q = _rand(S, H, d, dtype=dtype, seed=S)
    cu = cu_seqlens([S], DEV)
    pos = torch.arange(S, device=DEV)
    if branch == "win":
        k, v = _rand(S, G, d, dtype=dtype, seed=S + 1), _rand(S, G, d, dtype=dtype, seed=S + 2)
        mask = reference.window_mask(cfg, pos, S)
        fns = {b: (lambda b=b: fa2.window_attention(q, k, v, cu, S, cfg.window, b)) for b in ran}
    else:
        N = cfg.n_cmp_total(S)
        k, v = _rand(N, G, d, dtype=dtype, seed=S + 1), _rand(N, G, d, dtype=dtype, seed=S + 2)
        mask = reference.cmp_mask(cfg, pos, N)
        layout = fa2.compressed_layout((S,), cfg, torch.device(DEV))
        fns = {b: (lambda b=b: fa2.compressed_attention(q, k, v, layout, b)) for b in ran}
    for b, fn in fns.items():        # one observed block per backend: each must show its own kernels
        with record.capture() as log:
            fn()
        record.expect_ran(log, "kernel", branch, f"fa2:{b}")
    t = {b: timing.bench(fn) for b, fn in fns.items()}
    with evidence.observe(DEV) as klog:
        _sdpa(q, k, v, mask)
    record.expect_kernels(klog, f"kernel/{branch}/sdpa", "sdpa_fused")
    t["sdpa"] = timing.bench(lambda: _sdpa(q, k, v, mask))
    # the least arithmetic: 2·(d_k + d_v) FLOPs per (query head, key the mask allows)
    flops = 2.0 * H * mask.sum().item() * 2 * d
    for name, tm in t.items():
        record.timing(name, tm, flops=flops)
    row = {"branch": branch, "S": S, "SDPA ms": round(t["sdpa"].median_ms, 3)}
    for b in BACKENDS:
        if b in t:
            sp = t["sdpa"].median_ms / t[b].median_ms
            SPEEDUPS[branch].setdefault(b, {})[S] = sp
            row[f"{b} ms"] = round(t[b].median_ms, 3)
            row[f"{b} speedup"] = round(sp, 2)
        else:
            row[f"{b} ms"] = "skipped: " + fa2.unavailable(b, device=DEV, dtype=dtype)
    extra.row(TABLE, row)


def test_recommendation(record, extra):
    """the rule of docs/method.md over the bench above, per branch and backend; the profile suggestion."""
    if not any(SPEEDUPS[br] for br in SPEEDUPS):
        pytest.skip("no FA-2 bench ran here (see the bench cases' reasons)")
    suggest, chosen = {}, set()
    for br in ("cmp", "win"):
        per_backend = {b: thresholds.recommend(sp, CFG.margin) for b, sp in SPEEDUPS[br].items()}
        for b, thr in per_backend.items():
            extra.row("FA-2 threshold recommendation", {
                "branch": br, "backend": b, "margin": CFG.margin,
                "recommended fa2_min_len": thr if thr is not None else "disable",
                "speedups": ", ".join(f"{S}: {x:.2f}x" for S, x in sorted(SPEEDUPS[br][b].items()))})
        backend, suggest[f"fa2_min_len_{br}"] = thresholds.pick_backend(per_backend)
        chosen |= {backend} - {None}
    # one backend for every branch that uses FA-2, else let the module pick per machine
    suggest = {"fa2_backend": chosen.pop() if len(chosen) == 1 else "auto", **suggest}
    extra.set("suggest", suggest)
    record.metrics["suggest"] = suggest
