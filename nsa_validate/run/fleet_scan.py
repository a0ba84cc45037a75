"""The run folders ``merge`` is given, found and read one at a time.

Each PATH is a run folder or a folder holding run folders at any depth (the ``--out`` every node of
a fleet wrote into). A run folder holds manifest.json or results.json, or is named as
``rundir.create`` names one (``<UTC stamp>-<node>``, with its ``logs/``) and lost both; the walk
never descends into one, nor into hidden folders (a file server's ``.snapshot`` would count every
run again). Each folder becomes one small row (``report.fleet``): its verdict from results.json, or
``running`` / ``half-written`` from what else is there; a results.json is parsed, checked, reduced
to its row and dropped before the next is read, so memory grows with the number of runs only by
their rows.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

from nsa_validate.errors import UsageError
from nsa_validate.report import fleet
from nsa_validate.report.schema import load_results, read_json
from nsa_validate.run import rundir
from nsa_validate.run.finish import stale

RUN_FILES = ("manifest.json", "results.json")


def scan(paths: list[Path], tolerate_missing: bool) -> tuple[list[dict], list[str]]:
    """The row of every run folder under ``paths`` (``report.fleet.row`` / ``unfinished``), and notes on
    what could not be looked at. A PATH that does not exist is a UsageError unless ``tolerate_missing``
    (nodes are expected: they show as missing), then a note."""
    folders, notes = find(paths, tolerate_missing)
    return [read(d) for d in folders], notes


def find(paths: list[Path], tolerate_missing: bool) -> tuple[list[Path], list[str]]:
    """The run folders under ``paths``, each once (by its resolved path), and notes (as ``scan``)."""
    seen: dict[Path, Path] = {}
    notes: list[str] = []
    for p in paths:
        p = rundir.expand(p)
        if p.is_file() and p.name in RUN_FILES:       # a run's results.json or manifest.json: its folder
            p = p.parent
        if not p.exists():
            if not tolerate_missing:
                raise UsageError(f"'{p}' does not exist: no run folder (no results.json or manifest.json) there")
            notes.append(f"'{p}' does not exist")
            continue
        if not p.is_dir():
            raise UsageError(f"'{p}' is a file, not a run folder or a folder holding run folders")
        for d in walk(p, notes):
            seen.setdefault(rundir.resolve(d), d)
    return list(seen.values()), notes


def is_run(d: Path) -> bool:
    """``d`` is a run folder (module docstring)."""
    return (any((d / f).is_file() for f in RUN_FILES)
            or (fleet.RUN_NAME.match(d.name) is not None and (d / "logs").is_dir()))


def walk(root: Path, notes: list[str]):
    """Yield the run folders at or under ``root``, in name order; a folder that cannot be looked into
    is noted (runs in it are not counted). Each folder is visited once, links included."""
    stack, visited = [root], set()
    while stack:
        d = stack.pop()
        try:
            run = is_run(d)
            if not run:
                st = d.stat()
                if (st.st_dev, st.st_ino) in visited:       # a link back up the tree
                    continue
                visited.add((st.st_dev, st.st_ino))
                with os.scandir(d) as entries:
                    subs = sorted(Path(e.path) for e in entries if not e.name.startswith(".") and e.is_dir())
        except OSError as e:
            notes.append(f"cannot read folder '{d}' ({e.strerror or e}): runs in it are not counted")
            continue
        if run:
            yield d
        else:
            stack.extend(reversed(subs))                    # popped in name order


def read(run_dir: Path) -> dict:
    """One folder's row: from results.json where it is there and readable; else from manifest.json
    ("running", or "half-written" saying what is wrong) and env.json (the GPU). Never raises for what
    is in the folder."""
    res_path = run_dir / "results.json"
    try:
        finished = res_path.is_file()
    except OSError as e:
        return _half_written(run_dir, f"cannot look into the folder ({e.strerror or e})")
    if finished:
        try:
            return fleet.row(load_results(res_path), run_dir)
        except OSError as e:
            return _half_written(run_dir, f"results.json cannot be read ({e.strerror or e})")
        except (ValueError, KeyError, TypeError, AttributeError) as e:     # load_results' checks say which field
            return _half_written(run_dir, f"results.json unreadable ({e})")
    try:
        man = read_json(run_dir / "manifest.json")
    except FileNotFoundError:
        return _half_written(run_dir, "no manifest.json and no results.json (the run died before writing its "
                                      "manifest)")
    except (OSError, ValueError) as e:
        return _half_written(run_dir, f"manifest.json unreadable ({getattr(e, 'strerror', None) or e}) and "
                                      f"no results.json")
    if not isinstance(man, dict):
        return _half_written(run_dir, "manifest.json is not a JSON object and there is no results.json")
    node, gpu = fleet.node_of(man, run_dir), _gpu(run_dir)
    if man.get("status") == "running":
        return fleet.unfinished(run_dir, node, "running", _running_reason(run_dir, man), gpu, man)
    return fleet.unfinished(run_dir, node, "half-written",
                            f"no results.json though the manifest says {man.get('status')!r}", gpu, man)


def _half_written(run_dir: Path, reason: str) -> dict:
    """A half-written folder's row; its node and GPU from what of manifest.json and env.json can be read."""
    man = None
    try:
        man = read_json(run_dir / "manifest.json")
    except (OSError, ValueError):
        pass
    man = man if isinstance(man, dict) else None
    return fleet.unfinished(run_dir, fleet.node_of(man, run_dir), "half-written", reason, _gpu(run_dir), man)


def _running_reason(run_dir: Path, man: dict) -> str:
    """Who runs it and whether that process is still there, where this machine can tell."""
    since = f" since {man['started']}" if man.get("started") else ""
    who = f"marked running{since} (pid {man.get('pid')} on {man.get('host')})"
    try:
        gone = stale(man)
    except (AttributeError, TypeError):       # a manifest whose process record is malformed: cannot tell
        gone = None
    if gone:
        return f"{who}: {gone}; `nsa-validate repair {run_dir}` finishes it"
    if man.get("host") == socket.gethostname():
        return f"{who}: it may still be running"
    return f"{who}: whether it still runs cannot be told from this machine"


def _gpu(run_dir: Path) -> dict:
    """The GPU env.json names (a run writes it right after its manifest), or {}."""
    try:
        gpu = ((read_json(run_dir / "env.json") or {}).get("facts") or {}).get("gpu")
    except (OSError, ValueError, AttributeError):
        return {}
    return gpu if isinstance(gpu, dict) else {}
