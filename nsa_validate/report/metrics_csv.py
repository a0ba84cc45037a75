"""``metrics.csv``: every number a run recorded, one per row, loadable with one ``pandas.read_csv``.

Columns (``COLUMNS``): the run (run_id, tool_version, gpu, commit, profile, level), the case (suite,
case, status, params as JSON: the case's pytest parameters), then metric (the dotted path inside the
case's metrics, e.g. ``graph.median_ms`` or ``row.speedup_vs_dense``), value (a float; empty for NaN
or a missing figure) and unit (from the metric's name: ``_ms`` ms, ``_gbs`` GB/s, ``_gib`` GiB,
``pct_`` %, ``speedup``/``ratio`` x; else empty). Booleans and strings inside metrics are left out:
the file holds measurements; ``results.json`` holds everything.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from nsa_validate.report.schema import run_level

COLUMNS = ["run_id", "tool_version", "gpu", "commit", "profile", "level", "suite", "case", "status", "params",
           "metric", "value", "unit"]


def unit(metric: str) -> str:
    leaf = metric.rsplit(".", 1)[-1]
    for suffix, u in (("_ms", "ms"), ("_gbs", "GB/s"), ("_gib", "GiB"), ("_s", "s"), ("_mb", "MB")):
        if leaf.endswith(suffix):
            return u
    if leaf.startswith("pct_") or leaf.endswith("_pct"):
        return "%"
    if "speedup" in leaf or "ratio" in leaf:
        return "x"
    return ""


def _numbers(prefix: str, x):
    """(dotted path, float or None) for every number inside x (dicts walked, lists indexed); a null
    (NaN, or a figure not measured here) gives None."""
    if x is None:
        yield prefix, None
        return
    if isinstance(x, bool) or isinstance(x, str):
        return
    if isinstance(x, (int, float)):
        yield prefix, float(x)
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(f"{prefix}.{k}" if prefix else str(k), v)
    elif isinstance(x, (list, tuple)) and len(x) <= 64:      # long sample lists stay in results.json
        for i, v in enumerate(x):
            yield from _numbers(f"{prefix}[{i}]", v)


def rows(res: dict) -> list[dict]:
    man = res.get("manifest") or {}
    gpu = ((res.get("env") or {}).get("facts") or {}).get("gpu") or {}
    run = {"run_id": man.get("run_id"), "tool_version": man.get("tool_version"),
           "gpu": gpu.get("name", "none (CPU)"), "commit": man.get("commit"), "profile": man.get("profile"),
           "level": run_level(man)}
    out = []
    for suite, s in (res.get("suites") or {}).items():
        for c in s.get("cases", []):
            if c.get("placeholder"):
                continue
            case = {**run, "suite": suite, "case": c["id"], "status": c["status"],
                    "params": json.dumps(c.get("params") or {}, sort_keys=True, default=str)}
            for metric, value in _numbers("", c.get("metrics") or {}):
                if metric.endswith("samples_ms") or "samples_ms[" in metric:
                    continue
                out.append({**case, "metric": metric, "value": value if value is not None and math.isfinite(value) else None,
                            "unit": unit(metric)})
    return out


def write(res: dict, path: Path) -> None:
    import pandas as pd

    from nsa_validate import safefs
    safefs.atomic_write(path, pd.DataFrame(rows(res), columns=COLUMNS).to_csv(index=False))
