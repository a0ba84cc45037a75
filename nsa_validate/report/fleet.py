"""Fleet report (``nsa-validate merge``): one table of GPU × suite verdicts and key figures from
run folders made on many machines. Reads only each run's results.json."""
from __future__ import annotations

from pathlib import Path

from nsa_validate.report.markdown import key_figures, md_table


def summarise(runs: list[tuple[Path, dict]]) -> dict:
    rows = []
    for path, res in runs:
        facts = (res.get("env") or {}).get("facts") or {}
        gpu = facts.get("gpu") or {}
        man = res["manifest"]
        rows.append({"run": str(path), "GPU": gpu.get("name", "none (CPU)"), "SM": gpu.get("sm", "-"),
                     "torch": facts.get("torch"), "triton": facts.get("triton"),
                     "commit": f"{(man.get('commit') or 'nogit')[:7]}{' (dirty)' if man.get('dirty') else ''}",
                     "profile": man.get("profile"), "started": man.get("started"),
                     "verdict": res["verdict"]["status"] + (" (strict)" if res["verdict"].get("strict") else ""),
                     "suites": {n: s["status"] for n, s in res["suites"].items()},
                     "counts": res["verdict"]["totals"], "figures": key_figures(res),
                     "blocking": res["verdict"]["blocking"][:5]})
    worst = "fail" if any(r["verdict"].startswith("fail") for r in rows) else \
        "partial" if any(r["verdict"].startswith("partial") for r in rows) else "pass"
    return {"runs": rows, "verdict": worst}


def render(data: dict) -> str:
    rows = data["runs"]
    suites = list(dict.fromkeys(n for r in rows for n in r["suites"]))
    figures = list(dict.fromkeys(k for r in rows for k in r["figures"]))
    out = [f"# nsa-validate fleet report: {data['verdict'].upper()}", "", f"{len(rows)} runs.", "",
           "## Verdicts", "",
           md_table([{"GPU": r["GPU"], "SM": r["SM"], "verdict": r["verdict"],
                      **{n: r["suites"].get(n, "-") for n in suites},
                      "pass/fail/error/skip": "/".join(str(r["counts"][k]) for k in ("pass", "fail", "error", "skip")),
                      "commit": r["commit"], "profile": r["profile"]} for r in rows]),
           "## Key figures", "",
           md_table([{"GPU": r["GPU"], **{k: r["figures"].get(k, "") for k in figures}} for r in rows]),
           "## Runs", "",
           md_table([{"GPU": r["GPU"], "run": r["run"], "started": r["started"], "torch": r["torch"],
                      "triton": r["triton"]} for r in rows])]
    bad = [{"GPU": r["GPU"], "blocking": b} for r in rows for b in r["blocking"]]
    if bad:
        out += ["## What blocks a pass (first five per run)", "", md_table(bad)]
    return "\n".join(out)
