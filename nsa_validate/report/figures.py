"""What the bench tables (``decode_table``, ``layer_table``) share for their CSVs and plots: the
run's columns leading every CSV row, plot titles naming GPU, commit and dtype, ticks at the
measured lengths, and each plot's data as a Mermaid chart for ``report --embed-plots``."""
from __future__ import annotations

import json


def with_run_columns(df, meta: dict):
    """``df`` (a DataFrame) with ``meta`` (``RunContext.run_meta``: run id, GPU, commit, level,
    dtype) as its first columns, those it does not already have."""
    import pandas as pd     # here, not at import: ``report`` (which draws charts) loads without pandas
    lead = {k: v for k, v in meta.items() if k not in df.columns}
    return pd.concat([pd.DataFrame([lead] * len(df), index=df.index), df], axis=1)


def title(what: str, meta: dict) -> str:
    """A plot title naming what, where and on what: GPU · commit · dtype (the CSV beside the PNG
    has the numbers)."""
    where = " · ".join(str(meta[k]) for k in ("gpu", "commit", "dtype") if meta.get(k))
    return f"{what}\n{where}" if where else what


def length_label(S) -> str:
    """A length as axes show it: 4096 -> '4k', 1000 -> '1000'."""
    S = int(S)
    return f"{S // 1024}k" if S >= 1024 and S % 1024 == 0 else str(S)


def length_ticks(ax, S) -> None:
    """Ticks at the measured lengths (a log axis otherwise shows only powers of ten)."""
    ticks = sorted({int(x) for x in S})
    ax.set_xticks(ticks, [length_label(t) for t in ticks])
    ax.minorticks_off()


PALETTE = ("blue", "#1f77b4"), ("orange", "#ff7f0e"), ("green", "#2ca02c"), ("red", "#d62728"), \
          ("purple", "#9467bd"), ("brown", "#8c564b")


def chart(title: str, x_label: str, S, y_label: str, series: dict) -> dict:
    """A plot's data as text for ``report --embed-plots`` (``mermaid``): x at the measured lengths,
    one list of y values per named series (None where not measured)."""
    clean = {k: [None if v is None or v != v else float(v) for v in vals] for k, vals in series.items()}
    return {"title": title, "x_label": x_label, "x": [length_label(s) for s in S], "y_label": y_label, "series": clean}


def mermaid(c: dict) -> str:
    """A Mermaid ``xychart-beta`` line chart of ``chart``'s data: GitHub renders it in markdown
    (job summaries included), where it strips ``data:`` images. A series with a length not measured
    is left out (the chart says which); colours name the series in the title (the chart has no legend)."""
    kept = {k: v for k, v in c["series"].items() if v and all(x is not None for x in v)}
    kept = dict(list(kept.items())[:len(PALETTE)])
    left = [k for k in c["series"] if k not in kept]
    names = ", ".join(f"{PALETTE[i][0]}: {k}" for i, k in enumerate(kept))
    init = {"themeVariables": {"xyChart": {"plotColorPalette": ", ".join(p[1] for p in PALETTE[:len(kept)])}}}
    xs = ", ".join(f'"{x}"' for x in c["x"])
    lines = ["```mermaid", f"%%{{init: {json.dumps(init)}}}%%", "xychart-beta",
             f'    title "{c["title"]} ({names})"' if kept else f'    title "{c["title"]}"',
             f'    x-axis "{c["x_label"]}" [{xs}]', f'    y-axis "{c["y_label"]}"']
    lines += [f"    line [{', '.join(f'{x:.4g}' for x in v)}]" for v in kept.values()]
    lines.append("```")
    if left:
        lines.append(f"(not charted, some lengths unmeasured: {', '.join(left)})")
    return "\n".join(lines)
