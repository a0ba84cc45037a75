"""Baselines and regression gating (README: CLI, exit codes, CI gate): ``nsa-validate baseline save`` and ``compare``.

A baseline is what a run measured, reduced to what a later run is judged against: every case's
status and every timing a case recorded (any metric carrying ``median_ms`` and ``samples_ms``,
i.e. a ``timing.Timing.summary()``), keyed by the machine it came from (GPU model, compute
capability, profile). It is read from a run folder or a saved baseline file alike.

Only suites the run selected are compared; the baseline's other suites are listed as "not
compared", never as missing. Regression rules, within those suites:
- correctness: a case that passed in the baseline and now fails, errors or skips (a kernel that
  stopped running is a regression, not a pass); a baseline case that is gone; a case that fails
  now and did not exist then. Placeholder cases (no sizes in the profile, suite not run) are not
  cases and are never compared; a case this tool no longer has (``RETIRED``, with where its
  checks went) is reported as retired, not missing, so older baselines stay usable.
- timing: a timing the baseline measured that the run no longer measures; a median slowed by
  more than ``max_regression_pct`` AND a p20–p80 band wholly above the baseline's (the recorded
  sample spread is the noise: a slowdown inside it is reported as "within noise", never as a
  regression). Faster is reported, never gated. A CPU-timer figure (host time under the Triton
  interpreter) is shown, never gated.
- a warning (not a regression) when torch, triton, flash-attn, the driver or python differ from
  the baseline's: a difference in timings may then be the stack's, not the code's.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from nsa_validate.errors import UsageError
from nsa_validate.report.schema import load_results, read_json, run_level

# cases earlier versions of the suites had, and where their checks are now
RETIRED = {
    "decode/roofline_table": "its expectations are checked by the bench case at the largest batch and longest "
                             "context; its table is the suite's summary",
    "layer/layer_table": "its expectations are checked by the bench case at the longest B=1 context; its table "
                         "is the suite's summary",
}

BASELINE_VERSION = 2
DEFAULT_MAX_REGRESSION_PCT = 10.0


def machine_key(res: dict) -> dict:
    """What a baseline is keyed by: the GPU model, its capability, the profile and the level."""
    man = res["manifest"]
    return key_of(res.get("env") or {}, man.get("profile"), run_level(man), man.get("select"))


def key_of(env: dict, profile: str | None, level: str, select: str | None = None) -> dict:
    """``machine_key`` from an env report (``envcheck.EnvReport.to_dict()``), a profile name, the
    level and the ``-k`` case selection (None: every case)."""
    gpu = (env.get("facts") or {}).get("gpu") or {}
    return {"gpu": gpu.get("name", "none (CPU)"), "sm": gpu.get("sm", "-"), "profile": profile, "level": level,
            "select": select}


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


VERSIONED = ("python", "torch", "triton", "flash_attn", "driver")


def versions(res: dict) -> dict:
    """The stack a run measured on: what a timing difference may come from besides the code."""
    f = (res.get("env") or {}).get("facts") or {}
    fa = f.get("flash_attn") or {}
    return {"python": f.get("python"), "torch": f.get("torch"), "triton": f.get("triton"),
            "flash_attn": fa.get("version") if fa.get("installed") else None,
            "driver": (f.get("telemetry") or {}).get("driver_version")}


def from_results(res: dict, source: str, name: str | None = None) -> dict:
    return {"baseline_version": BASELINE_VERSION, "name": name, "source": source, **machine_key(res),
            "commit": res["manifest"].get("commit"), "dirty": res["manifest"].get("dirty"),
            "created": res["manifest"].get("started"), "versions": versions(res),
            "suites": list(res["manifest"].get("suites") or res["suites"]),
            "cases": {f"{n}/{c['id']}": c["status"] for n, s in res["suites"].items() for c in s["cases"]
                      if not c.get("placeholder") and c["id"] != "not-run"},
            "timings": timings(res)}


def check_max_regression(pct) -> float:
    """``--max-regression``: a finite number > 0 (nan or a negative value would disable the gate)."""
    try:
        pct = float(pct)
    except (TypeError, ValueError):
        raise UsageError(f"--max-regression must be a number of percent, not {pct!r}") from None
    if not math.isfinite(pct) or pct <= 0:
        raise UsageError(f"--max-regression must be a finite number > 0 (percent), not {pct}")
    return pct


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
        data = read_json(path)
    except (ValueError, KeyError) as e:
        raise UsageError(f"baseline '{path}' is unreadable ({e})") from None
    if not isinstance(data, dict) or data.get("baseline_version") not in (1, BASELINE_VERSION):
        # v1 lacks suites/versions: all compared
        raise UsageError(f"'{path}' is not a baseline file of version {BASELINE_VERSION} (baseline_version: "
                         f"{data.get('baseline_version') if isinstance(data, dict) else 'none'})")
    try:
        _check_baseline(data)
    except ValueError as e:
        raise UsageError(f"baseline '{path}' is malformed ({e})") from None
    return data


def _check_baseline(data: dict) -> None:
    """What ``compare`` reads of a baseline file; ValueError naming the first place that is wrong."""
    for key in ("gpu", "sm"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"{key}: missing or not a string")
    for key in ("profile", "name", "source", "commit", "created", "select"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ValueError(f"{key}: not a string")
    if data.get("dirty") is not None and not isinstance(data["dirty"], bool):
        raise ValueError("dirty: not true or false")
    if data.get("suites") is not None and not (isinstance(data["suites"], list)
                                               and all(isinstance(x, str) for x in data["suites"])):
        raise ValueError("suites: not a list of suite names")
    if data.get("versions") is not None and not (isinstance(data["versions"], dict) and all(
            v is None or isinstance(v, (str, int, float)) for v in data["versions"].values())):
        raise ValueError("versions: not an object of version strings")
    if not isinstance(data.setdefault("level", run_level(data)), str):
        raise ValueError("level: not a string")
    if not isinstance(data.get("cases"), dict) or not all(isinstance(v, str) for v in data["cases"].values()):
        raise ValueError("cases: must map case ids to statuses")
    if not isinstance(data.get("timings"), dict):
        raise ValueError("timings: missing or not an object")
    for k, t in data["timings"].items():
        if not (isinstance(t, dict) and all(isinstance(t.get(f), (int, float)) for f in ("median_ms", "p20_ms", "p80_ms"))):
            raise ValueError(f"timings.{k}: needs median_ms, p20_ms and p80_ms numbers")


def check_target(path: Path, run_dir: Path, protected: tuple[Path, ...] = ()) -> None:
    """Refuse a baseline target that could destroy anything: a folder, a path in (or equal to) a
    run folder or one of the ``protected`` roots (the artifacts folder), or an existing file that is
    not a baseline file."""
    from nsa_validate.run import rundir
    p = rundir.resolve(rundir.expand(path))
    if p.is_dir():
        raise UsageError(f"--out '{path}' is a folder; give the baseline file to write (e.g. baselines/NAME.json)")
    if rundir.is_system_location(p):
        raise UsageError(f"--out '{path}' is a system location ({p}); write the baseline to a folder of your own")
    if (anc := rundir.enclosing_run(p)) is not None:
        raise UsageError(f"--out '{path}' is inside the run folder '{anc}'; a baseline never writes into a run")
    for root in (rundir.resolve(run_dir), *(rundir.resolve(r) for r in protected)):
        if p == root or root in p.parents:
            raise UsageError(f"--out '{path}' is inside '{root}' (run folders live there); write the baseline elsewhere")
    if p.exists():
        try:
            is_baseline = "baseline_version" in json.loads(p.read_text(encoding="utf-8"))
        except (ValueError, TypeError, OSError):
            is_baseline = False
        if not is_baseline:
            raise UsageError(f"--out '{path}' exists and is not a baseline file; it is left alone")


def save(res: dict, run_dir: Path, name: str, path: Path) -> tuple[dict, Path | None]:
    """Write the baseline of a run to ``path`` atomically; an existing baseline there is first
    copied to a unique ``.bak-<time>`` (returned, else None). Check the target with ``check_target``."""
    from nsa_validate import safefs
    data = from_results(res, str(run_dir), name)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = safefs.replace_keeping_backup(path, json.dumps(data, indent=1))
    return data, kept


def check_same_machine(run: dict, base: dict) -> None:
    """Comparing timings across GPUs, profiles or levels is meaningless: refuse with both keys named."""
    for k in ("gpu", "sm", "profile"):
        if run[k] != base[k]:
            where = "a CPU" if run["sm"] == "-" else f"{run['gpu']} (sm {run['sm']})"
            prof = f" with profile {run['profile']}" if run["profile"] else ""
            raise UsageError(f"baseline is from another machine: {k} {base[k]!r} (baseline) vs {run[k]!r} (this run); "
                             f"compare against a baseline made on {where}{prof}")
    if run.get("select") != base.get("select"):
        raise UsageError(f"baseline ran cases selected by -k {base.get('select')!r}, this run -k {run.get('select')!r}: "
                         "they ran different cases; compare runs of one selection")
    if run["level"] != base["level"]:
        raise UsageError(f"baseline is of level {base['level']!r}, this run of level {run['level']!r}: they run "
                         f"different cases; compare like with like (--level {base['level']})")


def compare(run: dict, base: dict, max_regression_pct: float = DEFAULT_MAX_REGRESSION_PCT) -> dict:
    """Both arguments as ``from_results``/``load`` return them. Returns {status: pass|regression,
    baseline, max_regression_pct, regressions: [str], rows: [table rows], not_compared: [suite],
    warnings: [str]}."""
    max_regression_pct = check_max_regression(max_regression_pct)
    check_same_machine(run, base)
    selected = set(run.get("suites") or {c.split("/", 1)[0] for c in run["cases"]})
    base_suites = base.get("suites") or sorted({c.split("/", 1)[0] for c in base["cases"]})
    not_compared = [s for s in base_suites if s not in selected]
    compared = lambda key: key.split("/", 1)[0] in selected          # noqa: E731
    rows, regressions = [], []

    def row(metric, b, r, change, verdict):
        rows.append({"metric": metric, "baseline": b, "run": r, "change": change, "verdict": verdict})
        if verdict == "regression":
            regressions.append(f"{metric}: {b} -> {r}" + (f" ({change})" if change else ""))

    for case, was in base["cases"].items():
        if not compared(case):
            continue
        now = run["cases"].get(case, "missing")
        if now == "missing" and case in RETIRED:
            row(case, was, "retired", RETIRED[case], "retired")
        elif was == "pass" and now != "pass":
            row(case, was, now, "", "regression")
        elif now == "missing":             # a case that did not pass (e.g. a suite-process error) went away
            row(case, was, now, "", "gone")
        elif was != now:
            row(case, was, now, "", "status changed")
    for case, now in run["cases"].items():
        if case not in base["cases"] and now in ("fail", "error"):
            row(case, "absent", now, "", "regression")
    for key, b in base["timings"].items():
        if not compared(key):
            continue
        r = run["timings"].get(key)
        if r is None:
            row(key, _band(b), "not measured", "", "not gated (CPU timer)" if _cpu(b) else "regression")
            continue
        change = 100 * (r["median_ms"] / b["median_ms"] - 1) if b["median_ms"] > 0 else 0.0
        slower = change > max_regression_pct
        if _cpu(b) or _cpu(r):
            verdict = "not gated (CPU timer)"
        elif slower and r["p20_ms"] > b["p80_ms"]:        # past the gate and the bands do not overlap
            verdict = "regression"
        elif slower:
            verdict = "within noise"
        elif change < -max_regression_pct and r["p80_ms"] < b["p20_ms"]:
            verdict = "faster"
        else:
            verdict = "ok"
        row(key, _band(b), _band(r), f"{change:+.1f}%", verdict)
    order = {"regression": 0, "status changed": 1, "gone": 1, "within noise": 2, "not gated (CPU timer)": 3, "faster": 4, "ok": 5}
    rows.sort(key=lambda x: order.get(x["verdict"], 9))
    bv, rv = base.get("versions") or {}, run.get("versions") or {}
    warnings = [f"{k} differs from the baseline's: {bv.get(k)} (baseline) vs {rv.get(k)} (this run)"
                for k in VERSIONED if bv and rv and bv.get(k) != rv.get(k)]
    return {"status": "regression" if regressions else "pass", "baseline": base.get("name") or base.get("source"),
            "max_regression_pct": max_regression_pct, "regressions": regressions, "rows": rows,
            "not_compared": not_compared, "warnings": warnings}


def _cpu(t: dict) -> bool:
    return t.get("timer") == "cpu"


def _band(t: dict) -> str:
    return f"{t['median_ms']:.4g} ms [p20-p80 {t['p20_ms']:.4g}-{t['p80_ms']:.4g}]"
