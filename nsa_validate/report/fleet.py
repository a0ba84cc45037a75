"""Fleet report (``nsa-validate merge``): the runs of many nodes, grouped by GPU model and verdict,
the nodes that did not pass (failed, partial, still running, half-written, missing) one by one, and
per GPU model the median, MAD and outliers of each key figure.

Everything here works on small per-run rows: ``row`` keeps what the report needs of one
results.json, ``unfinished`` describes a folder without usable results, ``missing`` an expected node
without a folder. A fleet of hundreds of runs is never held in memory whole; finding and reading
the folders is ``run.fleet_scan``'s.

Outliers: a figure's value is the number its text starts with ("0.1420 ms (16, 65536), …" is
0.142). Per GPU model and figure, with at least ``MIN_VALUES`` runs, a run is an outlier when it
lies more than ``OUTLIER_MADS`` MAD (the median absolute deviation, unscaled) from the model's
median and more than ``REL_TOL`` of the median from it: the floor keeps a fleet whose MAD is 0 (or
below the figures' printed precision) from flagging differences in the last digit, and with MAD 0
any difference beyond it is an outlier.
"""
from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from pathlib import Path

from nsa_validate.report.markdown import key_figures, md_table
from nsa_validate.report.schema import run_level

# a partial run (a suite executed no check) passes as the run's own exit code passes it without
# --strict; under --strict its verdict is already "fail"
PASSING = ("pass", "partial")
VERDICTS = ("pass", "partial", "fail")                   # a finished run's; then the states of the others
STATE_ORDER = (*VERDICTS, "running", "half-written", "missing")
OUTLIER_MADS = 3.0
REL_TOL = 0.01
MIN_VALUES = 3
NAMES_SHOWN = 8                 # node names a group lists in fleet.md (fleet.json lists all)
OUTLIERS_SHOWN = 10
UNKNOWN_GPU = "unknown"
RUN_NAME = re.compile(r"^\d{8}T\d{6}Z-(.+)$")          # rundir.create's folder name: <UTC stamp>-<node>
_NUMBER = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")
_TIME_UNIT = re.compile(r"\s*(ms|us|µs|s)\b")


def node_of(manifest: dict | None, path: Path) -> str:
    """A run's node: the manifest's ``node`` (``--node``), else its ``host``, else the folder's name
    without its time stamp."""
    for key in ("node", "host"):
        v = (manifest or {}).get(key)
        if isinstance(v, str) and v.strip():
            return v.strip()
    m = RUN_NAME.match(path.name)
    return m.group(1) if m else path.name


def _text(v, default: str = "-") -> str:
    return default if v is None or v == "" else str(v)


def row(res: dict, path: Path) -> dict:
    """The row of a run whose results.json was read (``res``, checked by ``schema.load_results``):
    node, GPU, state (the verdict's status), why it did not pass, suite statuses, counts and key
    figures. Nothing else of ``res`` is kept."""
    man, v = res["manifest"], res["verdict"]
    facts = (res.get("env") or {}).get("facts") or {}
    gpu = facts.get("gpu") or {}
    state = v["status"] if v["status"] in VERDICTS else "fail"        # an unknown status is not a pass
    return {"node": node_of(man, path), "run": str(path), "state": state, "strict": bool(v.get("strict")),
            "GPU": _text(gpu.get("name"), "none (CPU)"), "SM": _text(gpu.get("sm")),
            "host": _text(man.get("host")), "torch": _text(facts.get("torch")), "triton": _text(facts.get("triton")),
            "commit": f"{_text(man.get('commit'), 'nogit')[:7]}{' (dirty)' if man.get('dirty') else ''}",
            "profile": _text(man.get("profile")), "level": _text(run_level(man)), "started": _text(man.get("started")),
            "suites": {str(n): _text(s.get("status")) for n, s in res["suites"].items()},
            "counts": {k: v["totals"][k] for k in ("pass", "fail", "error", "skip")},
            "figures": {str(k): _text(x, "") for k, x in key_figures(res).items()},
            "reason": _reason(state, v), "blocking": [str(b) for b in v["blocking"][:5]]}


def _reason(state: str, v: dict) -> str:
    """One line on why a finished run did not pass: its first blocking line, what was not exercised."""
    if state == "pass":
        return ""
    if v["blocking"]:
        return str(v["blocking"][0])
    ne = v.get("not_exercised")
    if isinstance(ne, dict) and ne:
        name, why = next(iter(ne.items()))
        return f"{name} not exercised ({why})"
    return _text(v.get("headline"), state)


def unfinished(path: Path, node: str, state: str, reason: str, gpu: dict | None = None,
               manifest: dict | None = None) -> dict:
    """The row of a folder without usable results: ``state`` "running" or "half-written", ``reason``
    one line on what is there; ``gpu``/``manifest`` what could be read of env.json and manifest.json."""
    man, gpu = manifest or {}, gpu or {}
    return {"node": node, "run": str(path), "state": state, "strict": bool(man.get("strict")),
            "GPU": _text(gpu.get("name"), UNKNOWN_GPU), "SM": _text(gpu.get("sm")), "host": _text(man.get("host")),
            "torch": "-", "triton": "-",
            "commit": f"{_text(man.get('commit'), 'nogit')[:7]}{' (dirty)' if man.get('dirty') else ''}",
            "profile": _text(man.get("profile")), "level": _text(man.get("level")),
            "started": _text(man.get("started")),
            "suites": {}, "counts": {}, "figures": {}, "reason": reason, "blocking": []}


def missing(node: str) -> dict:
    """The entry of an expected node no run folder was found for."""
    return {"node": node, "run": None, "state": "missing", "GPU": UNKNOWN_GPU,
            "reason": "no run folder found for this node (named by --expect)"}


def natural(name: str) -> list:
    """Sort key: node-2 before node-10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def summarise(rows: list[dict], expect: list[str] | tuple = (), expect_count: int | None = None,
              notes: list[str] | tuple = ()) -> dict:
    """fleet.json's content from the runs' rows: verdict and one-line summary, counts, the nodes by
    GPU model and state, the nodes that did not pass, the key figures' statistics and outliers, and
    every row. ``expect``: node names that should each have a run; ``expect_count``: how many runs
    were expected; ``notes``: what the scan could not read."""
    rows = sorted(rows, key=lambda r: (natural(r["node"]), r["run"]))
    found = {r["node"] for r in rows}
    absent = [missing(n) for n in sorted(dict.fromkeys(expect), key=natural) if n not in found]
    # the count's shortfall beyond the named nodes already missing (each missing run counted once)
    short = max(0, expect_count - len(rows) - len(absent)) if expect_count else 0
    states = Counter(r["state"] for r in rows)
    bad = absent or short or any(r["state"] not in PASSING for r in rows)
    verdict = "fail" if bad else "partial" if states["partial"] else "pass"
    counts = {"runs": len(rows), **{s: states[s] for s in STATE_ORDER if s != "missing"},
              "missing": len(absent) + short}
    expected = {"nodes": sorted(dict.fromkeys(expect), key=natural), "count": expect_count,
                "missing_nodes": [m["node"] for m in absent], "missing_unknown": short,
                "not_expected": sorted(found - set(expect), key=natural) if expect else []}
    return {"verdict": verdict, "line": _line(verdict, counts, short, expect_count), "counts": counts,
            "expected": expected, "groups": groups(rows + absent),
            "not_passing": [_brief(r) for r in rows + absent if r["state"] != "pass"],
            "figures": figure_stats(rows), "notes": list(notes), "runs": rows}


def _line(verdict: str, counts: dict, short: int, expect_count: int | None) -> str:
    """e.g. ``fleet FAIL: 2 failed, 1 missing, 1 half-written of 500 runs``."""
    words = {"fail": "failed", "running": "running", "half-written": "half-written", "missing": "missing",
             "partial": "partial"}
    parts = [f"{counts[s]} {w}" for s, w in words.items() if counts[s]]
    if verdict == "pass" or not parts:
        parts = [f"{counts['pass']} passed"]
    tail = f" ({short} of {expect_count} expected runs missing, nodes not known)" if short else ""
    return f"fleet {verdict.upper()}: {', '.join(parts)} of {counts['runs']} runs{tail}"


def _brief(r: dict) -> dict:
    return {"node": r["node"], "GPU": r["GPU"], "state": r["state"], "why": r["reason"], "run": r["run"]}


def groups(entries: list[dict]) -> list[dict]:
    """Nodes by GPU model and state: [{GPU, state, nodes (how many), runs (folders: a node may have
    several, a missing one none), names (every node, each once)}], GPU models in name order, states
    from passing to missing."""
    by: dict[tuple[str, str], Counter] = {}
    for e in entries:
        by.setdefault((e["GPU"], e["state"]), Counter())[e["node"]] += e["run"] is not None
    order = {s: i for i, s in enumerate(STATE_ORDER)}
    return [{"GPU": gpu, "state": state, "nodes": len(runs), "runs": sum(runs.values()),
             "names": sorted(runs, key=natural), "runs_of": {n: k for n, k in runs.items() if k > 1}}
            for (gpu, state), runs in sorted(by.items(), key=lambda kv: (kv[0][0], order[kv[0][1]]))]


def number(value) -> float | None:
    """The number a key figure's text starts with (None: it does not start with one)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        x = float(value)
    elif isinstance(value, str) and (m := _NUMBER.match(value)):
        x = float(m.group(1))
    else:
        return None
    return x if math.isfinite(x) else None


def _is_time(name: str, values: list[str]) -> bool:
    """A figure whose higher value is slower: its name says ms, or its text's number is followed by a time unit."""
    if re.search(r"\bms\b", name):
        return True
    return any((m := _NUMBER.match(v)) and _TIME_UNIT.match(v[m.end():]) for v in values if isinstance(v, str))


def figure_stats(rows: list[dict]) -> list[dict]:
    """Per key figure and GPU model: how many runs gave a number, median, MAD and the outliers
    (module docstring: the rule), each with its node, run, value, direction and distance in MADs."""
    names = list(dict.fromkeys(k for r in rows for k in r["figures"]))
    out = []
    for name in names:
        by_gpu: dict[str, list[tuple[dict, float]]] = {}
        for r in rows:
            x = number(r["figures"].get(name))
            if x is not None:
                by_gpu.setdefault(r["GPU"], []).append((r, x))
        time_like = _is_time(name, [r["figures"].get(name) for r in rows if name in r["figures"]])
        for gpu in sorted(by_gpu):
            out.append({"figure": name, "GPU": gpu, **_stats(by_gpu[gpu], time_like)})
    return out


def _stats(runs: list[tuple[dict, float]], time_like: bool) -> dict:
    """Median, MAD and outliers of one GPU model's values of one figure (``runs``: (row, value))."""
    xs = [x for _, x in runs]
    med = statistics.median(xs)
    mad = statistics.median(abs(x - med) for x in xs)
    tested = len(xs) >= MIN_VALUES
    limit = max(OUTLIER_MADS * mad, REL_TOL * abs(med))
    outliers = []
    for r, x in runs:
        if tested and abs(x - med) > limit:
            up = x > med
            direction = ("slower" if up else "faster") if time_like else ("higher" if up else "lower")
            outliers.append({"node": r["node"], "run": r["run"], "value": x, "direction": direction,
                             "mads": round(abs(x - med) / mad, 1) if mad else None})
    outliers.sort(key=lambda o: -abs(o["value"] - med))
    return {"runs": len(xs), "median": med, "mad": mad, "outlier_test": tested, "outliers": outliers}


def _names(names: list[str], shown: int = NAMES_SHOWN) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f", … (+{more} more: fleet.json lists all)" if more > 0 else "")


def _g(x: float) -> str:
    return f"{x:.4g}"


def _outlier_text(stat: dict) -> str:
    if not stat["outlier_test"]:
        return f"(not tested: fewer than {MIN_VALUES} runs)"
    items = [f"{o['node']} {_g(o['value'])} ({o['direction']}" + (f", {o['mads']:g} MAD)" if o["mads"] else ")")
             for o in stat["outliers"]]
    more = len(items) - OUTLIERS_SHOWN
    return "; ".join(items[:OUTLIERS_SHOWN]) + (f"; … (+{more} more)" if more > 0 else "") or "none"


def render(data: dict) -> str:
    """fleet.md from ``summarise``'s data: header and counts, the nodes by GPU model and state, the
    nodes that did not pass, the key figures per GPU model, then every run (folded)."""
    c, exp = data["counts"], data["expected"]
    out = [f"# nsa-validate fleet report: {data['verdict'].upper()}", "", f"**{data['line']}**", "",
           md_table([{"runs": c["runs"], **{s: c[s] for s in STATE_ORDER},
                      "GPU models": len({g["GPU"] for g in data["groups"]} - {UNKNOWN_GPU})}])]
    if exp["nodes"]:
        gone = _names(exp["missing_nodes"], 20) or "none"
        out.append(f"Expected nodes (--expect): {len(exp['nodes'])}; missing: {gone}.")
        if exp["not_expected"]:
            out.append(f"Runs of nodes --expect did not name: {_names(exp['not_expected'], 20)}.")
    if exp["count"]:
        out.append(f"Expected runs (--expect-count): {exp['count']}; " + (
            f"{exp['missing_unknown']} of {exp['count']} expected runs missing (nodes not known)."
            if exp["missing_unknown"] else f"{c['runs']} found."))
    out += [f"Note: {n}" for n in data["notes"]]
    out += ["", "## Nodes by GPU model and verdict", "",
            md_table([{"GPU": g["GPU"], "verdict / state": g["state"], "nodes": g["nodes"], "runs": g["runs"],
                       "names": _names([n + (f" (×{g['runs_of'][n]})" if n in g["runs_of"] else "")
                                        for n in g["names"]])} for g in data["groups"]])]
    if data["not_passing"]:
        out += ["## Nodes that did not pass", "", md_table(data["not_passing"])]
    if data["figures"]:
        out += ["## Key figures by GPU model", "",
                f"Outliers: more than {OUTLIER_MADS:g} MAD (median absolute deviation) and more than "
                f"{REL_TOL:.0%} from the model's median, tested with at least {MIN_VALUES} runs.", "",
                md_table([{"figure": s["figure"], "GPU": s["GPU"], "runs": s["runs"], "median": _g(s["median"]),
                           "MAD": _g(s["mad"]), "outliers": _outlier_text(s)} for s in data["figures"]])]
    out += _runs_table(data["runs"])
    return "\n".join(out)


def _runs_table(rows: list[dict]) -> list[str]:
    suites = list(dict.fromkeys(n for r in rows for n in r["suites"]))
    figures = list(dict.fromkeys(k for r in rows for k in r["figures"]))
    table = md_table([{"node": r["node"], "GPU": r["GPU"], "SM": r["SM"],
                       "state": r["state"] + (" (strict)" if r["strict"] else ""),
                       **{n: r["suites"].get(n, "-") for n in suites},
                       "pass/fail/error/skip": "/".join(str(r["counts"].get(k, "-"))
                                                        for k in ("pass", "fail", "error", "skip")),
                       **{k: r["figures"].get(k, "") for k in figures},
                       "commit": r["commit"], "profile": r["profile"], "level": r["level"], "torch / triton": f"{r['torch']} / {r['triton']}",
                       "started": r["started"], "run": r["run"]} for r in rows])   # (a suite is named triton)
    return ["", "<details>", f"<summary>All {len(rows)} runs</summary>", "", table, "</details>", ""]
