"""Baselines and regression gating (SPEC §7): ``nsa-validate baseline save`` and ``compare``.

A baseline is what a run measured, reduced to what a later run is judged against: every case's
status and every timing a case recorded (any metric carrying ``median_ms`` and ``samples_ms``,
i.e. a ``timing.Timing.summary()``), keyed by the machine it came from (GPU model, compute
capability, profile). It is read from a run folder or a saved baseline file alike.

Regression rules:
- correctness: a case that passed in the baseline and fails, errors or is missing now; a case
  that fails now and did not exist then.
- timing: the median slowed by more than ``max_regression_pct`` AND the run's p20–p80 band lies
  wholly above the baseline's (the recorded sample spread is the noise: a slowdown inside it is
  reported as "within noise", never as a regression). Faster is reported, never gated.
"""
from __future__ import annotations

import json
from pathlib import Path

from nsa_validate.errors import UsageError
from nsa_validate.schema import load_results

BASELINE_VERSION = 1
DEFAULT_MAX_REGRESSION_PCT = 10.0


def machine_key(res: dict) -> dict:
    """What a baseline is keyed by: the GPU model, its capability and the profile."""
    return key_of(res.get("env") or {}, res["manifest"].get("profile"))


def key_of(env: dict, profile: str | None) -> dict:
    """``machine_key`` from an env report (``envcheck.EnvReport.to_dict()``) and a profile name."""
    gpu = (env.get("facts") or {}).get("gpu") or {}
    return {"gpu": gpu.get("name", "none (CPU)"), "sm": gpu.get("sm", "-"), "profile": profile}


def timings(res: dict) -> dict[str, dict]:
    """'suite/case/metric' -> {median_ms, p20_ms, p80_ms, reps} for every timing in a run."""
    out = {}

    def walk(prefix: str, m):
        if isinstance(m, dict):
            if "median_ms" in m and "samples_ms" in m:
                out[prefix] = {k: m[k] for k in ("median_ms", "p20_ms", "p80_ms", "reps", "timer") if k in m}
                return
            for k, v in m.items():
                walk(f"{prefix}/{k}", v)
    for name, s in res["suites"].items():
        for c in s["cases"]:
            walk(f"{name}/{c['id']}", c.get("metrics") or {})
    return out


def from_results(res: dict, source: str, name: str | None = None) -> dict:
    return {"baseline_version": BASELINE_VERSION, "name": name, "source": source, **machine_key(res),
            "commit": res["manifest"].get("commit"), "dirty": res["manifest"].get("dirty"),
            "created": res["manifest"].get("started"),
            "cases": {f"{n}/{c['id']}": c["status"] for n, s in res["suites"].items() for c in s["cases"]},
            "timings": timings(res)}


def load(path: Path) -> dict:
    """A baseline from a run folder (its results.json) or a baseline file; UsageError otherwise."""
    path = Path(path)
    try:
        if path.is_dir():
            if not (path / "results.json").is_file():
                raise UsageError(f"baseline '{path}' is a folder without results.json (not a run folder)")
            return from_results(load_results(path / "results.json"), str(path))
        if not path.is_file():
            raise UsageError(f"baseline '{path}' does not exist")
        data = json.loads(path.read_text())
    except (ValueError, KeyError) as e:
        raise UsageError(f"baseline '{path}' is unreadable ({e})") from None
    if data.get("baseline_version") != BASELINE_VERSION:
        raise UsageError(f"'{path}' is not a baseline file of version {BASELINE_VERSION} "
                         f"(baseline_version: {data.get('baseline_version')})")
    return data


def save(res: dict, run_dir: Path, name: str, path: Path, stamp: str) -> dict:
    """Write the baseline of a run to ``path``; an existing file there is kept as ``.bak-<stamp>``."""
    data = from_results(res, str(run_dir), name)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.rename(path.with_name(f"{path.name}.bak-{stamp}"))
    path.write_text(json.dumps(data, indent=1))
    return data


def check_same_machine(run: dict, base: dict) -> None:
    """Comparing timings across GPUs (or profiles) is meaningless: refuse with both keys named."""
    for k in ("gpu", "sm", "profile"):
        if run[k] != base[k]:
            raise UsageError(f"baseline is from another machine: {k} {base[k]!r} (baseline) vs {run[k]!r} (this run); "
                             f"compare against a baseline made on {run['gpu']} {run['sm']} with profile {run['profile']}")


def compare(run: dict, base: dict, max_regression_pct: float = DEFAULT_MAX_REGRESSION_PCT) -> dict:
    """Both arguments as ``from_results``/``load`` return them. Returns {status: pass|regression,
    baseline, max_regression_pct, regressions: [str], rows: [table rows]}."""
    check_same_machine(run, base)
    rows, regressions = [], []
    for case, was in base["cases"].items():
        now = run["cases"].get(case, "missing")
        if was == "pass" and now != "pass" and now != "skip":
            regressions.append(f"{case}: {was} -> {now}")
            rows.append({"metric": case, "baseline": was, "run": now, "change": "", "verdict": "regression"})
        elif was != now:
            rows.append({"metric": case, "baseline": was, "run": now, "change": "", "verdict": "status changed"})
    for case, now in run["cases"].items():
        if case not in base["cases"] and now in ("fail", "error"):
            regressions.append(f"{case}: new case, {now}")
            rows.append({"metric": case, "baseline": "absent", "run": now, "change": "", "verdict": "regression"})
    for key, b in base["timings"].items():
        r = run["timings"].get(key)
        if r is None:
            rows.append({"metric": key, "baseline": _band(b), "run": "not measured", "change": "", "verdict": "missing"})
            continue
        change = 100 * (r["median_ms"] / b["median_ms"] - 1) if b["median_ms"] > 0 else 0.0
        slower = change > max_regression_pct
        outside = r["p20_ms"] > b["p80_ms"]                 # the bands do not overlap
        if slower and outside:
            verdict = "regression"
            regressions.append(f"{key}: {b['median_ms']:.4g} -> {r['median_ms']:.4g} ms (+{change:.1f}%)")
        elif slower:
            verdict = "within noise"
        elif change < -max_regression_pct and r["p80_ms"] < b["p20_ms"]:
            verdict = "faster"
        else:
            verdict = "ok"
        rows.append({"metric": key, "baseline": _band(b), "run": _band(r), "change": f"{change:+.1f}%", "verdict": verdict})
    order = {"regression": 0, "missing": 1, "status changed": 2, "within noise": 3, "faster": 4, "ok": 5}
    rows.sort(key=lambda x: order.get(x["verdict"], 9))
    return {"status": "regression" if regressions else "pass", "baseline": base.get("name") or base.get("source"),
            "max_regression_pct": max_regression_pct, "regressions": regressions, "rows": rows}


def _band(t: dict) -> str:
    return f"{t['median_ms']:.4g} [{t['p20_ms']:.4g}-{t['p80_ms']:.4g}]"
