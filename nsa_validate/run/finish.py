"""A run's folder, finished: results.json (and its views), routing.json, junit.xml, the manifest
last; ``repair`` for a folder whose process vanished; reading a finished folder back."""
from __future__ import annotations

import contextlib
import errno
import os
import socket
from pathlib import Path

from nsa_validate import safefs
from nsa_validate.config import profiles
from nsa_validate.report import junit, markdown, metrics_csv
from nsa_validate.run import compare, rundir
from nsa_validate.errors import UsageError
from nsa_validate.report.schema import (SCHEMA_VERSION, CaseRecord, SuiteResult, headline, load_results, read_json, to_json, verdict,
                                 write_json)


def routing_record(prof: profiles.Profile, results: dict[str, SuiteResult]) -> dict:
    """routing.json: the policy, the decisions the suites' cases saw it make (per routed path: the
    backend, why, and the length, dtype and device it was asked for), what executed (dispatch log)
    and the CUDA kernels the GPU ran (torch.profiler), also per backend: a case whose dispatch log
    shows one backend on a path ran that backend's kernels there (a case that ran several on one
    path files its kernels under all of them, joined by "/")."""
    decisions: dict[str, set] = {}
    executed: dict[str, set] = {}
    by_backend: dict[str, dict[str, set]] = {}
    for s in results.values():
        for c in s.cases:
            for k, ds in c.routes.items():
                decisions.setdefault(k, set()).update(ds)
            for k, bes in c.backends.items():
                executed.setdefault(k, set()).update(bes)
            for k, names in c.kernels.items():
                who = "/".join(sorted(c.backends.get(k, []))) or "no backend logged"
                by_backend.setdefault(k, {}).setdefault(who, set()).update(names)
    kernels = {k: set().union(*v.values()) for k, v in by_backend.items()}
    return {"policy": prof.routing.to_dict(),
            "decisions": {k: sorted(v) for k, v in sorted(decisions.items())},
            "executed": {k: sorted(v) for k, v in sorted(executed.items())},
            # the CUDA kernels the GPU ran, per path (profiler); empty on a CPU, where the dispatch
            # log ("executed") is the only evidence
            "observed_kernels": {k: sorted(v) for k, v in sorted(kernels.items())},
            "observed_kernels_by_backend": {k: {who: sorted(n) for who, n in sorted(v.items())}
                                            for k, v in sorted(by_backend.items())},
            "evidence": "GPU kernel names (torch.profiler) and the dispatch log" if kernels
            else "the dispatch log only (no CUDA kernels observed: no GPU)"}


def finish(run_dir: Path, manifest: dict, env: dict, prof: profiles.Profile, results: dict[str, SuiteResult],
           strict: bool, status: str, allowed: dict[str, str] | None = None, baseline: dict | None = None,
           max_regression: float = compare.DEFAULT_MAX_REGRESSION_PCT) -> dict:
    """Assemble and write the run's results (``env``: the environment report as a dict); a run
    that did not complete, or regressed against ``baseline``, fails. Returns results.json's content."""
    manifest.update(ended=rundir.utc_now(), status=status)
    res = {"schema_version": SCHEMA_VERSION, "manifest": manifest, "env": env, "profile": prof.to_dict(),
           "routing": routing_record(prof, results), "suites": {n: s.to_dict() for n, s in results.items()},
           "verdict": verdict(results, strict, allowed)}
    if status != "complete":
        res["verdict"]["status"] = "fail"
        res["verdict"]["blocking"].insert(0, f"run {status}")
        res["verdict"]["headline"] = _unfinished_headline(status, results, res["verdict"]["not_exercised"])
    if baseline is not None:
        try:
            res["comparison"] = compare.compare(compare.from_results(res, str(run_dir)), baseline, max_regression)
        except Exception as e:     # noqa: BLE001  (the baseline is checked before the run; the run is never lost)
            why = f"{type(e).__name__}: {e}"
            res["comparison"] = {"status": "error", "baseline": baseline.get("name") or baseline.get("source"),
                                 "max_regression_pct": max_regression, "regressions": [], "rows": [],
                                 "not_compared": [], "warnings": [f"the comparison failed: {why}"], "error": why}
            res["verdict"]["status"] = "fail"
            res["verdict"]["blocking"].append(f"comparison with the baseline failed: {why}")
            res["verdict"]["headline"] = headline("fail", results, res["verdict"]["not_exercised"])
        if res["comparison"]["status"] == "regression":
            res["verdict"]["status"] = "fail"
            res["verdict"]["blocking"] += [f"regression vs baseline: {r}" for r in res["comparison"]["regressions"]]
            res["verdict"]["headline"] = headline("fail", results, res["verdict"]["not_exercised"])
    write_json(run_dir / "routing.json", res["routing"])
    write_json(run_dir / "results.json", res)
    junit.write(res, run_dir / "junit.xml")
    write_views(run_dir, res)
    write_json(run_dir / "manifest.json", manifest)
    return res


def _unfinished_headline(status: str, results: dict[str, SuiteResult], not_exercised: dict) -> str:
    """The verdict line of a run that did not complete: what stopped it first, then the suites (a suite
    an interruption stopped is "stopped", not "errored")."""
    if status == "env-broken":
        return "FAIL: environment broken, suites stopped and none counted (env.json and the report say what is wrong)"
    rest = headline("fail", results, not_exercised).split(": ", 1)[1] if results else ""
    if status == "interrupted":
        rest = rest.replace(" errored", " stopped")
    return f"FAIL: run {status}" + (f"; {rest}" if rest else "")


def write_views(run_dir: Path, res: dict, embed_plots: bool = False) -> None:
    """What ``report`` re-renders from results.json: report.md, summary.txt, metrics.csv."""
    safefs.atomic_write(run_dir / "report.md", markdown.render(res, embed_plots))
    safefs.atomic_write(run_dir / "summary.txt", markdown.summary_text(res))
    metrics_csv.write(res, run_dir / "metrics.csv")


def mark_failed(run_dir: Path, manifest: dict, e: OSError) -> None:
    """A write failed (a full disk, a folder made read-only): remove our temporary files and mark the
    folder ``error: <why>`` so no reader takes it for a running run: by a new file where the disk
    allows, else by rewriting manifest.json in place (its blocks are already allocated). A folder
    that holds nothing of the run (no manifest could be written) is removed. What was done is left
    on ``e.run_folder`` (the folder, and "marked", "removed" or "unmarked") for the message."""
    for tmp in run_dir.rglob("*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()
    why = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    manifest.update(ended=rundir.utc_now(), status=f"error: {why}")
    path, marked = run_dir / "manifest.json", None
    try:
        write_json(path, manifest)
        marked = run_dir
    except OSError:
        try:
            if path.is_file():
                with open(path, "r+", encoding="utf-8") as f:
                    f.write(to_json(manifest))
                    f.truncate()
                marked = run_dir
        except OSError:
            pass
    removed = marked is None and not any(p.is_file() for p in run_dir.rglob("*"))
    if removed:
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)
    e.run_folder = (run_dir, "marked" if marked else "removed" if removed else "unmarked")


def read_manifest(run_dir: Path, required: bool = True) -> dict | None:
    path = run_dir / "manifest.json"
    if not path.is_file():
        if required:
            raise UsageError(f"no manifest.json in '{run_dir}' (not a run folder)")
        return None
    try:
        data = read_json(path)
    except ValueError as e:
        raise UsageError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: not a manifest (expected a JSON object)")
    return data


def load_run(run_dir: Path) -> dict:
    """results.json of a run folder, or a UsageError saying what is wrong with it."""
    res_path = run_dir / "results.json"
    if not res_path.is_file():
        m = read_manifest(run_dir, required=False)
        if m is not None and m.get("status") == "running":
            raise UsageError(f"'{run_dir}' is marked running (pid {m.get('pid')} on {m.get('host')}) and has no results "
                             f"yet; if that process is gone: nsa-validate repair {run_dir}")
        raise UsageError(f"no results.json in '{run_dir}' (not a run folder, or the run never started)")
    try:
        return load_results(res_path)
    except (ValueError, KeyError) as e:
        raise UsageError(f"{res_path}: unreadable results ({e})") from None


def stale(manifest: dict) -> str | None:
    """Why a folder marked running has no process behind it any more (None: it may still run, or
    this machine cannot tell: another host, another PID namespace, no process recorded)."""
    pid, host = manifest.get("pid"), manifest.get("host")
    if not isinstance(pid, int) or (host and host != socket.gethostname()):
        return None
    want = manifest.get("process") or {}
    if want.get("pid_ns") and want["pid_ns"] != (rundir.process_identity(os.getpid()) or {}).get("pid_ns"):
        return None                   # recorded in another container: its pids mean nothing here
    ident = rundir.process_identity(pid)
    if ident is None:
        return f"process {pid} is gone"
    if want.get("start") is not None and ident.get("start") is not None and ident["start"] != want["start"]:
        return f"process {pid} is gone (the pid now belongs to another process)"
    return None


def repair(run_dir: Path, manifest: dict) -> dict:
    """Results of a run whose process vanished, from the records its suites left. A run that died
    between writing results.json and manifest.json (the last write) is finished: its manifest is
    restored from its results, which are left as they are."""
    from nsa_validate.run.runner import read_records, suite_result
    try:
        done = load_results(run_dir / "results.json")
    except (OSError, ValueError):
        done = None
    if done is not None and done["manifest"].get("status") not in (None, "running"):
        write_json(run_dir / "manifest.json", done["manifest"])
        return done
    was = manifest.get("status")
    status = "interrupted (process vanished)" if was in (None, "running") else f"interrupted ({was})"
    try:
        env = read_json(run_dir / "env.json")
    except (OSError, ValueError):
        env = {"verdict": "unknown", "findings": [], "facts": {}}
    try:
        prof = profiles.load(manifest.get("profile_source") or manifest.get("profile") or "")
    except UsageError:
        prof = profiles.Profile(name=str(manifest.get("profile")))
    results = {}
    for name in manifest.get("suites") if isinstance(manifest.get("suites"), list) else []:
        rec = run_dir / "suites" / f"{name}.records.jsonl"
        if not rec.exists():
            results[name] = SuiteResult(name, "skip", reason=f"not run: {status}",
                                        cases=[CaseRecord("not-run", name, "skip", f"run {status}", placeholder=True)])
            continue
        total, cases, _ = read_records(rec)
        results[name] = suite_result(name, run_dir, "" if total is not None and len(cases) >= total
                                     else "process vanished")
    return finish(run_dir, manifest, env, prof, results, bool(manifest.get("strict")), status,
                  manifest.get("allowed_skips") or {})
