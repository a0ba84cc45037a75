"""Decode roofline figures (docs/method.md): bytes a step reads, achieved bandwidth, launch-bound label.

A decode bench that times Python and host syncs instead of the GPU shows a step time flat in the
context (e.g. ~5-6 ms from 128 to 4096 tokens). Two independent signs expose that, and either labels a row
``launch_bound``: the eager step is much slower than its CUDA-graph replay (eager/graph > 1.5),
or, along a context sweep, the bytes read grow several-fold while the step time barely moves.
A row timed on the CPU (``timer == "cpu"``: no GPU, kernels in the Triton interpreter) is host time
by construction and is labelled so as well.
"""
from __future__ import annotations

LAUNCH_BOUND_RATIO = 1.5      # eager / graph time above this: launch and host overhead dominate
FLAT_BYTES_GROWTH = 4.0       # a sweep whose bytes grow at least this much ...
FLAT_TIME_GROWTH = 1.25       # ... while its time grows less than this is not reading the cache


def bytes_read(tokens_per_kv_head: int, d_k: int, d_v: int, elem_bytes: int, kv_heads: int, batch: int) -> int:
    """K and V bytes one decode step reads: reads × (d_k + d_v) × bytes/elem × G × B."""
    return tokens_per_kv_head * (d_k + d_v) * elem_bytes * kv_heads * batch


def achieved_gbs(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def eager_graph_launch_bound(eager_ms: float, graph_ms: float | None) -> bool | None:
    """None when there is no graph figure to compare with."""
    if graph_ms is None or graph_ms <= 0:
        return None
    return eager_ms / graph_ms > LAUNCH_BOUND_RATIO


def flat_curve(points: list[tuple[int, float]]) -> bool:
    """points [(bytes, ms)] of one sweep: True if the time ignores the bytes (a host-bound curve)."""
    if len(points) < 2:
        return False
    pts = sorted(points)
    (b0, t0), (b1, t1) = pts[0], pts[-1]
    return b0 > 0 and t0 > 0 and b1 / b0 >= FLAT_BYTES_GROWTH and t1 / t0 < FLAT_TIME_GROWTH


def label(rows: list[dict], time_key: str = "step_ms", bytes_key: str = "bytes") -> list[dict]:
    """Set ``launch_bound`` and ``launch_bound_why`` on every row of one sweep (same B, same
    timer). A row is launch-bound if its eager/graph ratio says so, if the whole sweep is flat,
    or if it was timed on the CPU."""
    flat = flat_curve([(r[bytes_key], r[time_key]) for r in rows])
    for r in rows:
        by_graph = eager_graph_launch_bound(r.get("eager_ms", r[time_key]), r.get("graph_ms"))
        why = ["CPU timer: host time (no GPU; kernels interpreted)"] if r.get("timer") == "cpu" else []
        if by_graph:
            why.append(f"eager/graph {r.get('eager_ms', r[time_key]) / r['graph_ms']:.1f} > {LAUNCH_BOUND_RATIO}")
        if flat:
            why.append(f"time flat (<{FLAT_TIME_GROWTH}x) while bytes grew >= {FLAT_BYTES_GROWTH}x over the sweep")
        r["launch_bound"] = bool(why)
        r["launch_bound_why"] = "; ".join(why)
    return rows
