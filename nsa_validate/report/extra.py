"""``SuiteExtra``: the tables, notes, plots and headline figures a suite adds to ``report.md``
(``SuiteResult.extra``). Cases add to it as they run (``extra.json``); after the suite's process,
the harness adds what its registry entry's ``summarise`` makes of the case records
(``summary.json``); ``merged`` is what the report reads.

Layout: ``{"tables": {title: [row dicts]}, "notes": [lines], "plots": [paths relative to the run
folder], "charts": {plot path: figures.chart data}, "summary": {figure name: text}, ...}``.
"""
from __future__ import annotations

import json
from pathlib import Path

from nsa_validate import safefs


class SuiteExtra:
    """Saved to ``<out_dir>/<file>`` at every change, so what a suite measured before dying is
    kept. Without an ``out_dir`` (a plain ``pytest suites/``) nothing is written."""

    def __init__(self, out_dir: str, file: str = "extra.json") -> None:
        self.dir = Path(out_dir) if out_dir else None
        self.file = file
        self.data: dict = {"tables": {}, "notes": [], "plots": []}

    def row(self, table: str, row: dict) -> None:
        self.data["tables"].setdefault(table, []).append(row)
        self._save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self._save()

    def set(self, key: str, value) -> None:
        """A named result (e.g. the fa2 suite's ``suggest``) for later commands to read."""
        self.data[key] = value
        self._save()

    def figure(self, name: str, value: str) -> None:
        """A headline figure: the report's "Key figures" and the fleet report show it."""
        self.data.setdefault("summary", {})[name] = value
        self._save()

    def plot(self, path: str, chart: dict | None = None) -> None:
        """``path``: relative to the run folder (where report.md is); ``chart``: its data as
        ``figures.chart`` makes it (``report --embed-plots`` draws it inline)."""
        self.data["plots"].append(path)
        if chart is not None:
            self.data.setdefault("charts", {})[path] = chart
        self._save()

    def _save(self) -> None:
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            safefs.atomic_write(self.dir / self.file, json.dumps(self.data, indent=1, default=str))


def merged(first: dict, then: dict) -> dict:
    """``then`` after ``first``: tables, notes, plots, charts and figures joined, other keys replaced."""
    out = {**first, **{k: v for k, v in then.items() if k not in ("tables", "notes", "plots", "charts", "summary")}}
    out["tables"] = {**first.get("tables", {})}
    for title, rows in then.get("tables", {}).items():
        out["tables"][title] = out["tables"].get(title, []) + rows
    for key in ("notes", "plots"):
        out[key] = first.get(key, []) + then.get(key, [])
    for key in ("charts", "summary"):
        if first.get(key) or then.get(key):
            out[key] = {**first.get(key, {}), **then.get(key, {})}
    return out
