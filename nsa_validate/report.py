"""``report.md``, rendered only from ``results.json`` (never written by hand).

Suites may contribute tables through their ``extra`` dict: ``{"tables": {title: [row dicts]},
"plots": [relative paths], "notes": [lines]}``; these are rendered generically.
"""
from __future__ import annotations

from pathlib import Path


def md_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "_(no rows)_\n"
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if (abs(v) < 1e-2 or abs(v) >= 1e4) and v != 0 else f"{v:.3f}".rstrip("0").rstrip(".")
        return "" if v is None else str(v).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _header(res: dict) -> list[str]:
    man, env = res["manifest"], res.get("env", {})
    facts = env.get("facts", {})
    gpu = facts.get("gpu") or {}
    tel = facts.get("telemetry") or {}
    fa = facts.get("flash_attn") or {}
    commit = f"{man.get('commit') or 'no git'}{' (dirty)' if man.get('dirty') else ''}"
    rows = [("date (UTC)", man.get("started")), ("status", man.get("status")),
            ("GPU", gpu.get("name", "none (CPU)")), ("SM", gpu.get("sm", "-")),
            ("driver", f"{tel.get('driver_version', '-')} (CUDA {facts.get('driver_cuda') or '-'})"),
            ("python", facts.get("python")), ("torch", f"{facts.get('torch')} (CUDA {facts.get('torch_cuda') or '-'})"),
            ("triton", facts.get("triton")),
            ("flash-attn", fa.get("version") if fa.get("installed") else "not installed"),
            ("commit", commit), ("profile", f"{man.get('profile')}, level {man.get('level') or 'full'}"), ("command", "`" + " ".join(man.get("command", [])) + "`"),
            ("environment verdict", env.get("verdict", "-"))]
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def render(res: dict) -> str:
    v = res["verdict"]
    out = [f"# nsa-validate: {v.get('headline', v['status'].upper())}", ""]
    if v.get("not_exercised"):
        out += [f"- **{n} not exercised**: {why}" for n, why in v["not_exercised"].items()] + [""]
    out += _header(res) + [""]
    t = v["totals"]
    out.append(f"**Verdict: {v['status'].upper()}**{' (strict)' if v.get('strict') else ''}: "
               f"{t['pass']} passed, {t['fail']} failed, {t['error']} errors, {t['skip']} skipped "
               f"(placeholder cases not counted).")
    out.append("")
    out.append(md_table([{"suite": n, "status": s["status"], "pass": s["counts"]["pass"], "fail": s["counts"]["fail"],
                          "error": s["counts"]["error"], "skip": s["counts"]["skip"],
                          "duration (s)": s["duration_s"], "note": s.get("reason", "")}
                         for n, s in res["suites"].items()]))
    if v["blocking"]:
        out += ["### What blocks a pass", ""] + [f"- {b}" for b in v["blocking"]] + [""]
    for n, s in res["suites"].items():                  # sections a suite places at the top (the layer)
        if (s.get("extra") or {}).get("placement") == "top":
            out += _extra(n, s["extra"], titled=False)

    findings = res.get("env", {}).get("findings", [])
    if findings:
        out += ["## Environment and pairing", "", md_table(findings, ["check", "status", "detail", "fix"])]

    parity = []
    for n, s in res["suites"].items():
        for c in s["cases"]:
            for name, m in c.get("metrics", {}).items():
                if isinstance(m, dict) and "max_abs" in m:
                    parity.append({"suite": n, "case": c["id"], "tensor": name, "status": c["status"],
                                   "max_abs": m["max_abs"], "lowp_err": m["base_err"], "ratio": m["ratio"],
                                   "bound": m["bound"], "rel_rms": m["rel_rms"],
                                   "lowp rel_rms": m.get("lowp_rel_rms"),
                                   "rel_rms bar": "not applied" if m.get("rel_rms_bar_not_applied") else "5e-3",
                                   "backends": ", ".join(f"{k}={'/'.join(b)}" for k, b in c.get("backends", {}).items())})
    if parity:
        out += ["## Parity against the fp32 oracle", "",
                "Bound = 2x (3x for gradients) the low-precision oracle's error + floor; rel_rms bar 5e-3 "
                "(where not applied, the case record says why).", "",
                md_table(parity)]

    t4 = [c["metrics"] for c in res["suites"].get("counters", {}).get("cases", [])
          if c["id"].startswith("paper_table4") and "total" in c.get("metrics", {})]
    if t4:
        rows = [{"S": m["S"], "cmp": m["measured"]["cmp"], "sel": m["measured"]["sel"], "win": m["measured"]["win"],
                 "measured total": m["total"], "paper": m["paper"], "dense": m["dense"],
                 "expected speedup": m["expected_speedup"]} for m in t4]
        out += ["## Decode reads per step (paper Table 4), measured from gathered indices", "", md_table(rows)]

    for n, s in res["suites"].items():
        if (s.get("extra") or {}).get("placement") != "top":
            out += _extra(n, s.get("extra") or {}, titled=True)

    rt = res.get("routing") or {}
    if rt:
        out += ["## What executed", "", f"Evidence: {rt.get('evidence', 'the dispatch log only')}.", ""]
        rows = [{"path": k, "backends (dispatch log)": "/".join(v),
                 "CUDA kernels the GPU ran": "<br>".join((rt.get("observed_kernels") or {}).get(k, [])) or "-"}
                for k, v in (rt.get("executed") or {}).items()]
        rows += [{"path": k, "backends (dispatch log)": "-", "CUDA kernels the GPU ran": "<br>".join(v)}
                 for k, v in (rt.get("observed_kernels") or {}).items() if k not in (rt.get("executed") or {})]
        out += [md_table(rows), ""] if rows else []

    if res.get("comparison"):
        cmpd = res["comparison"]
        shown = [r for r in cmpd.get("rows", []) if r["verdict"] != "ok"]
        out += ["## Differences vs baseline", "",
                f"Baseline: `{cmpd.get('baseline')}`: **{cmpd.get('status')}** (a timing regresses when its median is "
                f"more than {cmpd.get('max_regression_pct')}% slower and its p20-p80 band lies above the baseline's); "
                f"{len(cmpd.get('rows', [])) - len(shown)} metrics unchanged within that rule.", ""]
        out += [f"- warning: {w}" for w in cmpd.get("warnings", [])]
        if cmpd.get("not_compared"):
            out.append(f"- not compared (not selected in this run): {', '.join(cmpd['not_compared'])}")
        out += ["", md_table(shown)]

    if v.get("allowed_skips"):
        out += ["## Skips allowed in --strict (allow-list)", "",
                md_table([{"case": a["case"], "skip reason": a["skip_reason"], "allowed because": a["allowed_because"]}
                          for a in v["allowed_skips"]])]
    skips = [{"suite": n, "case": c["id"], "reason": c["reason"]}
             for n, s in res["suites"].items() for c in s["cases"] if c["status"] == "skip"]
    if skips:
        out += ["## Skipped, with reasons", "", md_table(skips)]
    bad = [{"suite": n, "case": c["id"], "status": c["status"], "reason": c["reason"]}
           for n, s in res["suites"].items() for c in s["cases"] if c["status"] in ("fail", "error")]
    if bad:
        out += ["## Failures and errors", "", md_table(bad)]

    out += ["## Recommendations", ""] + [f"- {r}" for r in recommendations(res)] + [""]
    return "\n".join(out)


def _extra(suite: str, extra: dict, titled: bool) -> list[str]:
    """A suite's own tables, notes and plots (``titled``: table titles prefixed with the suite)."""
    out = []
    for title, rows in (extra.get("tables") or {}).items():
        out += [f"## {suite + ': ' if titled else ''}{title}", "", md_table(rows)]
    out += [f"- {note}" for note in extra.get("notes") or []]
    for plot in extra.get("plots") or []:
        out += ["", f"![{Path(plot).stem}]({plot})", ""]
    return out + [""]


def recommendations(res: dict) -> list[str]:
    recs = []
    for f in res.get("env", {}).get("findings", []):
        if f["status"] in ("broken", "degraded") and f.get("fix"):
            recs.append(f"{f['check']} ({f['status']}): {f['fix']}")
    for n, s in res["suites"].items():
        if s["status"] in ("fail", "error"):
            recs.append(f"`{n}` {s['status']}: read `{s.get('log') or 'its log'}` and rerun with "
                        f"`nsa-validate suite {n}`")
    skipped = [n for n, s in res["suites"].items() if s["status"] == "skip"]
    if skipped:
        recs.append(f"not exercised here: {', '.join(skipped)} (reasons above); a --strict run fails on them")
    if not recs:
        recs.append("nothing to act on: every suite passed")
    return recs
