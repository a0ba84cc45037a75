"""The one results schema (``results.json``), used by the runner, report, JUnit, compare;
every field is documented in docs/results.md.

A case record:  {id, suite, status: pass|fail|skip|error, reason, params{}, metrics{}, backends{},
                 kernels{}, routes{}, duration_s, placeholder}
A suite result: {name, status, duration_s, counts{}, cases[], log, returncode, reason, extra{}}
                (extra: the suite's tables, notes, plots and their chart data: ``extra.SuiteExtra``)
A run:          {schema_version, manifest{}, env{}, profile{}, routing{}, suites{name: suite}, verdict{}}
                (manifest: run id, commit, command, profile, level, tool version, device, select,
                timeout, status, started/ended, phases_s, share_gpu and its overlaps)
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1
STATUSES = ("pass", "fail", "skip", "error")
# runs and baselines made before levels existed ran each profile's whole sweep, today's ``full``
OLD_LEVEL = "full"


def run_level(manifest: dict) -> str:
    """The level a run (or baseline) ran at."""
    return manifest.get("level") or OLD_LEVEL


@dataclass
class CaseRecord:
    id: str
    suite: str
    status: str
    reason: str = ""
    metrics: dict = field(default_factory=dict)
    backends: dict = field(default_factory=dict)
    duration_s: float = 0.0
    # CUDA kernel names the GPU ran, per observed path ("prefill/sel": [...]); empty on a CPU
    kernels: dict = field(default_factory=dict)
    # a stand-in, not a check: "no sizes in the profile", "suite not run". Never counted.
    placeholder: bool = False
    # the case's pytest parameters by name (e.g. {"B": 16, "S": 65536}), so readers need not parse ids
    params: dict = field(default_factory=dict)
    # the routing decisions made inside the case's captures, per path ("prefill/sel": ["triton: S=… >= …"])
    routes: dict = field(default_factory=dict)
    # seconds of the case (setup to teardown) in each phase: compile, oracle, bench, run (``measure.phases``)
    phases: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"bad status {self.status!r}")


@dataclass
class SuiteResult:
    name: str
    status: str
    duration_s: float = 0.0
    cases: list[CaseRecord] = field(default_factory=list)
    reason: str = ""
    log: str = ""
    returncode: int | None = None
    extra: dict = field(default_factory=dict)        # suite-level tables (bench rows, summaries)
    startup_s: float | None = None                   # its slowest process's start-up: imports, collection

    @property
    def counts(self) -> dict[str, int]:
        """Case statuses, placeholders left out."""
        return {s: sum(c.status == s and not c.placeholder for c in self.cases) for s in STATUSES}

    @property
    def exercised(self) -> bool:
        """Whether any check ran: a case (not a placeholder) that passed, failed or errored."""
        return any(c.status != "skip" and not c.placeholder for c in self.cases)

    def skip_reasons(self) -> list[tuple[str, int]]:
        """(reason, count) of the skipped cases, most frequent first."""
        from collections import Counter
        return Counter(c.reason or self.reason or "no reason given" for c in self.cases
                       if c.status == "skip").most_common()

    @property
    def phases(self) -> dict[str, float]:
        """Seconds in each phase summed over the cases (several processes' cases add up: it can
        exceed the suite's wall time); empty when no case recorded its phases."""
        out: dict[str, float] = {}
        for c in self.cases:
            for k, v in c.phases.items():
                out[k] = round(out.get(k, 0.0) + v, 3)
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["counts"] = self.counts
        d["phases_s"] = self.phases
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SuiteResult":
        d = {k: v for k, v in d.items() if k not in ("counts", "phases_s")}
        d["cases"] = [CaseRecord(**c) for c in d.get("cases", [])]
        return cls(**d)


def suite_status(cases: list[CaseRecord], process_error: str = "") -> str:
    if process_error or any(c.status == "error" for c in cases):
        return "error"
    if any(c.status == "fail" for c in cases):
        return "fail"
    if not cases or all(c.status == "skip" for c in cases):
        return "skip"
    return "pass"


def allowed_reason(allowed_skips: dict[str, str], suite: str, case: str) -> str | None:
    """The allow-list's reason for skipping ``suite/case``: a key is a suite name or a
    ``suite/case`` pattern where ``*`` matches anything (brackets are literal: case ids have them)."""
    for pattern, reason in allowed_skips.items():
        rx = ".*".join(re.escape(part) for part in pattern.split("*"))
        if pattern == suite or re.fullmatch(rx, f"{suite}/{case}"):
            return reason
    return None


def verdict(suites: dict[str, SuiteResult], strict: bool, allowed_skips: dict[str, str] | None = None) -> dict:
    """Overall verdict from data: ``fail`` on any failure or error; ``partial`` when nothing failed
    but a selected suite executed no check (its cases all skipped); ``pass`` only when every
    selected suite ran checks and they passed. ``allowed_skips``: suite name or ``suite/case``
    pattern -> reason; under ``strict`` every other skip blocks, and so does a suite that was not
    exercised (unless the allow-list names the suite itself). Counts leave placeholder cases out."""
    allowed_skips = allowed_skips or {}
    totals = {s: 0 for s in STATUSES}
    blocking, allowed = [], []
    whole = []                      # what blocks a whole suite: listed before any one case
    exercised, not_exercised = [], {}
    for name, s in suites.items():
        for st, n in s.counts.items():
            totals[st] += n
        for c in s.cases:
            if c.status in ("fail", "error"):
                blocking.append(f"{name}/{c.id}: {c.status}")
            elif c.status == "skip" and strict:
                why = allowed_reason(allowed_skips, name, c.id)
                if why is None:
                    blocking.append(f"{name}/{c.id}: skipped in --strict ({c.reason})")
                else:
                    allowed.append({"case": f"{name}/{c.id}", "skip_reason": c.reason, "allowed_because": why})
        if s.status == "error" and not any(c.status == "error" for c in s.cases):
            whole.append(f"{name}: error ({s.reason})")
        if s.exercised:
            exercised.append(name)
        else:
            not_exercised[name] = "; ".join(f"{r} (x{n})" if n > 1 else r for r, n in s.skip_reasons()[:3]) \
                or s.reason or "no case ran"
            if strict and name not in allowed_skips:    # only an entry naming the suite itself excuses it
                whole.append(f"{name}: not exercised in --strict ({not_exercised[name]})")
    blocking = whole + blocking
    status = "fail" if blocking else "partial" if not_exercised else "pass"
    return {"status": status, "strict": strict, "totals": totals, "blocking": blocking, "allowed_skips": allowed,
            "exercised": exercised, "not_exercised": not_exercised, "headline": headline(status, suites, not_exercised)}


def headline(status: str, suites: dict[str, SuiteResult], not_exercised: dict[str, str]) -> str:
    """The one verdict line, e.g. ``PARTIAL: sanity, counters passed; fa2 not exercised (…)``."""
    by: dict[str, list[str]] = {}
    for name, s in suites.items():
        key = "not exercised" if name in not_exercised else {"pass": "passed", "fail": "failed",
                                                             "error": "errored"}.get(s.status, s.status)
        by.setdefault(key, []).append(name)
    parts = [f"{', '.join(names)} {key}" for key, names in by.items() if key != "not exercised"]
    if not_exercised:
        parts.append(f"{', '.join(not_exercised)} not exercised")
    return f"{status.upper()}: {'; '.join(parts) or 'no suite selected'}"


def _clean(o):
    """JSON-safe: NaN becomes null, ±Inf the strings "inf"/"-inf" (an infinite error is a finding,
    not a missing figure), so the file stays valid JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return None if math.isnan(o) else str(o)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def to_json(data) -> str:
    """The text this tool writes for ``data`` (``_clean``: NaN and Inf kept valid JSON)."""
    return json.dumps(_clean(data), indent=2, sort_keys=False, default=str)


def write_json(path: Path, data) -> None:
    """Atomically (``safefs.atomic_write``): a reader or a crash sees the old file or the new one."""
    from nsa_validate.safefs import atomic_write
    atomic_write(path, to_json(data))


def _expect(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {what}")


def check_results(data) -> None:
    """The structure every reader of results.json relies on (more fields are allowed); ValueError
    naming the first place that is wrong. (Plain checks, not a schema library: the GPU images this
    runs on ship typer without pydantic.)"""
    _expect(isinstance(data, dict), "top level", f"expected a JSON object, got {type(data).__name__}")
    for key in ("manifest", "suites", "verdict"):
        _expect(isinstance(data.get(key), dict), key, "missing or not an object")
    v = data["verdict"]
    _expect(isinstance(v.get("status"), str), "verdict.status", "missing or not a string")
    _expect(isinstance(v.get("totals"), dict) and all(isinstance(v["totals"].get(k), int) for k in STATUSES),
            "verdict.totals", f"needs counts of {', '.join(STATUSES)}")
    _expect(isinstance(v.get("blocking"), list), "verdict.blocking", "missing or not a list")
    _expect(data.get("env") is None or isinstance(data["env"], dict), "env", "not an object")
    facts = (data.get("env") or {}).get("facts")
    _expect(facts is None or isinstance(facts, dict), "env.facts", "not an object")
    _expect(not isinstance(facts, dict) or facts.get("gpu") is None or isinstance(facts["gpu"], dict),
            "env.facts.gpu", "not an object")
    _expect(data["manifest"].get("suites") is None or (isinstance(data["manifest"]["suites"], list) and all(
        isinstance(x, str) for x in data["manifest"]["suites"])), "manifest.suites", "not a list of suite names")
    for name, s in data["suites"].items():
        _expect(isinstance(s, dict), f"suites.{name}", "not an object")
        extra = s.get("extra")
        _expect(extra is None or isinstance(extra, dict), f"suites.{name}.extra", "not an object")
        for key, kind in (("tables", dict), ("notes", list), ("plots", list), ("suggest", dict), ("summary", dict)):
            _expect(not isinstance(extra, dict) or extra.get(key) is None or isinstance(extra[key], kind),
                    f"suites.{name}.extra.{key}", f"not {'a list' if kind is list else 'an object'}")
        _expect(isinstance(s.get("status"), str), f"suites.{name}.status", "missing or not a string")
        _expect(isinstance(s.get("counts"), dict) and all(isinstance(s["counts"].get(k), int) for k in STATUSES),
                f"suites.{name}.counts", f"needs counts of {', '.join(STATUSES)}")
        _expect(isinstance(s.get("duration_s"), (int, float)), f"suites.{name}.duration_s", "missing or not a number")
        _expect(isinstance(s.get("cases"), list), f"suites.{name}.cases", "missing or not a list")
        for i, c in enumerate(s["cases"]):
            _expect(isinstance(c, dict) and isinstance(c.get("id"), str) and isinstance(c.get("status"), str),
                    f"suites.{name}.cases[{i}]", "needs 'id' and 'status' strings")
            for key in ("metrics", "backends", "kernels", "params", "routes"):
                _expect(c.get(key) is None or isinstance(c[key], dict), f"suites.{name}.cases[{i}].{key}",
                        "not an object")
            _expect(isinstance(c.get("reason", ""), str), f"suites.{name}.cases[{i}].reason", "not a string")
            _check_timings(c.get("metrics") or {}, f"suites.{name}.cases[{i}].metrics")


def _check_timings(m: dict, where: str) -> None:
    """Every timing record in a case's metrics (a dict with ``median_ms``) holds numbers where readers
    compute with it."""
    if "median_ms" in m:
        for key in ("median_ms", "p20_ms", "p80_ms"):
            _expect(m.get(key) is None or isinstance(m[key], (int, float)), f"{where}.{key}", "not a number")
        return
    for k, v in m.items():
        if isinstance(v, dict):
            _check_timings(v, f"{where}.{k}")


def read_json(path: Path):
    """A JSON file's content; ValueError (one line) when it is not UTF-8 or not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise ValueError("nested too deeply to be one of this tool's files") from None


def load_results(path: Path) -> dict:
    """results.json, checked for the structure readers need; ValueError (one line) otherwise."""
    data = read_json(path)
    _expect(isinstance(data, dict), "top level", f"expected a JSON object, got {type(data).__name__}")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"results schema version {data.get('schema_version')} != {SCHEMA_VERSION}")
    check_results(data)
    return data
