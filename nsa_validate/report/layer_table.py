"""The layer suite's output: ``layer.csv``, the time-vs-S plot, the report's "Whole layer" section
(placed near the top of report.md) and the suite's declared headline figures, from the rows the
``layer`` suite measured (``nsa_validate.bench.layer.Row``)."""
from __future__ import annotations

import math

import pandas as pd

from nsa_validate.report import figures
from nsa_validate.bench.layer import HOST_BOUND, ONE_OP, PARTS_OF_ONE_OP, STAGES, Measured, Row, summed

TABLE = "Whole layer: NSA prefill vs the fastest same-bytes dense layer (ms, medians)"
DENSE_TABLE = "Whole layer: every dense layer measured (ms, medians)"
STAGE_TABLE = "Whole layer: where the time goes (each stage alone, ms; forward / backward)"


def records(rows: list[Row]) -> list[dict]:
    """One flat record per row: the CSV's columns."""
    out = []
    for r in rows:
        s = r.shape
        rec = {"B": s.B, "S": s.S, "d_k": s.d_k, "d_v": s.d_v, "dtype": s.dtype,
               "routes": " ".join(f"{k}={v}" for k, v in r.routes.items())}
        for phase in ("fwd", "fwdbwd"):
            _put(rec, f"nsa_{phase}", getattr(r, f"nsa_{phase}"))
            for name, m in getattr(r, f"dense_{phase}").items():
                _put(rec, f"dense_{name}_{phase}", m)
            best = r.best_dense(phase)
            rec[f"best_dense_{phase}"] = best[0] if best else None
            rec[f"speedup_{phase}"] = r.speedup(phase)
        for st in STAGES:
            rec[f"stage_fwd_{st}_ms"] = _ms(r.stages_fwd.get(st))
            rec[f"stage_bwd_{st}_ms"] = _ms(r.stages_bwd.get(st))
        rec["stages_fwd_sum_ms"] = _sum(summed(r.stages_fwd))
        rec["stages_bwd_sum_ms"] = _sum(summed(r.stages_bwd))
        rec["timer"] = r.nsa_fwd.timer or r.nsa_fwdbwd.timer
        rec["host_bound"] = r.nsa_fwd.host_bound or r.nsa_fwdbwd.host_bound
        rec["dense_beside_compiles"] = r.dense_beside_compiles
        out.append(rec)
    return out


def _put(rec: dict, key: str, m: Measured) -> None:
    rec[f"{key}_ms"], rec[f"{key}_p20_ms"], rec[f"{key}_p80_ms"] = m.ms, m.p20_ms, m.p80_ms
    rec[f"{key}_host_ms"], rec[f"{key}_peak_gib"], rec[f"{key}_oom"] = m.host_ms, m.peak_gib, m.oom or None
    rec[f"{key}_gpu_ms"] = m.gpu_ms


def _ms(m: Measured | None) -> float | None:
    return None if m is None else m.ms


def _stage_cell(r: Row, st: str) -> str:
    """"fwd / bwd" of one stage; a part of the one op shows its forward alone, bracketed (not summed)."""
    if ONE_OP in r.stages_fwd and st in PARTS_OF_ONE_OP:
        return f"({_cell(r.stages_fwd[st])} / in the one op)"
    return f"{_cell(r.stages_fwd[st])} / {_cell(r.stages_bwd[st]) if st in r.stages_bwd else '-'}"


def _sum(ms) -> float | None:
    vals = [m.ms for m in ms if m.ms is not None]
    return sum(vals) if vals else None


def _f(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:.{digits}f}"


def _cell(m: Measured, digits: int = 3) -> str:
    """The timed figure; where it is host-bound, with the GPU's work alone beside it."""
    if m.oom:
        return f"oom ({m.oom[:60]})"
    return f"{_f(m.ms, digits)} (GPU {_f(m.gpu_ms, digits)})" if m.host_bound else _f(m.ms, digits)


def summarise(cases, ctx, extra) -> None:
    """The layer suite's summary (registry): ``finish`` over the bench cases' rows (``metrics["row"]``)."""
    rows = [Row.from_dict(c.metrics["row"]) for c in cases if "row" in (c.metrics or {})]
    if rows:
        finish(rows, extra, device=ctx.device_name or "CPU", meta=ctx.run_meta(dtype=ctx.profile.suites.layer.dtype))
        extra.note(ctx.expect_note())


def finish(rows: list[Row], extra, device: str, meta: dict | None = None) -> pd.DataFrame:
    """CSV and plot under ``extra.dir`` (when set), the report tables and notes, the headline.
    ``meta`` (``RunContext.run_meta``) leads every CSV row and titles the plot."""
    recs = records(rows)
    df = pd.DataFrame(recs).sort_values(["d_k", "B", "S"])
    meta = meta or {}
    if extra.dir is not None:
        extra.dir.mkdir(parents=True, exist_ok=True)
        figures.with_run_columns(df, meta).to_csv(extra.dir / "layer.csv", index=False)
        _plot(rows, extra, meta)
    extra.set("placement", "top")
    for r in sorted(rows, key=lambda r: (r.shape.d_k, r.shape.B, r.shape.S)):
        s = r.shape
        bf, bb = r.best_dense("fwd"), r.best_dense("fwdbwd")
        extra.row(TABLE, {
            "B": s.B, "S": s.S, "d_k/d_v": f"{s.d_k}/{s.d_v}", "routes": ", ".join(f"{k}={v}" for k, v in r.routes.items()),
            "NSA fwd": _cell(r.nsa_fwd), "NSA fwd+bwd": _cell(r.nsa_fwdbwd),
            "NSA peak GiB fwd / fwd+bwd": f"{_f(r.nsa_fwd.peak_gib, 1)} / {_f(r.nsa_fwdbwd.peak_gib, 1)}",
            "dense fwd": f"{_cell(bf[1])} ({bf[0]})" if bf else "",
            "dense fwd+bwd": f"{_cell(bb[1])} ({bb[0]})" if bb else "",
            "dense peak GiB fwd+bwd": _f(bb[1].peak_gib, 1) if bb else "",
            "x dense fwd": _f(r.speedup("fwd"), 2), "x dense fwd+bwd": _f(r.speedup("fwdbwd"), 2),
            "NSA timed / GPU alone fwd, fwd+bwd": f"{_f(r.nsa_fwd.host_ratio, 2)} / {_f(r.nsa_fwdbwd.host_ratio, 2)}",
            "host-bound": "yes" if (r.nsa_fwd.host_bound or r.nsa_fwdbwd.host_bound) else "no",
            "NSA host ms fwd": _f(r.nsa_fwd.host_ms)})
        for name, spec in r.dense.items():
            extra.row(DENSE_TABLE, {"B": s.B, "S": s.S, "d_k/d_v": f"{s.d_k}/{s.d_v}", "dense layer": spec.label,
                                    "fwd": _cell(r.dense_fwd[name]), "fwd+bwd": _cell(r.dense_fwdbwd[name]),
                                    "peak GiB fwd+bwd": _f(r.dense_fwdbwd[name].peak_gib, 1)})
        if r.stages_fwd:
            extra.row(STAGE_TABLE, {"B": s.B, "S": s.S, "d_k/d_v": f"{s.d_k}/{s.d_v}",
                                    **{st: _stage_cell(r, st) for st in STAGES if st in r.stages_fwd},
                                    "sum": f"{_f(_sum(summed(r.stages_fwd)))} / {_f(_sum(summed(r.stages_bwd)))}",
                                    "whole layer": f"{_cell(r.nsa_fwd)} / {_cell(r.nsa_fwdbwd)} (fwd+bwd)"})
    extra.note(f"whole layer on {device}: x [B, S, d_model] through NSAAttention (projections, φ, scoring, three "
               "branches as routed, gate, mix, output projection) vs a dense layer with the same projections and one "
               "causal attention; x dense = fastest dense layer that reads no more K/V bytes per token / NSA. Timings: "
               "median of CUDA-event samples, L2 flushed (what a caller waits for); GPU alone = the same work timed "
               "queued behind a GPU sleep, so that no kernel waits on Python; timed / GPU alone > "
               f"{HOST_BOUND} is host-bound, and such a figure shows the GPU's own beside it as '(GPU x)'; host = "
               "the Python call until it returns.")
    if any(ONE_OP in r.stages_fwd for r in rows):
        parts = ", ".join(PARTS_OF_ONE_OP)
        extra.note(f"stages: where every stage runs on the Triton kernels the layer runs its branches, block "
                   f"selection and gated mix as one op ('{ONE_OP}', forward and backward); its parts ({parts}) "
                   "are bracketed: each timed forward alone, left out of the sum; 'gate + out proj' is the gate MLP "
                   "and the output projection around it.")
    timer = recs[0]["timer"] if recs else ""
    if timer == "cpu":
        extra.note("CPU run: the timer is the host's (perf_counter) and the kernels run under the Triton interpreter; "
                   "these figures prove the plumbing only.")
    extra.note("layer.csv columns: B, S, d_k, d_v, routes; per measurement "
               "<name>_{ms,p20_ms,p80_ms,host_ms,peak_gib,oom,gpu_ms} "
               "for nsa_fwd, nsa_fwdbwd, dense_<layer>_{fwd,fwdbwd}; best_dense_*, speedup_* (dense/NSA); "
               "stage_{fwd,bwd}_<stage>_ms and their sums (without the one op's parts where it ran); timer; "
               "host_bound; dense_beside_compiles.")
    beside = [r.shape.label for r in rows if r.dense_beside_compiles]
    if beside:
        extra.note(f"dense layers timed while the run's warming processes compiled on the CPU ({', '.join(beside)}; "
                   "dense_beside_compiles in layer.csv): their timings are GPU-bound, their host ms read high; the NSA "
                   "layer was timed after the compiles ended.")
    extra.set("summary", headline(rows))
    return df


def headline(rows: list[Row]) -> dict[str, str]:
    """The figures a fleet report shows for this suite: the longest B=1 context per head dims."""
    out = {}
    for dk, dv in sorted({(r.shape.d_k, r.shape.d_v) for r in rows}):
        ones = [r for r in rows if r.shape.B == 1 and (r.shape.d_k, r.shape.d_v) == (dk, dv)]
        if not ones:
            continue
        r = max(ones, key=lambda r: r.shape.S)
        key = f"layer {dk}/{dv} @{r.shape.S}"
        out[f"{key} fwd ms (x dense)"] = f"{_cell(r.nsa_fwd, 2)} ({_f(r.speedup('fwd'), 2)}x)"
        out[f"{key} fwd+bwd ms (x dense)"] = f"{_cell(r.nsa_fwdbwd, 2)} ({_f(r.speedup('fwdbwd'), 2)}x)"
    return out


def _plot(rows: list[Row], extra, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ones = [r for r in rows if r.shape.B == 1]
    if not ones:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    drawn = {}                                  # (d_k, d_v) -> (S, {series: ms}), for report --embed-plots
    for dk, dv in sorted({(r.shape.d_k, r.shape.d_v) for r in ones}):
        rs = sorted((r for r in ones if (r.shape.d_k, r.shape.d_v) == (dk, dv)), key=lambda r: r.shape.S)
        S = [r.shape.S for r in rs]
        for phase, style in (("fwd", "-"), ("fwdbwd", "--")):
            nsa = [getattr(r, f"nsa_{phase}").ms for r in rs]
            dense = [(r.best_dense(phase) or (None, Measured()))[1].ms for r in rs]
            tag = "fwd" if phase == "fwd" else "fwd+bwd"
            line, = ax.plot(S, [math.nan if v is None else v for v in nsa], "o" + style, label=f"NSA {tag} {dk}/{dv}")
            band = [(getattr(r, f"nsa_{phase}").p20_ms, getattr(r, f"nsa_{phase}").p80_ms) for r in rs]
            ax.fill_between(S, [math.nan if a is None else a for a, _ in band], [math.nan if b is None else b for _, b in band],
                            color=line.get_color(), alpha=0.2, lw=0)
            ax.plot(S, [math.nan if v is None else v for v in dense], "s" + style, alpha=0.7, label=f"dense {tag} {dk}/{dv}")
            drawn.setdefault((dk, dv), (S, {}))[1].update({f"NSA {tag}": nsa, f"dense {tag}": dense})
    ax.set(xscale="log", yscale="log", xlabel="sequence length S (B=1)", ylabel="ms (median; band: p20-p80)",
           title=figures.title("whole layer: NSA vs dense", meta))
    figures.length_ticks(ax, [r.shape.S for r in ones])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(extra.dir / "layer_time.png", dpi=110)
    plt.close(fig)
    (dk, dv), (S, series) = next(iter(drawn.items()))         # the smallest head dims
    extra.plot(f"suites/{extra.dir.name}/layer_time.png", figures.chart(
        f"whole layer, B=1, d {dk}/{dv}", "S", S, "ms (median)", series))
