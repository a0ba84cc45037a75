"""The run's one JUnit XML file, written from ``results.json`` (so not-run and crashed suites
appear too). One naming scheme: a ``testsuite`` per suite, a ``testcase`` named by its case id with
classname ``nsa_validate.<suite>``; the suite processes write no JUnit files of their own, so a CI
glob counts every case once. Each testsuite carries the run's timestamp and host, and properties
(GPU, commit, profile, level, tool version, run id)."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from nsa_validate.report.schema import run_level


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
    # the verdict's own testsuite: each blocking entry that no failing or erroring testcase above stands for
    # (an environment failure, an interruption, a suite not exercised or a case skipped under --strict, a
    # regression against the baseline) fails a testcase of its own, so a CI reporter reading only this file
    # sees the run fail exactly when the verdict does
    shown = {f"{name}/{c['id']}: {c['status']}" for name, s in results["suites"].items() for c in s["cases"]
             if c["status"] in ("fail", "error")}
    v = results.get("verdict") or {}
    blocking = [b for b in v.get("blocking", []) if b not in shown]
    ts = ET.SubElement(root, "testsuite", name="verdict", tests=str(max(1, len(blocking))), failures=str(len(blocking)),
                       errors="0", skipped="0", time="0.000", timestamp=str(man.get("started") or ""),
                       hostname=str(man.get("host") or ""))
    pe = ET.SubElement(ts, "properties")
    for k, val in props.items():
        ET.SubElement(pe, "property", name=k, value="" if val is None else str(val))
    for b in blocking:
        tc = ET.SubElement(ts, "testcase", classname="nsa_validate.verdict", name=b[:200], time="0.000")
        ET.SubElement(tc, "failure", message=b[:500]).text = b
    if not blocking:
        ET.SubElement(ts, "testcase", classname="nsa_validate.verdict", name=f"verdict: {v.get('status')}", time="0.000")
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
