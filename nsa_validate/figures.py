"""What the bench tables (``decode_table``, ``layer_table``) share for their CSVs and plots: the
run's columns leading every CSV row, plot titles naming GPU, commit and dtype, ticks at the
measured lengths."""
from __future__ import annotations

import pandas as pd


def with_run_columns(df: pd.DataFrame, meta: dict) -> pd.DataFrame:
    """``df`` with ``meta`` (``RunContext.run_meta``: run id, GPU, commit, level, dtype) as its
    first columns, those it does not already have."""
    lead = {k: v for k, v in meta.items() if k not in df.columns}
    return pd.concat([pd.DataFrame([lead] * len(df), index=df.index), df], axis=1)


def title(what: str, meta: dict) -> str:
    """A plot title naming what, where and on what: GPU · commit · dtype (the CSV beside the PNG
    has the numbers)."""
    where = " · ".join(str(meta[k]) for k in ("gpu", "commit", "dtype") if meta.get(k))
    return f"{what}\n{where}" if where else what


def length_ticks(ax, S) -> None:
    """Ticks at the measured lengths (a log axis otherwise shows only powers of ten)."""
    ticks = sorted({int(x) for x in S})
    ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t) for t in ticks])
    ax.minorticks_off()
