"""``report.md`` and ``summary.txt``, rendered only from ``results.json`` (never written by hand).

The first screen: the verdict line, one line of GPU, commit, level and counts, what was not
exercised, the key figures (layer vs dense, decode step, selection kernel), what blocks a pass and
the per-suite table; then the details, long tables folded in ``<details>``. ``summary.txt`` is the
first screen as plain text, for chat tools and CI job summaries.

Suites contribute through their ``extra`` (``extra.SuiteExtra``; docs/results.md): tables, notes
and plots are rendered generically (charts only with ``embed_plots``, as Mermaid:
``figures.mermaid``), and the headline figures each suite declares (``summary``) are the key
figures. Nothing here parses a case id.
"""
from __future__ import annotations

from pathlib import Path

from nsa_validate.report import figures
from nsa_validate.report.schema import run_level


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


def key_figures(res: dict) -> dict:
    """The headline numbers of a run, where it measured them (also the fleet report's columns):
    the figures each suite declares (``SuiteExtra.figure``), and the fa2 suite's routing suggestion."""
    suites, out = res["suites"], {}
    for s in suites.values():
        out.update(((s.get("extra") or {}).get("summary")) or {})
    sug = ((suites.get("fa2") or {}).get("extra") or {}).get("suggest")
    if sug:
        out["FA-2 suggestion"] = ", ".join(f"{k}={v}" for k, v in sug.items())
    return out


def _facts_line(res: dict) -> str:
    man, v = res["manifest"], res["verdict"]
    gpu = ((res.get("env") or {}).get("facts") or {}).get("gpu") or {}
    t = v["totals"]
    commit = f"{(man.get('commit') or 'no git')[:12]}{' (dirty)' if man.get('dirty') else ''}"
    return (f"{gpu.get('name', 'CPU (no GPU)')} · commit {commit} · profile {man.get('profile')} · level "
            f"{run_level(man)} · {t['pass']} passed, {t['fail']} failed, {t['error']} errors, "
            f"{t['skip']} skipped")


def summary_text(res: dict) -> str:
    """The first screen as plain text: verdict, facts, not exercised, key figures, blocking."""
    v = res["verdict"]
    out = [f"nsa-validate: {v.get('headline', v['status'].upper())}", _facts_line(res)]
    out += [f"not exercised: {n}: {why}" for n, why in (v.get("not_exercised") or {}).items()]
    out += [f"{k}: {val}" for k, val in key_figures(res).items()]
    out += [f"blocking: {b}" for b in v["blocking"][:10]]
    return "\n".join(out) + "\n"


def _details(summary: str, body: list[str]) -> list[str]:
    return ["<details>", f"<summary>{summary}</summary>", "", *body, "</details>", ""]


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
            ("commit", commit), ("profile", f"{man.get('profile')}, level {run_level(man)}"), ("command", "`" + " ".join(man.get("command", [])) + "`"),
            ("environment verdict", env.get("verdict", "-"))]
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def render(res: dict, embed_plots: bool = False) -> str:
    """report.md of a run's results; ``embed_plots``: the plots drawn inline as Mermaid charts
    (GitHub renders them in job summaries, where it strips embedded images)."""
    v = res["verdict"]
    out = [f"# nsa-validate: {v.get('headline', v['status'].upper())}", "",
           f"**{_facts_line(res)}**{' (strict)' if v.get('strict') else ''} (placeholder cases not counted)", ""]
    if v.get("not_exercised"):
        out += [f"- **{n} not exercised**: {why}" for n, why in v["not_exercised"].items()] + [""]
    figs = key_figures(res)
    if figs:
        out += ["## Key figures", "", md_table([{"figure": k, "value": val} for k, val in figs.items()])]
    out.append(md_table([{"suite": n, "status": s["status"], "pass": s["counts"]["pass"], "fail": s["counts"]["fail"],
                          "error": s["counts"]["error"], "skip": s["counts"]["skip"],
                          "duration (s)": s["duration_s"], "note": s.get("reason", "")}
                         for n, s in res["suites"].items()]))
    if v["blocking"]:
        out += ["### What blocks a pass", ""] + [f"- {b}" for b in v["blocking"]] + [""]
    out += ["## Environment", ""] + _details("machine, versions, commit, command", _header(res) + [""])
    for n, s in res["suites"].items():                  # sections a suite places at the top (the layer)
        if (s.get("extra") or {}).get("placement") == "top":
            out += _extra(n, s["extra"], titled=False, embed_plots=embed_plots)

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
        bad_rows = sum(r["status"] != "pass" for r in parity)
        out += ["## Parity against the fp32 oracle", "",
                "Bound = 2x (3x for gradients) the low-precision oracle's error + floor; rel_rms bar 5e-3 "
                "(where not applied, the case record says why).", ""]
        out += _details(f"{len(parity)} tensors compared" + (f", {bad_rows} in cases that did not pass" if bad_rows
                                                             else ", every case passed"), [md_table(parity)])

    for n, s in res["suites"].items():
        if (s.get("extra") or {}).get("placement") != "top":
            out += _extra(n, s.get("extra") or {}, titled=True, embed_plots=embed_plots)

    rt = res.get("routing") or {}
    if rt:
        out += ["## What executed", "", f"Evidence: {rt.get('evidence', 'the dispatch log only')}.", ""]
        seen, executed = rt.get("observed_kernels") or {}, rt.get("executed") or {}
        per_backend = rt.get("observed_kernels_by_backend") or {}

        def ran(path: str) -> str:
            """The path's kernels, under the backend whose cases ran them where that is known."""
            if path in per_backend:
                return "<br>".join(f"**{who}**: " + ", ".join(names) for who, names in per_backend[path].items())
            return "<br>".join(seen.get(path, [])) or "-"
        rows = [{"path": k, "backends (dispatch log)": "/".join(v), "CUDA kernels the GPU ran": ran(k)}
                for k, v in executed.items()]
        rows += [{"path": k, "backends (dispatch log)": "-", "CUDA kernels the GPU ran": ran(k)}
                 for k in seen if k not in executed]
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
    skips: dict[str, list[str]] = {}
    for n, s in res["suites"].items():
        for c in s["cases"]:
            if c["status"] == "skip":
                skips.setdefault(c["reason"], []).append(f"{n}/{c['id']}")
    if skips:
        out += ["## Skipped, with reasons", "",
                md_table([{"reason": why, "cases": len(ids), "which": ", ".join(ids[:6]) + (" …" if len(ids) > 6 else "")}
                          for why, ids in sorted(skips.items(), key=lambda kv: -len(kv[1]))])]
    bad = [{"suite": n, "case": c["id"], "status": c["status"], "reason": c["reason"]}
           for n, s in res["suites"].items() for c in s["cases"] if c["status"] in ("fail", "error")]
    if bad:
        out += ["## Failures and errors", "", md_table(bad)]

    out += _time_spent(res)
    out += ["## Recommendations", ""] + [f"- {r}" for r in recommendations(res)] + [""]
    return "\n".join(out)


def _time_spent(res: dict) -> list[str]:
    """Where the suites' time went: wall time, processes, and the cases' seconds by phase (summed over
    a suite's processes: with several, they can add up to more than its wall time)."""
    workers = res["manifest"].get("workers") or {}
    rows = [{"suite": n, "wall (s)": s["duration_s"], "processes": workers.get(n, 1),
             "start-up (s)": s.get("startup_s"),
             **{f"{k} (s)": s["phases_s"].get(k) for k in ("compile", "oracle", "bench", "run")}}
            for n, s in res["suites"].items() if s.get("phases_s")]
    if not rows:
        return []
    m = res["manifest"].get("phases_s") or {}
    head = ((f"The command's start {m['start']} s, " if "start" in m else "")
            + (f"the profile's resolution and the environment check {m['env']} s"
               + (f" (the profile's, torch's import and the GPU's start among it, {m['profile']} s)"
                  if "profile" in m else "")
               + f", suites {m['suites']} s (wall"
               + (f", from {m['suites_from']} s into the run" if "suites_from" in m else "") + "). "
               if "env" in m and "suites" in m else ""))
    head = head[:1].upper() + head[1:]
    return ["## Where the time went", "",
            head + _prewarm_line(res["manifest"].get("prewarm")) + _alone_line(res["manifest"].get("gpu_alone_s")) +
            "Per suite, its slowest process's start-up (Python and the imports to the cases' collection), then its "
            "cases' seconds: compiling Triton kernels (cache hits and waits for a kernel another "
            "process was compiling included), the fp32 oracle, timed benches, and the rest of each case.", "",
            md_table(rows), ""]


def _alone_line(held: dict | None) -> str:
    """The timed cases that held the GPU alone (``gpu_share.alone``), their seconds and the longest three."""
    if not held:
        return ""
    top = sorted(held.items(), key=lambda kv: -kv[1])[:3]
    name = lambda nodeid: nodeid.split("/")[-1].replace(".py::test_", " ").removeprefix("test_")  # noqa: E731
    return (f"Timed cases holding a GPU alone: {round(sum(held.values()), 2)} s summed "
            f"({', '.join(f'{name(k)} {v} s' for k, v in top)}{', …' if len(held) > 3 else ''}). ")


def _prewarm_line(p: dict | None) -> str:
    """What the warming processes (``run/prewarm.py``) did, in a sentence (none: nothing to say)."""
    if not p:
        return ""
    if p.get("skipped"):
        return f"Kernels not prewarmed from {p['list']}: {p['skipped']}. "
    began = f", from {p['started_s']} s into the run" if p.get("started_s") is not None else ""
    if p.get("imported_s") is not None:
        began += f" (its process had imported torch and Triton at {p['imported_s']} s)"
    if "compiled" not in p:            # the run ended (killed, a full disk) before the warming's summary
        return f"Prewarm of {p.get('list')} started{began}; the run ended before its summary. "
    line = (f"Prewarm: {p['compiled']} of {p['kernels']} launches of {p['list']} compiled (or found compiled) by "
            f"{p['processes']} processes in {p['wall_s']} s{began}, before and beside the suites")
    if p.get("failed"):
        line += f"; {p['failed']} failed (first: {p['first_failure']})"
    if p.get("not_reached"):
        line += f"; {p['not_reached']} not reached before the suites ended"
    if p.get("unlisted"):
        line += f"; the suites compiled {p['unlisted']} launches the list lacks (the run's kernels.jsonl has them)"
    if p.get("alone_beside_s"):
        beside = p["alone_beside_s"]
        line += (f"; {len(beside)} cases held the GPU alone while the warming processes still compiled (on the CPU, "
                 f"at a lower priority): {round(sum(beside.values()), 2)} s of their time alone")
    return line + ". "


def _extra(suite: str, extra: dict, titled: bool, embed_plots: bool = False) -> list[str]:
    """A suite's own tables, notes and plots (``titled``: table titles prefixed with the suite;
    ``embed_plots``: each plot's data drawn inline too, as a Mermaid chart)."""
    out = []
    for title, rows in (extra.get("tables") or {}).items():
        out += [f"## {suite + ': ' if titled else ''}{title}", "", md_table(rows)]
    out += [f"- {note}" for note in extra.get("notes") or []]
    for plot in extra.get("plots") or []:
        out += ["", f"![{Path(plot).stem}]({plot})", ""]
        chart = (extra.get("charts") or {}).get(plot)
        if embed_plots and chart:
            out += [figures.mermaid(chart), ""]
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
