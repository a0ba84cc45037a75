"""The run's one JUnit XML file, written from ``results.json`` (so not-run and crashed suites
appear too). One naming scheme: a ``testsuite`` per suite, a ``testcase`` named by its case id with
classname ``nsa_validate.<suite>``; the suite processes write no JUnit files of their own, so a CI
glob counts every case once. Each testsuite carries the run's timestamp and host, and properties
(GPU, commit, profile, level, tool version, run id)."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from nsa_validate.schema import run_level


def write(results: dict, path: Path) -> None:
    man = results.get("manifest") or {}
    gpu = ((results.get("env") or {}).get("facts") or {}).get("gpu") or {}
    props = {"gpu": gpu.get("name", "none (CPU)"), "sm": gpu.get("sm", "-"), "commit": man.get("commit"),
             "dirty": man.get("dirty"), "profile": man.get("profile"), "level": run_level(man),
             "tool_version": man.get("tool_version"), "run_id": man.get("run_id")}
    root = ET.Element("testsuites", name="nsa-validate")
    for name, s in results["suites"].items():
        c = s["counts"]
        ts = ET.SubElement(root, "testsuite", name=name, tests=str(len(s["cases"])), failures=str(c["fail"]),
                           errors=str(c["error"]), skipped=str(c["skip"]), time=f"{s['duration_s']:.3f}",
                           timestamp=str(man.get("started") or ""), hostname=str(man.get("host") or ""))
        pe = ET.SubElement(ts, "properties")
        for k, v in props.items():
            ET.SubElement(pe, "property", name=k, value="" if v is None else str(v))
        for case in s["cases"]:
            tc = ET.SubElement(ts, "testcase", classname=f"nsa_validate.{name}", name=case["id"],
                               time=f"{case.get('duration_s', 0):.3f}")
            tag = {"fail": "failure", "error": "error", "skip": "skipped"}.get(case["status"])
            if tag:
                ET.SubElement(tc, tag, message=case["reason"][:500]).text = case["reason"]
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
