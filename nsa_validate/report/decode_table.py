"""The decode bench's output (docs/method.md): launch-bound labels, ``decode.csv``, two PNG plots and the
report table, from the rows the ``decode`` suite measured (one row per (B, S); ``COLUMNS`` is the
CSV's documentation, also written into the report); and the table of the DRAM bytes Nsight Compute
counted on one step (``dram_rows``)."""
from __future__ import annotations

import math

import pandas as pd

from nsa_validate.measure import roofline
from nsa_validate.report import figures

COLUMNS = {   # decode.csv starts with the run's columns: run_id, gpu, commit, level, dtype
    "B": "batch rows (one new token each)",
    "S": "context: tokens in the cache including the new one (t = S−1)",
    "capacity": "rows the bench's cache is allocated for (suites.decode.capacity × S): room to grow, as a "
                "generation loop allocates it; every step figure but step_full_ms is on this cache",
    "plan_tokens": "tokens the step is planned for (kernels.decode.horizon: the next power of two above t, at "
                   "least capacity / 8 and one scoring program's blocks, at most the capacity): NSAAttention.decode's "
                   "step at this position",
    "timer": "cuda_graph (replays of a captured step), cuda_events (eager) or cpu (perf_counter: noise)",
    "step_ms": "median time of the whole NSA step (graph replay where a GPU is present), planned for plan_tokens",
    "step_full_ms": "the same step on the same tokens in a full cache (capacity = S), timed the same way",
    "headroom_slowdown_pct": "step_ms / step_full_ms − 1, %: what the spare rows cost (the case fails above "
                             "suites.decode.headroom_margin)",
    "step_whole_ms": "the step planned for the whole capacity, every position (what a caller's CUDA graph records "
                     "and replays token after token), timed the same way",
    "whole_slowdown_pct": "step_whole_ms / step_full_ms − 1, % (the case fails above suites.decode.headroom_margin "
                          "too)",
    "step_p20_ms": "20th percentile of the step samples", "step_p80_ms": "80th percentile",
    "step_ws_min_ms": "the fastest of the graph-replayed step's medians over `workspaces` steps, each with its own "
                      "workspace (GPU; the first is step_ms's)",
    "step_ws_max_ms": "the slowest of them: where a step's buffers land moves it (up to ~3% on an H100)",
    "workspaces": "how many steps (workspaces) the range is over; 0 without a GPU",
    "eager_ms": "median of the same step launched eagerly from Python (CUDA events)",
    "graph_ms": "median of the graph-replayed step (empty without a GPU)",
    "floor_ms": "as many launches as the step's, each one program doing nothing, chained as the step's are "
                "(kernels.decode.launch_floor), graph-replayed and timed the same way: a floor under such a "
                "step (GPU)",
    "cmp_ms": "the compressed branch alone", "sel_ms": "selection + the selected branch alone",
    "win_ms": "the window branch alone",
    "dense_sdpa_ms": "dense decode over the whole cache: append + SDPA (fused backends only on a GPU), "
                     "k at d_k and v at d_v: the dense layer's bytes",
    "dense_flash_attn_ms": "dense decode: append + flash_attn_with_kvcache, if installed; where d_k ≠ d_v "
                           "at d = (d_k + d_v)/2 for k and v (FA-2 takes one head dim): the same K+V bytes",
    "dense_flash_attn_padded_ms": "where d_k ≠ d_v: flash_attn_with_kvcache with v zero-padded to d_k "
                                  "(reads 2·d_k per token, more than the dense layer; not in the headline)",
    "speedup_vs_dense": "the faster same-bytes dense decode (dense_sdpa_ms, dense_flash_attn_ms) / step_ms",
    "speedup_vs_padded": "dense_flash_attn_padded_ms / step_ms (flattering: that dense decode reads more bytes)",
    "expected_speedup": "paper Table 4: dense tokens / NSA tokens read per step, S / (cmp + sel + win)",
    "layer_ms": "the whole NSA layer's decode step (q/k/v projections, append, φ, gate, the step above, "
                "output projection; kernels.decode_layer.LayerDecodeStep) graph-replayed at position S−1",
    "layer_p20_ms": "20th percentile of the layer step samples", "layer_p80_ms": "80th percentile",
    "dense_sdpa_layer_ms": "the dense layer's decode step: q/k/v projections, dense_sdpa_ms's attention, "
                           "output projection (graph-replayed)",
    "dense_flash_attn_layer_ms": "the same with dense_flash_attn_ms's attention (same-bytes head dim for "
                                 "the projections too)",
    "layer_speedup_vs_dense": "the faster dense layer step / layer_ms: the decode speedup a user of the layer sees",
    "loop_ms": "NSAAttention.decode called token after token (the README's usage; suites.decode.loop_tokens "
               "tokens, the last at position S−1, compressed spans completing on the way), wall clock per token",
    "loop_events_ms": "the same loop, CUDA events around it, per token (GPU)",
    "loop_host_ms": "the host's own cost per call: the same calls queued behind a GPU sleep, 16 at a time, each 16 "
                    "after an untimed call, as a call back to back follows another (GPU)",
    "loop_gpu_share": "layer_ms / loop_ms: the share of a token's wall time the GPU's work accounts for (GPU)",
    "loop_host_bound": "loop_ms > 1.5 × layer_ms: the host, not the GPU, sets the loop's pace",
    "tokens_read": "tokens per KV head the step read (cmp + sel + win), from the kernel's own counters",
    "bytes": "tokens_read × (d_k + d_v) × bytes/elem × G × B",
    "achieved_gbs": "bytes / step_ms", "pct_copy_bw": "achieved / copy_gbs, %",
    "copy_gbs": "the device copy bandwidth this row's process measured (1 GiB copy, read + write, GB/s): each of the "
                "suite's processes measures its own",
    "pct_spec_bw": "achieved / the profile's spec-sheet bandwidth, %",
    "launch_bound": "eager/graph > 1.5, the time flat in S while bytes grow, or a CPU timer (roofline.label)",
    "launch_bound_why": "which sign, with the figures",
}
TABLE = "decode step: ms, medians of the samples"


WS_SPREAD = 0.03     # workspaces' medians further apart than this get a note (placement alone moves them ~1%)


def finish(rows: list[dict], extra, notes: list[str] = (), meta: dict | None = None) -> pd.DataFrame:
    """Label ``rows`` per batch size, write CSV and plots under ``extra.dir`` (when set), add the
    report table and notes to ``extra`` (extra.SuiteExtra). ``meta`` (``RunContext.run_meta``:
    run id, GPU, commit, level, dtype) leads every CSV row and titles the plots. Returns the table."""
    for B in sorted({r["B"] for r in rows}):
        roofline.label([r for r in rows if r["B"] == B])
    df = pd.DataFrame(rows, columns=list(COLUMNS)).sort_values(["B", "S"])
    meta = meta or {}
    if extra.dir is not None:
        extra.dir.mkdir(parents=True, exist_ok=True)
        figures.with_run_columns(df, meta).to_csv(extra.dir / "decode.csv", index=False)
        _plots(df, extra, meta)
    records = df.to_dict("records")
    for r in records:
        extra.row(TABLE, {
            "B": r["B"], "S": r["S"], "capacity": r["capacity"], "timer": r["timer"], "NSA step": _f(r["step_ms"]),
            "plan tokens": r["plan_tokens"],
            "full cache": _f(r["step_full_ms"]), "headroom cost %": _f(r["headroom_slowdown_pct"], 1),
            "planned for the capacity": _f(r["step_whole_ms"]), "its cost %": _f(r["whole_slowdown_pct"], 1),
            "p20-p80": f"{_f(r['step_p20_ms'])}-{_f(r['step_p80_ms'])}",
            "workspaces": (f"{_f(r['step_ws_min_ms'])}-{_f(r['step_ws_max_ms'])} ({int(r['workspaces'])})"
                           if pd.notna(r["workspaces"]) and r["workspaces"] > 0 else ""),   # none: a row without them
            "eager": _f(r["eager_ms"]), "launch floor": _f(r["floor_ms"]),
            "cmp": _f(r["cmp_ms"]), "sel": _f(r["sel_ms"]), "win": _f(r["win_ms"]),
            "dense SDPA": _f(r["dense_sdpa_ms"]), "dense flash-attn (same bytes)": _f(r["dense_flash_attn_ms"]),
            "x dense (same bytes)": _f(r["speedup_vs_dense"], 2),
            "dense flash-attn, v padded": _f(r["dense_flash_attn_padded_ms"]),
            "x padded dense": _f(r["speedup_vs_padded"], 2), "paper expected x": _f(r["expected_speedup"], 2),
            "NSA layer step": _f(r["layer_ms"]),
            "dense layer step": _f(min((v for v in (r["dense_sdpa_layer_ms"], r["dense_flash_attn_layer_ms"])
                                        if v is not None and not math.isnan(v)), default=None)),
            "x dense layer": _f(r["layer_speedup_vs_dense"], 2),
            "m.decode loop / token": _f(r["loop_ms"]), "host / call": _f(r["loop_host_ms"]),
            "GPU share": _f(r["loop_gpu_share"], 2),
            "loop": "host-bound" if r["loop_host_bound"] else ("GPU-bound" if pd.notna(r["loop_gpu_share"]) else ""),
            "tokens": r["tokens_read"], "GB/s": _f(r["achieved_gbs"], 0),
            "% copy bw": _f(r["pct_copy_bw"], 1), "% spec bw": _f(r["pct_spec_bw"], 1),
            "launch-bound": ("yes: " + r["launch_bound_why"]) if r["launch_bound"] else "no"})
    for n in notes:
        extra.note(n)
    for r in records:
        lo, hi = r.get("step_ws_min_ms"), r.get("step_ws_max_ms")
        if pd.notna(lo) and pd.notna(hi) and hi > (1 + WS_SPREAD) * lo:
            extra.note(f"B={r['B']}, S={r['S']}: the same step timed on its {int(r['workspaces'])} workspaces took "
                       f"{_f(lo)}-{_f(hi)} ms, {100 * (hi / lo - 1):.1f}% apart; the headline is the first's. On an "
                       "H100 the step has run up to ~6% slower, whatever its buffers, in a state of the GPU that eager "
                       "launches bring on and that lasts for seconds (docs/method.md, Decode bench): compare such a "
                       "row with care")
    extra.note("decode.csv columns: " + "; ".join(f"`{k}` {v}" for k, v in COLUMNS.items()))
    return df


def copy_note(rows: list[dict]) -> str | None:
    """The report's line on the copy bandwidth the rows' % copy bw divide by: each bench process measures its
    own (``copy_gbs`` per row), so where they differ it gives their range, not one process's figure."""
    copy = sorted(r["copy_gbs"] for r in rows if r.get("copy_gbs"))
    if not copy:
        return None
    seen = f"{copy[0]:.0f} GB/s" if round(copy[0]) == round(copy[-1]) else (
        f"{copy[0]:.0f}-{copy[-1]:.0f} GB/s over the bench's processes (each row's % copy bw against its own)")
    return f"measured device copy bandwidth: {seen} (1 GiB copy, read + write)"


def summarise(cases, ctx, extra) -> None:
    """The decode suite's summary (registry): from the bench cases' rows (``metrics["row"]``), the
    labels, CSV, plots and report table (``finish``) and the headline figures at the largest batch
    and longest context measured."""
    rows = [dict(c.metrics["row"]) for c in cases if "row" in (c.metrics or {})]
    if not rows:
        return
    gpu = rows[0].get("gpu") or "CPU (Triton interpreter; timings are host time, noise)"
    cfg = ctx.profile.suites.decode
    notes = [f"decode bench on {gpu}: {rows[0].get('config', '')}, {cfg.dtype}", ctx.expect_note()]
    if note := copy_note(rows):
        notes.append(note)
    df = finish(rows, extra, notes, meta=ctx.run_meta(dtype=cfg.dtype))
    top = df[df.B == df.B.max()].sort_values("S").iloc[-1]
    noise = " (CPU timer: host time, noise)" if top.timer == "cpu" else ""
    extra.figure("decode step (B, S)", f"{_f(top.step_ms)} ms ({int(top.B)}, {int(top.S)}), cache of "
                                       f"{int(top.capacity)} rows; full cache {_f(top.step_full_ms)} ms; planned for "
                                       f"the capacity {_f(top.step_whole_ms)} ms{noise}")
    extra.figure("decode % copy bw", _f(top.pct_copy_bw, 1))
    extra.figure("decode x dense", _f(top.speedup_vs_dense, 2))
    if top.layer_ms is not None and not math.isnan(top.layer_ms):
        extra.figure("decode layer step, x dense layer", f"{_f(top.layer_ms)} ms, {_f(top.layer_speedup_vs_dense, 2)}x")
    for _, r in df[df.B == df.B.min()].sort_values("S").tail(1).iterrows():
        host = f", host {_f(r.loop_host_ms)} ms a call" if pd.notna(r.loop_host_ms) else ""
        bound = " (host-bound)" if r.loop_host_bound else ""
        extra.figure("decode m.decode loop (B, S)", f"{_f(r.loop_ms)} ms a token ({int(r.B)}, {int(r.S)}){host}{bound}")


DRAM_TABLE = "decode step: DRAM bytes counted by the GPU (ncu) vs the formula"


def dram_rows(df: pd.DataFrame, launches, B: int, S: int, shares: dict[int, float], formula_total: float,
              counted_total: float, distinct: float) -> list[dict]:
    """The report's rows for one profiled step: per launch (``df`` from ``ncu.dram_bytes``: kernel,
    dram_read, dram_write in bytes, in launch order; ``launches`` what each is) its DRAM bytes and,
    for the launches that read the cache (``shares``: launch index -> the formula's bytes), the
    ratio; then the whole step: DRAM read vs the formula's bytes, with the bytes counted from the
    step's own indices (and their distinct tokens) beside them."""
    rows = [{"B": B, "S": S, "launch": what, "kernel": row.kernel, "DRAM read MB": f"{row.dram_read / 1e6:.2f}",
             "DRAM write MB": f"{row.dram_write / 1e6:.2f}",
             "formula MB": f"{shares[i] / 1e6:.2f}" if i in shares else "",
             "read / formula": f"{row.dram_read / shares[i]:.3f}" if i in shares else ""}
            for i, (row, what) in enumerate(zip(df.itertuples(), launches))]
    total = float(df.dram_read.sum())
    return rows + [{"B": B, "S": S, "launch": "whole step",
                    "kernel": f"counted from indices: {counted_total / 1e6:.2f} MB ({distinct / 1e6:.2f} MB distinct tokens)",
                    "DRAM read MB": f"{total / 1e6:.2f}", "DRAM write MB": f"{df.dram_write.sum() / 1e6:.2f}",
                    "formula MB": f"{formula_total / 1e6:.2f}", "read / formula": f"{total / formula_total:.3f}"}]


def _f(x, digits: int = 4) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _plots(df: pd.DataFrame, extra, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rel = f"suites/{extra.dir.name}"                 # plots are linked relative to the run folder
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for B, d in df.groupby("B"):
        line, = ax.plot(d.S, d.step_ms, "o-", label=f"NSA step B={B} (p20-p80 band)")
        ax.fill_between(d.S, d.step_p20_ms, d.step_p80_ms, color=line.get_color(), alpha=0.2, lw=0)
        if d.layer_ms.notna().any():
            ax.plot(d.S, d.layer_ms, "o-.", color=line.get_color(), alpha=0.6, label=f"NSA layer step B={B}")
        ax.plot(d.S, d.dense_sdpa_ms, "s--", label=f"dense SDPA B={B}")
        if d.dense_flash_attn_ms.notna().any():
            ax.plot(d.S, d.dense_flash_attn_ms, "^:", label=f"dense flash-attn (same bytes) B={B}")
    ax.set(xscale="log", yscale="log", xlabel="context S (tokens)", ylabel="ms per step (median)",
           title=figures.title(f"decode step vs dense ({df.timer.iloc[0]})", meta))
    figures.length_ticks(ax, df.S)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(extra.dir / "decode_time.png", dpi=110)
    plt.close(fig)
    top = df[df.B == df.B.max()].sort_values("S")
    B = int(top.B.iloc[0])
    extra.plot(f"{rel}/decode_time.png", figures.chart(
        f"decode, B={B}, µs per step", "context", top.S, "µs (median)",
        {"NSA attention step": list(top.step_ms * 1e3), "NSA layer step": list(top.layer_ms * 1e3),
         "dense attention (same bytes)": list(top[["dense_sdpa_ms", "dense_flash_attn_ms"]].min(axis=1) * 1e3),
         "dense layer step": list(top[["dense_sdpa_layer_ms", "dense_flash_attn_layer_ms"]].min(axis=1) * 1e3)}))
    if df.pct_copy_bw.notna().any():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for B, d in df.groupby("B"):
            ax.plot(d.S, d.pct_copy_bw, "o-", label=f"B={B}")
        ax.axhline(100, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="context S (tokens)", ylabel="% of measured copy bandwidth",
               title=figures.title("decode step: achieved / copy bandwidth", meta), ylim=(0, 110))
        figures.length_ticks(ax, df.S)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(extra.dir / "decode_roofline.png", dpi=110)
        plt.close(fig)
        Ss = sorted(df.S.unique())
        extra.plot(f"{rel}/decode_roofline.png", figures.chart(
            "decode step, % of measured copy bandwidth", "context", Ss, "%",
            {f"B={B}": [d.set_index("S").pct_copy_bw.get(S) for S in Ss] for B, d in df.groupby("B")}))
