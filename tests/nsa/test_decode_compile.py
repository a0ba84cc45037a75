"""What the decode step's window + selection kernel compiles to for Hopper (sm90), on any machine: Triton
compiles for a target it is told, with the ptxas its wheel ships, no GPU needed. The kernel's speed on the
H200 rests on its tile loop being software-pipelined (tiles copied into shared memory ahead of use) in
programs small enough for two an SM (three for the shallow launch, where its registers allow: the plan
asks the compiled kernel, ``kernels.decode._fits_per_sm``); a Triton that compiles the same source
otherwise makes it slower on every Hopper it runs on, which no interpreter test can see (docs/decisions.md:
a select in the loop's addresses turned the pipelining off under Triton 3.8 and 3.9, not 3.6)."""
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
    """The sm90 quick list's window + selection launch at B=16, 64k (the late trigger, the window not waiting, one
    selection block a tile, bf16): deep (8 window and 8 selection tiles a program, 3 stages) or shallow (4 and
    4, 2 stages), whichever the GPU that recorded the list planned."""
    from nsa_validate.suite import launches
    for e in launches.read(ROOT / "profiles" / "kernels" / "sm90-quick.jsonl"):
        k = e["kwargs"]
        forms = ((8, 8, 3), (4, 4, 2))
        if (e["fn"].endswith(":_winsel_partial_kernel") and (k["WIN_TILES"], k["SEL_TILES"], k["STAGES"]) in forms
                and k["GDC"] == 3 and k["WIN_NOWAIT"] and k["BPT"] == 1 and e["args"][0].get("tensor") == "bfloat16"):
            return e
    raise AssertionError("profiles/kernels/sm90-quick.jsonl holds no B=16 64k window + selection launch")


def _compile(entry: dict) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(entry)], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


@pytest.mark.parametrize("form,tiles,stages,programs", [("deep", 8, 3, 2), ("shallow", 4, 2, 3)])
def test_window_selection_kernel_pipelines_in_its_programs_an_sm(form, tiles, stages, programs):
    """The B=16 launch's kernel (the one the B=16 bars rest on) in both forms the plan may take: its tile loop
    copies tiles asynchronously (cp.async), without spilling, in at most 1/programs of an H100/H200 SM's shared
    memory (228 KB, less 1 KB the driver reserves for each program). The shallow form's registers (168 a
    thread for three programs an SM) are the plan's to check on the GPU (``_fits_per_sm``)."""
    e = _b16_entry()
    k = e["kwargs"]
    # the chunk counts (plain arguments, which Triton specialises on) that go with these tiles: ..., c_lo, C_CMP,
    # C_WIN, NC last, the window's chunks and then the selection's
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    c_cmp = e["args"][-3]
    c_win, c_sel = cdiv(cdiv(k["WINDOW"], k["BN"]), tiles), cdiv(cdiv(k["N_SEL"], k["BPT"]), tiles)
    args = [*e["args"][:-3], c_cmp, c_win, c_cmp + c_win + c_sel]
    out = _compile({**e, "args": args, "kwargs": {**k, "WIN_TILES": tiles, "SEL_TILES": tiles, "STAGES": stages}})
    assert out["cp_async"] > 0, f"the tile loop is not software-pipelined: {out}"
    assert out["shared"] + 1024 <= 228 * 1024 // programs, f"more shared memory than {programs} programs an SM allow: {out}"
    if out["usage"] is not None:        # (a Triton wheel without cuobjdump: the spills go unchecked)
        assert "STACK:0 " in out["usage"], f"registers spill: {out}"
