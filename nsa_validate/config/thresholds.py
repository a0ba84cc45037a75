"""FA-2 threshold recommendation (docs/method.md) and the profile suggestion written from it.

Rule: for a branch, the smallest measured length from which FA-2 is at least ``margin`` times
faster than the baseline at that length *and at every larger length measured*; if there is
none, FA-2 is disabled for the branch (threshold ``None``).
"""
from __future__ import annotations

import re


def recommend(speedup: dict[int, float], margin: float = 1.2) -> int | None:
    """speedup {length: baseline_time / fa2_time} -> threshold length, or None (disable)."""
    threshold = None
    for length in sorted(speedup, reverse=True):
        if speedup[length] < margin:
            break
        threshold = length
    return threshold


def pick_backend(thresholds: dict[str, int | None]) -> tuple[str | None, int | None]:
    """The backend with the lowest threshold (earliest useful); ties go to the first listed."""
    usable = [(t, i, b) for i, (b, t) in enumerate(thresholds.items()) if t is not None]
    if not usable:
        return None, None
    t, _, b = min(usable)
    return b, t


HEADER_MARK = "# Suggested by `nsa-validate profile suggest`"      # the first line of the header it writes


def rewrite_routing(text: str, values: dict[str, object], header: str) -> str:
    """The profile YAML ``text`` with each top-level ``routing`` key in ``values`` set (comments and
    everything else kept); ``values`` pass ``check_suggestion`` first. Only a block-style ``routing:``
    mapping is edited, its keys at the block's own indentation; the result is parsed again and must
    differ from the original in those keys alone (ValueError otherwise, naming why)."""
    check_suggestion(values)
    before = _parsed_profile(text)
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if re.match(r"routing:[ \t]*(#.*)?$", ln.rstrip("\r\n"))), None)
    if start is None:
        raise ValueError("has no block-style top-level 'routing:' mapping to update (edit it by hand)")
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"[^\s#]", lines[i])), len(lines))
    keyed = [re.match(r"([ \t]+)([A-Za-z_][A-Za-z0-9_]*):", lines[i]) for i in range(start + 1, end)]
    indents = {m.group(1) for m in keyed if m}
    if len(indents) != 1:
        raise ValueError("its 'routing:' block has no keys at one indentation (edit it by hand)")
    indent = indents.pop()
    for key, val in values.items():
        yaml_val = "null" if val is None else str(val)
        pat = re.compile(rf"^({re.escape(indent)}{re.escape(key)}:[ \t]*)([^#\n]*?)([ \t]*(#.*)?)(\r?\n?)$")
        at = next((i for i in range(start + 1, end) if pat.match(lines[i])), None)
        if at is None:
            raise ValueError(f"has no 'routing.{key}' line to update")
        lines[at] = pat.sub(lambda m: f"{m.group(1)}{yaml_val}{m.group(3) or ''}{m.group(5)}", lines[at])
    out = "".join(lines)
    after = _parsed_profile(out)
    want = dict(before, routing={**before["routing"], **values})
    if after != want:
        raise ValueError("the edit would change more than the routing keys suggested (edit it by hand)")
    # an earlier suggestion's header is replaced, not stacked
    out = re.sub(rf"\A(?:{re.escape(HEADER_MARK)}[^\n]*\n(?:#   [^\n]*\n)?)+", "", out)
    return header + out


def _parsed_profile(text: str) -> dict:
    """A profile's YAML as a mapping with a ``routing`` mapping; ValueError otherwise."""
    import yaml
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("routing"), dict):
        raise ValueError("is not a profile (a YAML mapping with a 'routing' mapping)")
    return data


def check_suggestion(values: dict[str, object]) -> None:
    """A suggestion may only set routing thresholds (an int >= 0, or None) and ``fa2_backend`` (a
    known name): anything else, e.g. text that would inject YAML, is refused (ValueError)."""
    import dataclasses

    from nsa_core.routing import FA2_BACKENDS, RoutingPolicy
    fields = {f.name for f in dataclasses.fields(RoutingPolicy)}
    for key, val in values.items():
        if key not in fields:
            raise ValueError(f"suggestion names no routing field: {key!r}")
        if key == "fa2_backend":
            if val not in FA2_BACKENDS:
                raise ValueError(f"suggested fa2_backend {val!r} is not one of {', '.join(FA2_BACKENDS)}")
        elif "_min_len" in key:
            if val is not None and (type(val) is not int or val < 0):
                raise ValueError(f"suggested {key} must be a length >= 0 or null, not {val!r}")
        else:
            raise ValueError(f"suggestion may not set {key!r}")
