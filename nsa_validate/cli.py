"""``nsa-validate``: env, list, suite, oneshot, report, repair, compare, baseline save, merge, profile suggest.

Machine output (``--json``) goes to stdout; tables and progress go to stderr (rich turns colour
off when stderr is not a TTY or NO_COLOR is set). Exit codes: 0 pass, 1 a check failed or
errored, 2 bad usage or input, 3 environment broken, 130 interrupted.
"""
from __future__ import annotations

import enum
import errno
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from nsa_validate import __version__, safefs, startup
from nsa_validate.config import profiles, thresholds
from nsa_validate.config.registry import SUITES
from nsa_validate.console import ConsoleListener, err, show_comparison, show_env, show_verdict
from nsa_validate.errors import EXIT_ENV_BROKEN, EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError
from nsa_validate.run import compare, rundir
from nsa_validate.run.stop import Stop

# The run lifecycle (nsa_validate.run's execute/finish), the environment check and the fleet report are
# imported by the commands that use them: `--help`, `list` and every usage error answer without loading them.
if TYPE_CHECKING:
    from nsa_validate.run.execute import RunRequest

HELP_FLAGS = {"help_option_names": ["-h", "--help"]}
# The root's flags a command line leaves unset default to False, not None: typer (0.29) coerces a None through a
# pydantic adapter it builds for the flag, and importing pydantic for that was ~0.25 s of every subcommand's
# `--help` (the CPU bound of `test_light_commands_load_neither_torch_nor_pandas`); a bool it passes through.
ROOT_FLAGS_UNSET = {"help": False, "install_completion": False, "show_completion": False}
app = typer.Typer(add_completion=True, pretty_exceptions_enable=False, no_args_is_help=True,
                  context_settings={**HELP_FLAGS, "default_map": ROOT_FLAGS_UNSET},
                  help="Hardware validation harness for Native Sparse Attention.")


def _print_version(value: bool) -> None:
    if value:
        print(f"nsa-validate {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Hardware validation harness for Native Sparse Attention."""
JsonOpt = typer.Option(False, "--json", help="print machine-readable JSON on stdout")
def _profile_names(incomplete: str) -> list[str]:
    """Shell completion of --profile: the shipped profiles' names."""
    return sorted(p.stem for p in profiles.PROFILE_DIR.glob("*.yaml") if "." not in p.stem and p.stem.startswith(incomplete))


ProfileOpt = typer.Option(None, "--profile", autocompletion=_profile_names,
                          help="profile name (profiles/NAME.yaml) or path; default: from the GPU")
OutOpt = typer.Option(None, "--out", help="root folder for run folders (default: ./artifacts)")
StrictOpt = typer.Option(False, "--strict", help="a skipped case fails the run (unless --allow-skips lists it)")
MaxRegOpt = typer.Option(compare.DEFAULT_MAX_REGRESSION_PCT, "--max-regression",
                         help="slowdown (%) beyond the sample spread that fails")
Level = enum.Enum("Level", {n: n for n in profiles.LEVELS}, type=str)   # typer shows the choices
LevelOpt = typer.Option(Level(profiles.DEFAULT_LEVEL), "--level", case_sensitive=False,
                        help="quick (a parity case per kernel, one decode and one layer row: ~1 min on a fresh H200 "
                             "pod, ~25 s warm) | standard (every suite and kernel path: ~1.5 min on an H200 pod, cold) | "
                             "full (the profile's whole sweep)")
ShareOpt = typer.Option(None, "--share-gpu/--one-at-a-time",
                        help="run the suites at once on each GPU, parity cases together and every timed case "
                             "alone on it (default on a GPU), or one suite after another")
SelectOpt = typer.Option(None, "-k", help="pytest expression selecting cases in every suite, e.g. 'parity and not S65536'")
TimeoutOpt = typer.Option(None, "--timeout", min=1, help="seconds each suite may run (instead of the profile's)")
WorkersOpt = typer.Option(None, "--workers", min=1, help="pytest processes per suite, taking its cases in turn "
                          "(default: from the cores; 1 with --one-at-a-time on a GPU)")
AllowOpt = typer.Option(None, "--allow-skips", help="YAML {suite | 'suite/case-pattern': reason}: skips --strict accepts")
NodeOpt = typer.Option(None, "--node", help="the node's name for the manifest and the run folder, as `merge` "
                       "reports it (default: this machine's host name; e.g. $SLURMD_NODENAME, a pod's spec.nodeName)")


@app.command("env")
def env_cmd(json_out: bool = JsonOpt) -> None:
    """Check torch / triton / flash-attn / CUDA pairing on this machine."""
    from nsa_validate.env import envcheck
    rep = envcheck.collect()
    show_env(rep)
    if json_out:
        print(json.dumps(rep.to_dict(), indent=2, default=str))
    raise typer.Exit(EXIT_ENV_BROKEN if rep.verdict == "broken" else EXIT_OK)


@app.command("list")
def list_cmd(json_out: bool = JsonOpt) -> None:
    """List the suites."""
    rows = [{"name": s.name, "proves": s.proves} for s in SUITES.values()]
    t = Table("suite", "what it proves")
    for r in rows:
        t.add_row(r["name"], r["proves"])
    err.print(t)
    if json_out:
        print(json.dumps(rows, indent=2))


SuiteName = enum.Enum("SuiteName", {n: n for n in SUITES}, type=str)   # choices in --help and completion


@app.command("suite")
def suite_cmd(names: List[SuiteName] = typer.Argument(..., help="suite names (see `nsa-validate list`)"),
              profile: Optional[str] = ProfileOpt, level: Level = LevelOpt, out: Optional[str] = OutOpt,
              strict: bool = StrictOpt, allow_skips: Optional[Path] = AllowOpt, json_out: bool = JsonOpt,
              share_gpu: Optional[bool] = ShareOpt, select: Optional[str] = SelectOpt,
              timeout: Optional[int] = TimeoutOpt, workers: Optional[int] = WorkersOpt,
              node: Optional[str] = NodeOpt) -> None:
    """Run the named suites."""
    from nsa_validate.run.execute import RunRequest
    req = RunRequest(list(dict.fromkeys(n.value for n in names)), profile, level.value, out, strict,
                         allowed_skips=_allow_list(allow_skips, strict), share_gpu=share_gpu, select=select,
                         timeout=timeout, workers=workers, node=node)
    raise typer.Exit(_run(req, json_out))


@app.command("oneshot")
def oneshot_cmd(profile: Optional[str] = ProfileOpt, level: Level = LevelOpt, out: Optional[str] = OutOpt,
                strict: bool = StrictOpt,
                allow_skips: Optional[Path] = AllowOpt, json_out: bool = JsonOpt,
                keep_going: bool = typer.Option(False, "--keep-going", help="run the suites even if the environment is broken"),
                baseline: Optional[Path] = typer.Option(None, "--baseline", help="run folder or baseline file to gate against"),
                max_regression: float = MaxRegOpt,
                gpus: Optional[str] = typer.Option(None, "--gpus", help="N or 'all': shard the suites over local GPUs"),
                share_gpu: Optional[bool] = ShareOpt, select: Optional[str] = SelectOpt,
                timeout: Optional[int] = TimeoutOpt, workers: Optional[int] = WorkersOpt,
                node: Optional[str] = NodeOpt) -> None:
    """Environment check, then every suite: one verdict and one run folder."""
    from nsa_validate.run.execute import RunRequest
    compare.check_max_regression(max_regression)
    base = compare.load(baseline) if baseline is not None else None
    req = RunRequest(list(SUITES), profile, level.value, out, strict, gate_env=not keep_going,
                         allowed_skips=_allow_list(allow_skips, strict), baseline=base, max_regression=max_regression,
                         n_gpus=_gpu_count(gpus), share_gpu=share_gpu, select=select, timeout=timeout,
                         workers=workers, node=node)
    raise typer.Exit(_run(req, json_out))


def _allow_list(path: Path | None, strict: bool) -> dict[str, str]:
    """The --allow-skips file: a mapping of suite name or 'suite/case' pattern to a non-empty reason."""
    if path is None:
        return {}
    if not strict:
        err.print("warning: --allow-skips only matters with --strict (without it a skip never fails the run)",
                  highlight=False, markup=False, soft_wrap=True)
    if not path.is_file():
        raise UsageError(f"--allow-skips '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise UsageError(f"--allow-skips '{path}' is not UTF-8 text") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--allow-skips '{path}' is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--allow-skips '{path}' must map 'suite' or 'suite/case-pattern' to a reason")
    for k, v in data.items():
        if not isinstance(v, str) or not v.strip():
            raise UsageError(f"--allow-skips '{path}': '{k}' has no reason (every allowed skip needs one)")
        if str(k).split("/")[0] not in SUITES:
            raise UsageError(f"--allow-skips '{path}': '{k}' names no suite (known: {', '.join(SUITES)})")
    return {str(k): v.strip() for k, v in data.items()}


def _gpu_count(gpus: str | None) -> int:
    if gpus is None:
        return 1
    import torch
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == "all":
        n = have
    else:
        try:
            n = int(gpus)
        except ValueError:
            raise UsageError(f"--gpus takes a number or 'all', not '{gpus}'") from None
    if n < 1 or n > have:
        raise UsageError(f"--gpus {gpus}: this machine has {have} visible CUDA GPU(s)")
    return n


@app.command("compare")
def compare_cmd(run_dir: Path = typer.Argument(..., help="a run folder"),
                baseline: Path = typer.Option(..., "--baseline", help="a run folder or a baseline file"),
                max_regression: float = MaxRegOpt,
                json_out: bool = JsonOpt) -> None:
    """Compare a run with a baseline: exit 1 on a regression (correctness or timing beyond noise)."""
    from nsa_validate.run.finish import load_run
    compare.check_max_regression(max_regression)
    res = load_run(run_dir)
    cmp = compare.compare(compare.from_results(res, str(run_dir)), compare.load(baseline), max_regression)
    show_comparison(cmp)
    if json_out:
        print(json.dumps(cmp, indent=2))
    raise typer.Exit(EXIT_FAIL if cmp["status"] == "regression" else EXIT_OK)


baseline_app = typer.Typer(no_args_is_help=True, context_settings=HELP_FLAGS, help="Baselines for `compare` and `oneshot --baseline`.")
app.add_typer(baseline_app, name="baseline")


@baseline_app.command("save")
def baseline_save_cmd(run_dir: Path = typer.Argument(..., help="a run folder"),
                      name: str = typer.Option(..., "--name", help="baseline name (letters, digits, . _ -)"),
                      out: Optional[Path] = typer.Option(None, "--out", help="file to write (default baselines/NAME.json)"),
                      force: bool = typer.Option(False, "--force", help="save a run that failed or executed nothing"),
                      json_out: bool = JsonOpt) -> None:
    """Save a run's statuses and timings as a baseline, keyed by GPU model, capability and profile."""
    import re
    from nsa_validate.run.finish import load_run
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise UsageError(f"--name '{name}': use letters, digits, '.', '_' and '-' only")
    res = load_run(run_dir)
    v = res["verdict"]
    unfit = ("executed no case" if v["totals"]["pass"] + v["totals"]["fail"] == 0 else
             "failed" if v["status"] == "fail" else None)
    if unfit and not force:
        raise UsageError(f"run '{run_dir}' {unfit}: a baseline of it would judge later runs by it; "
                         f"give --force to save it anyway")
    if unfit:
        err.print(f"[yellow]warning[/]: run '{escape(str(run_dir))}' {unfit}; saved as a baseline because of --force")
    if out is not None and not str(out).strip():
        raise UsageError("--out is empty; give the baseline file to write")
    path = rundir.expand(out) if out is not None else Path.cwd() / "baselines" / f"{name}.json"
    path = rundir.resolve(path) if path.is_symlink() else path     # a link is written through, to its target
    compare.check_target(path, run_dir, protected=(rundir.default_out(),))
    data, kept = compare.save(res, run_dir, name, path)
    err.print(f"baseline '{name}' ({data['gpu']} {data['sm']}, profile {data['profile']}): {len(data['cases'])} cases, "
              f"{len(data['timings'])} timings -> {path}" + (f" (the previous one kept as {kept.name})" if kept else ""))
    if json_out:
        print(json.dumps({"baseline": str(path), "backup": str(kept) if kept else None,
                          "gpu": data["gpu"], "sm": data["sm"], "profile": data["profile"]}))


@app.command("merge")
def merge_cmd(paths: List[Path] = typer.Argument(..., metavar="PATH", help="run folders, or folders holding "
                                                 "run folders at any depth (e.g. the --out every node wrote into)"),
              expect: Optional[List[str]] = typer.Option(None, "--expect", help="node names (comma-separated, "
                                                         "repeatable) that should each have a run; one without "
                                                         "is reported missing"),
              expect_count: Optional[int] = typer.Option(None, "--expect-count", min=1, help="how many runs are "
                                                         "expected, where the node names are not known"),
              out: Optional[str] = typer.Option(None, "--out", help="the report goes to OUT/fleet/<UTC stamp>/ "
                                                "(default: ./artifacts)"),
              json_out: bool = JsonOpt) -> None:
    """One fleet report (fleet.md, fleet.json under OUT/fleet/) from the run folders of many nodes: nodes
    by GPU model and verdict, every node that did not pass (failed, running, half-written, missing) with
    why, and per GPU model each key figure's median, MAD and outliers. Exit 0: every run passed
    (or partial, as a run's own exit code counts it) and no expected node is missing; 1: a run failed,
    is still running or half-written, or an expected node or run is missing; 2: bad usage (a PATH that
    does not exist without --expect/--expect-count, no run folder found and none expected)."""
    from nsa_validate.report import fleet
    from nsa_validate.report.schema import write_json
    from nsa_validate.run import fleet_scan
    names = _expect_names(expect)
    tolerate = bool(names) or expect_count is not None
    root = rundir.check_out(out)                   # a bad --out is refused before hundreds of files are read
    rows, notes = fleet_scan.scan(paths, tolerate)
    if not rows and not tolerate:
        raise UsageError(f"no run folder (one holding results.json or manifest.json) under "
                         f"{', '.join(repr(str(p)) for p in paths)}")
    data = fleet.summarise(rows, names, expect_count, notes)
    text = fleet.render(data)
    folder = rundir.fresh_dir(root / "fleet", rundir.utc_stamp())
    try:
        write_json(folder / "fleet.json", data)
        safefs.atomic_write(folder / "fleet.md", text)
    except BaseException:          # (a full disk, a signal): no half-written report folder is left
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
        raise
    for note in notes:
        err.print(f"warning: {note}", highlight=False, markup=False, soft_wrap=True)
    err.print(data["line"], highlight=False, markup=False, soft_wrap=True)
    err.print(f"fleet report of {len(rows)} runs: {folder / 'fleet.md'}", highlight=False, markup=False,
              soft_wrap=True)
    if json_out:
        print(json.dumps({"report": str(folder / "fleet.md"), "json": str(folder / "fleet.json"),
                          "verdict": data["verdict"], "line": data["line"], "runs": len(rows),
                          "counts": data["counts"], "missing": data["expected"]["missing_nodes"]}))
    raise typer.Exit(EXIT_OK if data["verdict"] in fleet.PASSING else EXIT_FAIL)


def _expect_names(values: list[str] | None) -> list[str]:
    """--expect's node names: comma-separated and/or repeated, blanks dropped, each once."""
    if values is None:
        return []
    names = list(dict.fromkeys(n.strip() for v in values for n in v.split(",") if n.strip()))
    if not names:
        raise UsageError("--expect names no node; give node names, comma-separated or repeated")
    return names


profile_app = typer.Typer(no_args_is_help=True, context_settings=HELP_FLAGS, help="Profile tools.")
app.add_typer(profile_app, name="profile")


@profile_app.command("suggest")
def profile_suggest_cmd(run_dir: Path = typer.Argument(..., help="a run folder whose fa2 or triton suite ran its bench"),
                        apply: bool = typer.Option(False, "--apply", help="replace the profile (a backup is kept)"),
                        json_out: bool = JsonOpt) -> None:
    """Write the routing thresholds a run measured (FA-2 from the fa2 suite, the Triton compressed /
    selection kernels from the triton suite) into a suggested profile next to the shipped one."""
    from nsa_validate.run.finish import load_run
    res = load_run(run_dir)
    suggest = {}
    for name in ("fa2", "triton"):
        suggest.update(((res["suites"].get(name) or {}).get("extra") or {}).get("suggest") or {})
    if not suggest:
        raise UsageError(f"run '{run_dir}' has no routing recommendation (neither its fa2 nor its triton suite "
                         f"ran a bench: see its report)")
    source = res["manifest"].get("profile_source")
    if not isinstance(source, str) or not Path(source).is_absolute():
        raise UsageError(f"run '{run_dir}' recorded its profile's file as {source!r}, not an absolute path: which "
                         f"file it used is not known, so none is updated")
    if not Path(source).is_file():
        raise UsageError(f"run '{run_dir}' used profile {res['manifest'].get('profile')!r} from "
                         f"{source}, which is not there any more; nothing to update")
    target = Path(source).resolve()        # the file the run used (through a link: the file it points to)
    if apply and target.parent == profiles.PROFILE_DIR.resolve():
        raise UsageError(f"--apply would edit the shipped profile {target}; copy it, run with --profile COPY, "
                         f"and apply to the copy (the suggestion is written beside it without --apply)")
    gpu = ((res.get("env") or {}).get("facts") or {}).get("gpu") or {}
    header = (f"{thresholds.HEADER_MARK} from run {run_dir.name} "
              f"({gpu.get('name', 'unknown GPU')}, {res['manifest'].get('started')}):\n"
              f"#   {', '.join(f'{k}={v}' for k, v in suggest.items())}\n")

    def rewrite(old: str) -> str:
        try:
            return thresholds.rewrite_routing(old, suggest, header)
        except ValueError as e:
            raise UsageError(f"profile {target}: {e}") from None
    try:
        text = rewrite(target.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"profile {target}: not UTF-8 text") from None
    suggested = target.with_name(f"{target.stem}.suggested.yaml")
    written = {"suggested": str(suggested)}
    kept = safefs.replace_keeping_backup(suggested, text)      # an earlier suggestion is kept
    if kept:
        written["previous_suggestion"] = str(kept)
    if apply:     # read again under the lock: concurrent applies each land on the other's result
        written.update(backup=str(safefs.rewrite_keeping_backup(target, rewrite)), applied=str(target))
    err.print(f"suggested routing: {suggest}")
    for k, v in written.items():
        err.print(f"{k}: {v}")
    if json_out:
        print(json.dumps({"suggest": suggest, **written}))


@app.command("report")
def report_cmd(run_dir: Path = typer.Argument(..., help="a run folder"), json_out: bool = JsonOpt,
               embed_plots: bool = typer.Option(False, "--embed-plots", help="draw each plot inline in report.md as a "
                                                "Mermaid chart (GitHub renders those in job summaries; it strips "
                                                "embedded images)")) -> None:
    """Re-render report.md, summary.txt and metrics.csv of a run folder from its results.json (a folder left running by a
    process that vanished is repaired first: see ``repair``)."""
    from nsa_validate.run.finish import load_run, read_manifest, repair, stale, write_views
    manifest = read_manifest(run_dir, required=False)
    if manifest is not None and manifest.get("status") == "running" and stale(manifest):
        err.print(f"run was left running ({stale(manifest)}): marking it interrupted (process vanished)")
        repair(run_dir, manifest)
    res = load_run(run_dir)
    write_views(run_dir, res, embed_plots)
    err.print(f"report: {run_dir / 'report.md'}, {run_dir / 'summary.txt'}, {run_dir / 'metrics.csv'}")
    if json_out:
        print(json.dumps({"report": str(run_dir / "report.md"), "verdict": res["verdict"]["status"]}))


@app.command("repair")
def repair_cmd(run_dir: Path = typer.Argument(..., help="a run folder marked running"),
               force: bool = typer.Option(False, "--force", help="repair even when its process may still run "
                                                                  "(a run started on another host)"),
               json_out: bool = JsonOpt) -> None:
    """Mark a run folder left 'running' by a process that vanished (killed, machine lost) as
    interrupted, keeping every case its suites finished."""
    from nsa_validate.run.finish import read_manifest, repair, stale
    manifest = read_manifest(run_dir)
    status = manifest.get("status")
    failed_write = isinstance(status, str) and status.startswith("error: ")     # e.g. a full disk
    if status != "running" and not failed_write:
        raise UsageError(f"'{run_dir}' is not marked running (status: {status}); nothing to repair")
    why = "its last write failed" if failed_write else stale(manifest)
    if why is None and not force:
        raise UsageError(f"'{run_dir}' may still be running (pid {manifest.get('pid')} on {manifest.get('host')}); "
                         f"pass --force if it is not")
    res = repair(run_dir, manifest)
    show_verdict(res, run_dir)
    if json_out:
        print(json.dumps({"run_dir": str(run_dir), "status": res["manifest"]["status"], "verdict": res["verdict"]}))


def _run(req: RunRequest, json_out: bool) -> int:
    """Run the request, show progress and the verdict; the exit code."""
    from nsa_validate.run.execute import execute
    with Stop() as stop:                        # before torch is imported: a signal during the import is kept
        out = execute(req, ConsoleListener(), stop)
    res = out.results
    if res.get("comparison"):
        show_comparison(res["comparison"])
    show_verdict(res, out.run_dir)
    if json_out:
        print(json.dumps({"run_dir": str(out.run_dir), "status": out.status, "level": res["manifest"]["level"],
                          "verdict": res["verdict"],
                          "suites": {n: {"status": s["status"], "counts": s["counts"]} for n, s in res["suites"].items()},
                          **({"comparison": {k: res["comparison"][k] for k in ("status", "regressions")}}
                             if res.get("comparison") else {})},
                         indent=2))
    if out.status == "interrupted":
        return EXIT_INTERRUPTED
    if out.status == "env-broken":
        return EXIT_ENV_BROKEN
    # partial (a suite executed no check) passes without --strict; under --strict verdict() blocked it
    return EXIT_OK if res["verdict"]["status"] in ("pass", "partial") else EXIT_FAIL


def _os_error(e: OSError) -> str:
    """One line for a failed file operation: what, where, and (for a full disk) what to do."""
    where = f" '{e.filename}'" if e.filename else ""
    if e.errno == errno.ENOSPC:
        folder, what = getattr(e, "run_folder", (None, None))
        then = {"marked": f"; the run folder {folder} is marked 'error: disk full' (`repair` finishes it once there "
                          f"is space)",
                "removed": f"; the run folder {folder} held nothing of the run and was removed",
                "unmarked": f"; the run folder {folder} could not be marked and still says 'running' (`repair "
                            f"--force` finishes it once there is space)"}.get(what, "")
        return f"disk full writing{where}: free space and run again{then}"
    if e.errno == errno.ENAMETOOLONG:
        return f"path{where} is too long for this file system"
    return f"{e.strerror or e}{where}"


def _exit_with_error(msg: str, code: int) -> None:
    """One line on stderr (never wrapped: CI logs are not terminals) and, under --json, the same on stdout."""
    if msg:
        err.print(f"error: {msg}", highlight=False, markup=False, soft_wrap=True)
    if "--json" in sys.argv[1:]:
        print(json.dumps({"error": msg or "usage", "exit_code": code}))
    sys.exit(code)


def main() -> None:
    if early := startup.take_early():        # a signal while the CLI was imported: nothing ran yet
        err.print(f"interrupted ({', '.join(early)})")
        sys.exit(EXIT_INTERRUPTED)
    try:
        rc = app(standalone_mode=False)
    except UsageError as e:
        _exit_with_error(str(e), EXIT_USAGE)
    except OSError as e:
        _exit_with_error(_os_error(e), EXIT_USAGE)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:
        # click's (or typer's vendored click's) usage errors and Abort, matched by shape
        if getattr(e, "exit_code", None) == 2 and hasattr(e, "format_message"):
            # a bare group (`nsa-validate`, `baseline`, `profile`) has shown its help: no empty error line
            msg = "" if type(e).__name__ == "NoArgsIsHelpError" else e.format_message()
            _exit_with_error(msg, EXIT_USAGE)
        if type(e).__name__ == "Abort":
            err.print("interrupted")
            sys.exit(EXIT_INTERRUPTED)
        raise
    sys.exit(rc or 0)
