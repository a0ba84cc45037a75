"""Merged JUnit XML for a whole run, written from ``results.json`` (so not-implemented and
crashed suites appear too)."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path


def write(results: dict, path: Path) -> None:
    root = ET.Element("testsuites", name="nsa-validate")
    for name, s in results["suites"].items():
        c = s["counts"]
        ts = ET.SubElement(root, "testsuite", name=name, tests=str(len(s["cases"])), failures=str(c["fail"]),
                           errors=str(c["error"]), skipped=str(c["skip"]), time=f"{s['duration_s']:.3f}")
        for case in s["cases"]:
            tc = ET.SubElement(ts, "testcase", classname=f"nsa_validate.{name}", name=case["id"],
                               time=f"{case.get('duration_s', 0):.3f}")
            tag = {"fail": "failure", "error": "error", "skip": "skipped"}.get(case["status"])
            if tag:
                ET.SubElement(tc, tag, message=case["reason"][:500]).text = case["reason"]
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
