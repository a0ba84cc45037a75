"""Per-GPU-family profiles (``profiles/*.yaml``): routing thresholds, suite sizes, expectations.

A profile is parsed into typed dataclasses; an unknown field, a wrong type or a missing file is
a ``UsageError`` that names the field. ``resolve`` picks a run's profile and device: by default
the file for the GPU's compute capability (``sm90`` for 9.0, the nearest lower family otherwise,
``cpu`` without a GPU).

Levels (``LEVELS``, like ``dcgmi diag -r``): a profile's ``suites`` are its ``full`` sweep; its
``levels: {quick: {suites: …}, standard: {suites: …}}`` override parts of them (mappings merged
key by key, anything else replaced). ``load(name, level)`` returns the profile at that level,
with ``level`` set: it is recorded in every run, and runs of different levels are not compared.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from nsa_core.routing import RoutingPolicy
from nsa_validate.errors import UsageError
from nsa_validate.paths import PROFILE_DIR
from nsa_validate.config.registry import SUITES, bad, check_routing, positive

LEVELS = ("quick", "standard", "full")
DEFAULT_LEVEL = "standard"


SuitesCfg = dataclasses.make_dataclass("SuitesCfg", [
    ("timeout_s", dict[str, int], field(default_factory=dict)),
    # how long each suite took on the family's reference GPU at this level (seconds; suites sharing
    # it, cold Triton cache): the ETA a terminal shows. A suite not listed gets no ETA
    ("expected_s", dict[str, float], field(default_factory=dict)),
    # each suite's own section, of the type its registry entry declares
    *((s.name, s.config, field(default_factory=s.config)) for s in SUITES.values())])
SuitesCfg.__doc__ = "A profile's ``suites``: limits and ETAs per suite, and each suite's section."


@dataclass
class ExpectCfg:
    # spec-sheet dense fp16/bf16 tensor-core rate of the family's fastest part (no sparsity): a
    # ceiling no measurement may pass (nsa_validate.measure.limits)
    peak_tflops: float | None = None
    peak_bandwidth_gbs: float | None = None      # spec-sheet HBM bandwidth
    decode_roofline_min: float | None = None     # fraction of measured copy bandwidth
    decode_speedup_min: float | None = None      # vs dense at the longest context
    # DRAM bytes one decode step reads (ncu) / the formula's bytes, at the largest B and context
    decode_dram_ratio_max: float | None = None
    # the whole layer vs the fastest same-bytes dense layer (dense ms / NSA ms) at the longest
    # context of the layer suite, B=1: forward, and forward+backward
    layer_fwd_speedup_min: float | None = None
    layer_fwdbwd_speedup_min: float | None = None


@dataclass
class Profile:
    name: str
    description: str = ""
    device: str = "cuda"                         # cuda | cpu
    capability: list[int] | None = None          # [major, minor] this family starts at
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    suites: SuitesCfg = field(default_factory=SuitesCfg)
    expect: ExpectCfg = field(default_factory=ExpectCfg)
    # GPUs of one family that differ (an H200's HBM is faster than an H100's): a substring of the
    # device name -> expectations that replace the family's where they are set (not null)
    expect_by_device: dict[str, ExpectCfg] = field(default_factory=dict)
    source: str = ""                             # the file it was read from (set on load)
    level: str = "full"                          # the level its suites were resolved at (set on load)

    def expectations(self, device_name: str | None) -> tuple[ExpectCfg, str | None]:
        """The expectations for a GPU named ``device_name`` (None: the family's) and the
        ``expect_by_device`` key that matched (the longest one contained in the name), if any."""
        keys = [k for k in self.expect_by_device if device_name and k in device_name]
        if not keys:
            return self.expect, None
        key = max(keys, key=len)
        over = {f.name: getattr(self.expect_by_device[key], f.name) for f in dataclasses.fields(ExpectCfg)}
        return dataclasses.replace(self.expect, **{k: v for k, v in over.items() if v is not None}), key

    def timeout(self, suite: str) -> int:
        """Seconds the suite may run: the profile's ``suites.timeout_s``, else its registry entry's."""
        return int(self.suites.timeout_s.get(suite, SUITES[suite].timeout_s))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _convert(tp, value, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UsageError(f"field '{where}' must be a mapping, got {type(value).__name__}")
        return _build(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise UsageError(f"field '{where}' must be a list, got {type(value).__name__}")
        (inner,) = typing.get_args(tp)
        return [_convert(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise UsageError(f"field '{where}' must be a mapping, got {type(value).__name__}")
        _, inner = typing.get_args(tp)
        return {str(k): _convert(inner, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise UsageError(f"field '{where}' must be {tp.__name__}, got {value!r}")
    return value


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise UsageError(f"unknown field '{prefix + '.' if prefix else ''}{key}'")
    kwargs = {k: _convert(hints[k], v, f"{prefix + '.' if prefix else ''}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:   # a required field is missing
        raise UsageError(f"{prefix or cls.__name__}: {e}") from None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _at_level(data: dict, level: str) -> dict:
    """The profile's raw mapping with ``levels[level]`` applied, ``levels`` itself dropped."""
    if level not in LEVELS:
        raise UsageError(f"level '{level}' is not one of {', '.join(LEVELS)}")
    levels = data.pop("levels", None) or {}
    if not isinstance(levels, dict):
        raise UsageError("field 'levels' must be a mapping of level -> {suites: ...}")
    for name, over in levels.items():
        if name not in LEVELS or name == "full":
            raise UsageError(f"field 'levels.{name}': a level to override must be quick or standard "
                             "(full is the profile's own suites)")
        if not isinstance(over, dict) or set(over) - {"suites"}:
            raise UsageError(f"field 'levels.{name}' may only hold 'suites'")
    over = levels.get(level) or {}
    if over.get("suites"):
        if not isinstance(over["suites"], dict):
            raise UsageError(f"field 'levels.{level}.suites' must be a mapping")
        data["suites"] = _merge(data.get("suites") or {}, over["suites"])
    return data


def _read(path: Path) -> dict:
    """One profile file's mapping, malformed input as one line."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"profile {path.name}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"profile {path.name}: malformed YAML{where}") from None
    if not isinstance(data, dict):
        raise UsageError(f"profile {path.name}: expected a mapping at top level")
    return data


def resolved(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A profile file's mapping with what it ``extends`` underneath (mappings merged key by key,
    lists and values replaced). ``extends`` names a file without .yaml, e.g. ``base/gpu``: beside
    the profile, else among the shipped profiles (so a copy of a shipped profile still loads)."""
    data = _read(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise UsageError(f"profile {path.name}: field 'extends' must be a profile file's name, got {parent!r}")
    chain = (*seen, path.resolve())
    ppath = (path.parent / f"{parent}.yaml").resolve()
    if not ppath.is_file():
        ppath = (PROFILE_DIR / f"{parent}.yaml").resolve()
    if ppath in chain:
        raise UsageError(f"profile {path.name}: 'extends: {parent}' makes a cycle")
    if not ppath.is_file():
        raise UsageError(f"profile {path.name}: 'extends: {parent}' names no file (beside it or in {PROFILE_DIR})")
    return _merge(resolved(ppath, chain), data)


def load(name_or_path: str, level: str = DEFAULT_LEVEL) -> Profile:
    """A profile by name (``sm90``) or by path to a YAML file, at ``level`` (``LEVELS``)."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if path.is_dir():
        raise UsageError(f"profile '{name_or_path}' is a folder; give a profile's name or its YAML file")
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml") if "." not in p.stem))
        raise UsageError(f"profile '{name_or_path}' not found (known: {known})")
    data = resolved(path)
    if "level" in data:
        raise UsageError(f"profile {path.name}: 'level' is chosen when the profile is loaded (--level), not in the file")
    try:
        data = _at_level(data, level)
        data["level"] = level
        prof = _build(Profile, data)
    except UsageError as e:
        raise UsageError(f"profile {path.name}: {e}") from None
    try:
        check_ranges(prof)
    except UsageError as e:
        raise UsageError(f"profile {path.name}: {e}") from None
    prof.source = str(path.resolve())          # absolute: ``profile suggest --apply`` edits this file, from anywhere
    return prof


def check_ranges(prof: Profile) -> None:
    """Values a suite cannot run with are bad input, not NSA failures: UsageError naming the field
    and what it may be. Each suite's section checks itself (its config type's ``check``)."""
    if prof.device not in ("cuda", "cpu"):
        bad("device", "'cuda' or 'cpu'", prof.device)
    check_routing("routing", prof.routing)
    su = prof.suites
    for what in ("timeout_s", "expected_s"):
        for name, t in getattr(su, what).items():
            if name not in SUITES:
                bad(f"suites.{what}.{name}", f"a suite name ({', '.join(SUITES)})", name)
            positive(f"suites.{what}.{name}", t)
    for name in SUITES:
        getattr(su, name).check(f"suites.{name}")
    for where, exp in [("expect", prof.expect)] + [(f"expect_by_device.{k}", e) for k, e in prof.expect_by_device.items()]:
        for f in dataclasses.fields(exp):
            positive(f"{where}.{f.name}", getattr(exp, f.name))
        r = exp.decode_dram_ratio_max
        if r is not None and not r >= 1.0:
            bad(f"{where}.decode_dram_ratio_max", "a ratio >= 1 (DRAM bytes read / formula bytes) or null", r)
    for k in prof.expect_by_device:
        if not k.strip():
            bad("expect_by_device", "keyed by a non-empty part of a GPU's name", k)


def auto_name(capability: tuple[int, int] | None) -> str:
    """The shipped profile for a compute capability: exact smXY, else the nearest lower family."""
    if capability is None:
        return "cpu"
    families = []
    for p in PROFILE_DIR.glob("sm*.yaml"):
        if "." in p.stem:
            continue
        digits = p.stem[2:]
        families.append(((int(digits[:-1]), int(digits[-1])), p.stem))
    below = [f for f in sorted(families) if f[0] <= tuple(capability)]
    return below[-1][1] if below else sorted(families)[0][1]


def auto_profile(level: str = DEFAULT_LEVEL) -> Profile:
    import torch
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return load(auto_name(cap), level)


def resolve(name_or_path: str | None = None, level: str = DEFAULT_LEVEL,
            loaded: Profile | None = None) -> tuple[Profile, str]:
    """The one place a run's profile and device are chosen: (the profile named, else the one for
    this machine's GPU, at ``level``; "cuda" when the profile asks for a GPU and one is visible,
    else "cpu"). The CLI's runs and a plain ``pytest suites/`` both come through here. A named profile
    is read before torch is imported: a bad one is reported in a moment, not after torch's start-up.
    ``loaded``: the named profile as ``load`` already read it (a run reads it first, before any process starts)."""
    prof = loaded or (load(name_or_path, level) if name_or_path else auto_profile(level))
    import torch
    return prof, "cuda" if prof.device == "cuda" and torch.cuda.is_available() else "cpu"


def from_dict(data: dict) -> Profile:
    """A profile as ``Profile.to_dict`` wrote it (a suite process reads its run's context)."""
    data = dict(data)
    source = data.pop("source", "")
    prof = _build(Profile, data)
    prof.source = source
    return prof
