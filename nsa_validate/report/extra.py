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
from typing import Callable

from nsa_validate import safefs


class SuiteExtra:
    """Saved to ``<out_dir>/<file>`` at every change, so what a suite measured before dying is
    kept. Without an ``out_dir`` (a plain ``pytest suites/``) nothing is written."""

    def __init__(self, out_dir: str, file: str = "extra.json", position: Callable[[], int] = lambda: 0) -> None:
        self.dir = Path(out_dir) if out_dir else None
        self.file = file
        self.data: dict = {"tables": {}, "notes": [], "plots": []}
        # the collection index of the case adding each row, note and plot: a suite run as several
        # processes (each with its own file) is put back in case order by ``combined``
        self.position = position

    def _placed(self, key: str) -> None:
        self.data.setdefault("order", {}).setdefault(key, []).append(self.position())

    def row(self, table: str, row: dict) -> None:
        self.data["tables"].setdefault(table, []).append(row)
        self._placed(f"tables/{table}")
        self._save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self._placed("notes")
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
        self._placed("plots")
        if chart is not None:
            self.data.setdefault("charts", {})[path] = chart
        self._save()

    def _save(self) -> None:
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            safefs.atomic_write(self.dir / self.file, json.dumps(self.data, indent=1, default=str))


def merged(first: dict, then: dict) -> dict:
    """``then`` after ``first``: tables, notes, plots, charts and figures joined, other keys replaced."""
    out = {k: v for k, v in {**first, **{k: v for k, v in then.items()
                                         if k not in ("tables", "notes", "plots", "charts", "summary")}}.items()
           if k != "order"}
    out["tables"] = {**first.get("tables", {})}
    for title, rows in then.get("tables", {}).items():
        out["tables"][title] = out["tables"].get(title, []) + rows
    for key in ("notes", "plots"):
        out[key] = first.get(key, []) + then.get(key, [])
    for key in ("charts", "summary"):
        if first.get(key) or then.get(key):
            out[key] = {**first.get(key, {}), **then.get(key, {})}
    return out


def combined(parts: list[dict]) -> dict:
    """The extras a suite's processes saved (``extra.json``, ``extra.1.json``, …) as one: every
    table, the notes and the plots in the order of the cases that added them (as one process would
    have), figures and charts joined, other keys from the last part that has them."""
    out: dict = {"tables": {}, "notes": [], "plots": []}
    placed: dict[str, list] = {}
    for d in parts:
        order = d.get("order", {})
        lists = {**{f"tables/{t}": rows for t, rows in d.get("tables", {}).items()},
                 "notes": d.get("notes", []), "plots": d.get("plots", [])}
        for key, items in lists.items():
            pos = list(order.get(key, []))[:len(items)]
            pos += [float("inf")] * (len(items) - len(pos))      # unplaced (an older file): last
            placed.setdefault(key, []).extend(zip(pos, items))
        for k, v in d.items():
            if k in ("charts", "summary"):
                out.setdefault(k, {}).update(v)
            elif k not in ("tables", "notes", "plots", "order"):
                out[k] = v
    for key, items in placed.items():
        items = [x for _, x in sorted(items, key=lambda pi: pi[0])]       # stable: a case's own order kept
        if key.startswith("tables/"):
            out["tables"][key.removeprefix("tables/")] = items
        else:
            out[key] = items
    return out
