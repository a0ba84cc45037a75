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


def rewrite_routing(text: str, values: dict[str, object], header: str) -> str:
    """The profile YAML ``text`` with each ``routing`` key in ``values`` set (comments kept);
    ``values`` pass ``check_suggestion`` first."""
    check_suggestion(values)
    for key, val in values.items():
        yaml_val = "null" if val is None else str(val)
        pat = re.compile(rf"^(\s*{re.escape(key)}:\s*)([^#\n]*?)(\s*(#.*)?)$", re.M)
        if not pat.search(text):
            raise ValueError(f"profile has no '{key}' line to update")
        text = pat.sub(lambda m: f"{m.group(1)}{yaml_val}{m.group(3) or ''}", text, count=1)
    return header + text


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
