"""FA-2 threshold recommendation (SPEC §6) and the profile suggestion written from it.

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
    """The profile YAML ``text`` with each ``routing`` key in ``values`` set (comments kept)."""
    for key, val in values.items():
        yaml_val = "null" if val is None else str(val)
        pat = re.compile(rf"^(\s*{re.escape(key)}:\s*)([^#\n]*?)(\s*(#.*)?)$", re.M)
        if not pat.search(text):
            raise ValueError(f"profile has no '{key}' line to update")
        text = pat.sub(lambda m: f"{m.group(1)}{yaml_val}{m.group(3) or ''}", text, count=1)
    return header + text
