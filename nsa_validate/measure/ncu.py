"""Nsight Compute (``ncu``) as a subprocess: the DRAM bytes each kernel of a profiled region read
and wrote, counted by the GPU's own counters.

The profiled program brackets its region with ``torch.cuda.profiler.start()/stop()``; ncu runs
with ``--profile-from-start off`` and its default cache control (caches flushed before every
kernel), so each kernel's DRAM reads are what it needs from memory, not what an earlier kernel
left in L2.
"""
from __future__ import annotations

import io
import shutil
import subprocess

import pandas as pd

from nsa_validate import orphans

METRICS = {"dram__bytes_read.sum": "dram_read", "dram__bytes_write.sum": "dram_write"}
UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}


class NoCounterAccess(RuntimeError):
    """ncu runs but may not read the GPU's performance counters (ERR_NVGPUCTRPERM: the driver
    restricts them to admin users): a property of this machine, not of what is measured."""


def unavailable() -> str | None:
    """Why ncu cannot count here (None: it can)."""
    import torch
    if not torch.cuda.is_available():
        return "no CUDA GPU (hardware counters need one)"
    if shutil.which("ncu") is None:
        return "Nsight Compute (ncu) is not on the PATH"
    return None


def dram_bytes(argv: list[str], timeout_s: float = 600) -> pd.DataFrame:
    """Run ``argv`` under ncu: one row per kernel launch of its profiled region, in launch order,
    with columns id, kernel, dram_read, dram_write (bytes). Raises RuntimeError with ncu's own
    error lines when it counted nothing (e.g. no permission for the GPU's counters)."""
    cmd = ["ncu", "--profile-from-start", "off", "--metrics", ",".join(METRICS), "--csv",
           "--print-units", "base", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, preexec_fn=orphans.die_with_parent())
    if "ERR_NVGPUCTRPERM" in proc.stdout + proc.stderr:
        raise NoCounterAccess("ncu may not read this GPU's performance counters here (ERR_NVGPUCTRPERM: "
                              "the driver restricts them to admin users)")
    try:
        df = parse(proc.stdout)
    except ValueError as e:
        errs = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "ERR" in ln or "Error" in ln]
        raise RuntimeError(f"ncu (exit {proc.returncode}) {e}: " + " | ".join(errs[-3:] or
                           (proc.stdout + proc.stderr).splitlines()[-3:])) from None
    if proc.returncode != 0:
        raise RuntimeError(f"ncu exited {proc.returncode}: " + " | ".join(proc.stderr.splitlines()[-3:]))
    return df


def parse(text: str) -> pd.DataFrame:
    """ncu's ``--csv --print-units base`` metric table -> one row per launch (see ``dram_bytes``)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("printed no metric table")
    rows = [lines[start]] + [ln for ln in lines[start + 1:] if ln.startswith('"')]
    raw = pd.read_csv(io.StringIO("\n".join(rows)), dtype=str)
    raw = raw[raw["Metric Name"].isin(METRICS)]
    if raw.empty:
        raise ValueError(f"printed none of {', '.join(METRICS)}")
    unknown = set(raw["Metric Unit"]) - set(UNITS)
    if unknown:
        raise ValueError(f"printed units {sorted(unknown)} (expected bytes)")
    raw = raw.assign(value=[float(v.replace(",", "")) * UNITS[u] for v, u in zip(raw["Metric Value"], raw["Metric Unit"])],
                     id=raw["ID"].astype(int))
    wide = raw.pivot_table(index=["id", "Kernel Name"], columns="Metric Name", values="value", aggfunc="first")
    wide = wide.rename(columns=METRICS).reset_index().rename(columns={"Kernel Name": "kernel"})
    for col in METRICS.values():
        if col not in wide:
            wide[col] = float("nan")
    return wide[["id", "kernel", *METRICS.values()]].sort_values("id").reset_index(drop=True)
