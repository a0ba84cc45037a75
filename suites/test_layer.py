"""layer: the whole NSA layer as people run it, against a dense attention layer on the same device.

Bench (``bench[B…-S…-dk…-dv…]``): per (B, S) and head dims of the profile (``suites.layer``), the
whole ``NSAAttention`` prefill, routed exactly as the profile says (its ``routing``, or
``suites.layer.routing`` where set: the CPU profile routes S=256 to the selection kernel so the
interpreter runs it): forward (no grad),
forward+backward, the peak memory of each, host time beside GPU time, and the same for dense
layers with the same projections (``nsa_validate.bench.layer``: SDPA on fused backends,
flash-attn when installed; padded and same-bytes variants labelled). A measurement that runs out
of memory is a result (``oom`` with the size), not a failure. Each row also times every stage
alone, forward and backward: where the next millisecond is. Every timing is checked against the
hardware (FLOPs it must do at least: the projections for NSA, projections + causal attention for
dense).

Needle (``needle``): at the longest context, a layer whose projections are set so that one key far
back matches the last query and carries a known value: the block holding it must be selected and
the selection branch must return that value. Index or offset bugs that only appear at long range
fail here; a parity test at 4k cannot see them.

The case at the profile's longest B=1 context checks its ``expect.layer_fwd_speedup_min`` /
``layer_fwdbwd_speedup_min``. Each bench case records its row; the suite's summary
(``nsa_validate.report.layer_table.summarise``, run by the harness after the suite) writes ``layer.csv``,
the plot, the report's "Whole layer" section and the headline figures.
"""
from __future__ import annotations

import pytest
import torch

from nsa_core import NSAAttention, routing
from nsa_validate.bench import layer
from nsa_validate.suite.context import current
from nsa_validate.suite.plugin import profile_cases
from nsa_validate.measure.tolerance import DTYPES

CTX = current()
CFG = CTX.profile.suites.layer
DEV = CTX.device

ROUTING = CFG.routing or CTX.profile.routing       # the profile's, unless its layer section says otherwise
SHAPES = [layer.Shape(B, S, CFG.d_model, CFG.kv_heads, CFG.heads_per_group, dk, dv, CFG.dtype, CFG.blocks)
          for dk, dv in CFG.head_dims for B, S in CFG.shapes]
# the profile's expectations hold at the longest B=1 context
CHECKED_S = max((S for B, S in CFG.shapes if B == 1), default=None)


def _flops(shape: layer.Shape, dense_dims: tuple[int, int] | None) -> float:
    """The least arithmetic a forward does: the q/k/v/o projections, plus causal attention for a
    dense layer with head dims ``dense_dims`` (2·(d_k + d_v) FLOPs per query head and key)."""
    B, S, D, G, H = shape.B, shape.S, shape.d_model, shape.G, shape.G * shape.h
    dk, dv = dense_dims or (shape.d_k, shape.d_v)
    proj = 2.0 * B * S * D * (H * dk + G * dk + G * dv + H * dv)
    attn = 2.0 * B * H * S * (S + 1) / 2 * (dk + dv) if dense_dims else 0.0
    return proj + attn


@pytest.fixture
def compiled(shape):
    """The layer's kernels compiled before the timed body (which alone holds the GPU when suites share it);
    -> the dense layers run at the shape (``layer.warm``)."""
    return layer.warm(shape, ROUTING, DEV)


@pytest.mark.parametrize("shape", profile_cases([pytest.param(s, id=s.label) for s in SHAPES], "layer", "shapes", 1))
# its dense layers, GPU-bound, are timed beside the run's warming; the NSA layer after it (``quiet``)
@pytest.mark.nsa_exclusive(beside_warming=True)
def test_bench(shape, record, compiled, quiet):
    row = layer.measure(shape, ROUTING, DEV, budget_ms=CFG.budget_ms, stages=CFG.stages, capture=record.capture,
                        warmed=compiled, quiet=quiet)
    want = routing.prefill_routes(ROUTING, shape.S, cfg=shape.config(), device=torch.device(DEV), dtype=DTYPES[CFG.dtype])
    for br, d in want.items():                # the routed path ran, by the dispatch log and the GPU's kernels
        record.expect_ran(row.log, "prefill", br, d.backend)
    record.metrics["routes"] = row.routes
    for phase, mult in (("fwd", 1), ("fwdbwd", 3)):             # backward: twice the forward's work
        measured = {"nsa": getattr(row, f"nsa_{phase}"), **{f"dense_{k}": v for k, v in getattr(row, f"dense_{phase}").items()}}
        for name, meas in measured.items():
            if meas.oom:
                record.metrics[f"{name}_{phase}"] = {"oom": meas.oom, "shape": shape.label}
                continue
            dims = None if name == "nsa" else row.dense[name.removeprefix("dense_")].attention_dims
            rec = record.timing(f"{name}_{phase}", meas.timing, flops=mult * _flops(shape, dims))
            rec.update(host_ms=meas.host_ms, peak_gib=meas.peak_gib, gpu_ms=meas.gpu_ms, host_bound=meas.host_bound)
    for stage, meas in {**{f"stage_fwd/{k}": v for k, v in row.stages_fwd.items()},
                        **{f"stage_bwd/{k}": v for k, v in row.stages_bwd.items()}}.items():
        if meas.oom:
            record.metrics[stage] = {"oom": meas.oom}
        else:
            record.timing(stage, meas.timing)
    record.metrics["row"] = row.to_dict()      # the suite's summary (layer_table.summarise) tabulates the rows
    record.metrics["speedup"] = {"fwd": row.speedup("fwd"), "fwdbwd": row.speedup("fwdbwd")}
    if shape.B == 1 and shape.S == CHECKED_S and DEV == "cuda":
        exp, problems = CTX.expect, []
        for phase, bar in (("fwd", exp.layer_fwd_speedup_min), ("fwdbwd", exp.layer_fwdbwd_speedup_min)):
            got = row.speedup(phase)
            if bar is not None and (got is None or got < bar):
                problems.append(f"{shape.label} {phase}: NSA layer {got if got is None else round(got, 3)}x dense < "
                                f"{bar}x expected (expect.layer_{phase}_speedup_min)")
        assert not problems, "; ".join(problems)


def _needle_layer(S: int, dtype: torch.dtype):
    """A layer whose projections read fixed slices of x: q = x[:d_k] (every head), k = x[d_k:2d_k],
    v = x[2d_k:2d_k+d_v] (every KV head); φ the mean of its span (MLP weights set so), the output
    projection returns head 0. Returns (module, x [1, S, D], needle position, payload [d_v])."""
    dk, dv = CFG.head_dims[0]
    shape = layer.Shape(1, S, max(CFG.d_model, 2 * dk + dv), CFG.kv_heads, CFG.heads_per_group, dk, dv,
                        CFG.dtype, CFG.blocks)
    cfg = shape.config()
    m = NSAAttention(cfg, ROUTING)
    D, H, G, l = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.cmp_len
    eye = lambda n: torch.eye(n)  # noqa: E731
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.q_proj.weight.copy_(torch.cat([eye(dk), torch.zeros(dk, D - dk)], 1).repeat(H, 1))
        m.k_proj.weight.copy_(torch.cat([torch.zeros(dk, dk), eye(dk), torch.zeros(dk, D - 2 * dk)], 1).repeat(G, 1))
        m.v_proj.weight.copy_(torch.cat([torch.zeros(dv, 2 * dk), eye(dv), torch.zeros(dv, D - 2 * dk - dv)], 1).repeat(G, 1))
        m.o_proj.weight[:dv, :dv] = eye(dv)
        for c, dd in ((m.cmp_k, dk), (m.cmp_v, dv)):
            c.fc1.weight.copy_(eye(dd).repeat(1, l) / l)                  # mean over the span's l tokens
            c.fc2.weight.copy_(eye(dd))
    g = torch.Generator().manual_seed(0)
    x = 0.02 * torch.randn(1, S, D, generator=g)
    pos = S // 5 + 37                                   # far back: not block 0, not local, not in the window
    c = 8.0                                             # positive, so φ's SiLU passes the needle through
    x[0, pos, dk:2 * dk] = c                            # the needle's key
    payload = torch.randn(dv, generator=g)
    x[0, pos, 2 * dk:2 * dk + dv] = payload             # and its value
    x[0, S - 1, :dk] = c                                # the last query looks for it
    return m.to(DEV, DTYPES[CFG.dtype]), x.to(DEV, DTYPES[CFG.dtype]), pos, payload


NEEDLE_S = CFG.needle_len or max((S for _, S in CFG.shapes), default=0)


@pytest.fixture
def needle():
    """The needle's layer and input (``_needle_layer``), built in the setup, beside other suites' cases."""
    if not NEEDLE_S:
        pytest.skip("profile sets no layer shapes (suites.layer.shapes)")
    return _needle_layer(NEEDLE_S, DTYPES[CFG.dtype])


@pytest.mark.nsa_exclusive(beside_warming=True)    # a check of most of the GPU's memory; it times nothing
def test_needle(record, needle):
    S, (m, x, pos, payload) = NEEDLE_S, needle
    with torch.no_grad():
        idx = m.select(x)[0, S - 1]                                     # [G, n]
        with record.capture() as log:                                   # (the profiler is costly: once)
            out = m(x, only="sel")[0, S - 1, :m.cfg.d_v].float().cpu()
    routes = m.routes(S, x.device, x.dtype)
    record.expect_ran(log, "prefill", "sel", routes["sel"].backend)
    blk, cur = pos // m.cfg.block_size, (S - 1) // m.cfg.block_size
    # the needle must be found by scoring: a block the last query takes anyway (block 0, its own and the one
    # before: forced) or a token its window covers would pass without the selection ranking anything
    assert blk not in (0, cur - 1, cur) and pos < S - m.cfg.window, (
        f"S={S}: the needle (token {pos}, block {blk}) sits where the query reads it whatever the scores "
        f"(forced blocks 0, {cur - 1}, {cur}; window from token {S - m.cfg.window})")
    record.metrics.update(S=S, needle_pos=pos, needle_block=blk, selected=idx.tolist(),
                          backend=routes["sel"].backend, max_abs_err=float((out - payload).abs().max()))
    missing = [g for g in range(m.cfg.n_kv_heads) if blk not in idx[g].tolist()]
    assert not missing, f"S={S}: the block holding the needle ({blk}, token {pos}) is not selected for KV heads {missing}"
    assert torch.allclose(out, payload, atol=0.05, rtol=0.02), (
        f"S={S}: the selection branch returns {out[:4].tolist()}… for the needle's value {payload[:4].tolist()}… "
        f"(max abs error {(out - payload).abs().max():.3g})")
