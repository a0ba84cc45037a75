"""What the decode step's window + selection kernel compiles to for Hopper (sm90), on any machine: Triton
compiles for a target it is told, with the ptxas its wheel ships, no GPU needed. The kernel's speed on the
H200 rests on its tile loop being software-pipelined (tiles copied into shared memory ahead of use) in
programs small enough for two an SM; a Triton that compiles the same source otherwise makes it slower on
every Hopper it runs on, which no interpreter test can see (docs/decisions.md: a select in the loop's
addresses turned the pipelining off under Triton 3.8 and 3.9, not 3.6)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# compiled in a process of its own: Triton's active driver is replaced there (told the target), and the
# kernel module must be imported without the interpreter
_COMPILE = r"""
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class Aimed:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def __getattr__(self, name): return getattr(driver.default, name)

try:
    driver.set_active(Aimed())
except Exception as e:
    print(json.dumps({"skip": f"this Triton cannot be told a target: {type(e).__name__}: {e}"})); sys.exit()
from nsa_validate.suite import launches
kernel = launches.compiled(json.loads(sys.argv[1]))
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
usage = None
if os.path.exists(cuobjdump):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"]); f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
print(json.dumps({"shared": kernel.metadata.shared, "cp_async": kernel.asm["ptx"].count("cp.async.cg"),
                  "usage": usage.strip().splitlines()[-1] if usage else None}))
"""


def _b16_entry() -> dict:
    """The sm90 quick list's window + selection launch at B=16, 64k (8 window and 8 selection tiles a
    program, the late trigger, bf16)."""
    from nsa_validate.suite import launches
    for e in launches.read(ROOT / "profiles" / "kernels" / "sm90-quick.jsonl"):
        k = e["kwargs"]
        if (e["fn"].endswith(":_winsel_partial_kernel") and k["WIN_TILES"] == 8 and k["SEL_TILES"] == 8
                and k["GDC"] == 3 and k["WIN_NOWAIT"] and e["args"][0].get("tensor") == "bfloat16"):
            return e
    raise AssertionError("profiles/kernels/sm90-quick.jsonl holds no B=16 64k window + selection launch")


def test_window_selection_kernel_pipelines_in_two_programs_an_sm():
    """Its tile loop copies tiles asynchronously (cp.async), without spilling, in at most half an H100/H200
    SM's shared memory, so that two programs run on each SM. (One launch, the one the B=16 bars rest on.)"""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(_b16_entry())], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["cp_async"] > 0, f"the tile loop is not software-pipelined: {out}"
    # two programs an SM: 228 KB, less 1 KB the driver reserves for each
    assert out["shared"] <= 113 * 1024, f"more shared memory than two programs an SM allow: {out}"
    if out["usage"] is not None:        # (a Triton wheel without cuobjdump: the spills go unchecked)
        assert "STACK:0 " in out["usage"], f"registers spill: {out}"
