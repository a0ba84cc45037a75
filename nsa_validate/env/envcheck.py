"""Environment and pairing check (docs/method.md): is torch/triton/flash-attn a working set here?

``collect()`` probes the machine. The decisions are small pure functions of versions,
metadata and error messages, so tests can feed them fakes (a CPU torch, a nightly's
``pytorch-triton`` pin, an ``undefined symbol`` import error, an old driver).

Finding statuses: ok | info | n/a | degraded (something optional missing) |
broken (something required mismatched). Verdict: broken > degraded > ok.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import importlib.metadata as md
import importlib.util
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from nsa_validate.paths import REPO_ROOT, kernel_sources, user_cache

REQUIRED = ("typer", "rich", "pandas", "pytest", "PyYAML", "matplotlib", "packaging")
# Fallback only, when torch's metadata carries no pin (source/conda builds): torch major.minor ->
# triton major.minor it was released with.
KNOWN_PAIRS = {"2.3": "2.3", "2.4": "3.0", "2.5": "3.1", "2.6": "3.2", "2.7": "3.3", "2.8": "3.4",
               "2.9": "3.5", "2.11": "3.6"}


@dataclass
class Finding:
    check: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class EnvReport:
    facts: dict = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    pending: concurrent.futures.Future | None = field(default=None, repr=False)   # ``collect(wait=False)``

    def complete(self, timeout: float | None = None) -> "EnvReport":
        """Wait for PyTorch's own report (``collect(wait=False)`` left it running), at most ``timeout``
        seconds (its ``pip list`` or ``nvidia-smi`` can hang), and add it to the facts."""
        if self.pending is not None:
            try:
                self.facts["collect_env"] = self.pending.result(timeout)
            except concurrent.futures.TimeoutError:
                self.facts["collect_env"] = {"error": f"not finished after {timeout} s"}
            self.pending = None
        return self

    @property
    def verdict(self) -> str:
        st = {f.status for f in self.findings}
        return "broken" if "broken" in st else "degraded" if "degraded" in st else "ok"

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "facts": self.facts, "findings": [asdict(f) for f in self.findings]}


# -- pure decisions ---------------------------------------------------------------------
def triton_pin(requires: list[str] | None) -> tuple[str, Requirement] | None:
    """torch's own pin on triton from its Requires-Dist lines: (dist name, requirement)."""
    for line in requires or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name.lower() in ("triton", "pytorch-triton"):
            if req.marker is not None and "extra" in str(req.marker):
                continue
            return req.name.lower(), req
    return None


def check_torch_triton(torch_version: str, requires: list[str] | None,
                       installed: dict[str, str | None], cuda_build: str | None) -> Finding:
    """Compare the installed triton with the exact pin in torch's distribution metadata."""
    pin = triton_pin(requires)
    if pin is None:
        if cuda_build is None:
            return Finding("torch↔triton", "n/a",
                           f"torch {torch_version} is a CPU build: it carries no triton pin (not applicable)")
        mm = ".".join(torch_version.split("+")[0].split(".")[:2])
        want = KNOWN_PAIRS.get(mm)
        have = installed.get("triton") or installed.get("pytorch-triton")
        if want is None:
            return Finding("torch↔triton", "degraded",
                           f"torch {torch_version} metadata has no triton pin and {mm} is not in the known-pairs table",
                           "install torch from the official wheels, which pin triton")
        if have and ".".join(have.split(".")[:2]) == want:
            return Finding("torch↔triton", "ok", f"triton {have} (known pair for torch {mm}; metadata had no pin)")
        return Finding("torch↔triton", "broken",
                       f"torch {mm} ships with triton {want}.x (known pairs; metadata had no pin); installed: {have}",
                       f'pip install "triton=={want}.*"')
    name, req = pin
    marker_ok = req.marker is None or req.marker.evaluate()
    if not marker_ok:
        return Finding("torch↔triton", "n/a", f"torch pins {req} which does not apply on this platform")
    have = installed.get(name)
    if have is None:
        return Finding("torch↔triton", "broken", f"torch {torch_version} requires {name}{req.specifier} "
                       f"but {name} is not installed", f'pip install "{name}{req.specifier}"')
    if req.specifier.contains(have, prereleases=True):
        return Finding("torch↔triton", "ok", f"{name} {have} matches torch's pin {name}{req.specifier}")
    return Finding("torch↔triton", "broken", f"torch {torch_version} pins {name}{req.specifier}, installed {have}",
                   f'pip install "{name}{req.specifier}"')


def flash_attn_wheel_tag(cuda: str | None, torch_version: str, cxx11abi: bool, py: tuple[int, int]) -> str:
    """The part of a flash-attn release wheel's name that must fit this torch:
    ``+cu12torch2.4cxx11abiFALSE-cp310-cp310-linux_x86_64``."""
    cu = f"cu{cuda.split('.')[0]}" if cuda else "cpu"
    tv = ".".join(torch_version.split("+")[0].split(".")[:2])
    cp = f"cp{py[0]}{py[1]}"
    return f"+{cu}torch{tv}cxx11abi{'TRUE' if cxx11abi else 'FALSE'}-{cp}-{cp}-linux_x86_64"


def diagnose_flash_import(err: str, fa_version: str | None, tag: str) -> Finding:
    v = fa_version or "?"
    if "undefined symbol" in err:
        sym = re.search(r"undefined symbol: (\S+)", err)
        return Finding("flash-attn", "degraded",
                       f"flash-attn {v} is installed but its compiled extension does not load "
                       f"(undefined symbol {sym.group(1) if sym else ''}): it was built against another torch",
                       f"install the flash-attn wheel built for this stack: flash_attn-{v}{tag}.whl "
                       f"(or rebuild: pip install flash-attn=={v} --no-build-isolation)")
    return Finding("flash-attn", "degraded", f"flash-attn {v} is installed but does not import: {err.strip()[:300]}",
                   "reinstall flash-attn for this torch (pip install flash-attn --no-build-isolation)")


def check_cuda_driver(runtime: str | None, driver: int | None) -> Finding:
    """torch's CUDA runtime vs the newest CUDA the driver supports (cuDriverGetVersion, e.g. 12040)."""
    if runtime is None:
        return Finding("CUDA runtime↔driver", "n/a", "torch has no CUDA runtime (CPU build)")
    if driver is None:
        return Finding("CUDA runtime↔driver", "info", f"torch built for CUDA {runtime}; no NVIDIA driver found")
    dmaj, dmin = driver // 1000, (driver % 1000) // 10
    rmaj, rmin = (int(x) for x in runtime.split(".")[:2])
    if (rmaj, rmin) <= (dmaj, dmin):
        return Finding("CUDA runtime↔driver", "ok", f"torch CUDA {runtime} <= driver supports {dmaj}.{dmin}")
    if rmaj > dmaj:
        return Finding("CUDA runtime↔driver", "broken",
                       f"torch built for CUDA {runtime} but the driver supports only up to {dmaj}.{dmin}",
                       f"upgrade the NVIDIA driver, or install a torch built for cu{dmaj}{dmin} or older")
    return Finding("CUDA runtime↔driver", "degraded",
                   f"torch CUDA {runtime} is newer than the driver's {dmaj}.{dmin} (minor-version compatibility only: "
                   "PTX JIT of newer code can fail)", "upgrade the NVIDIA driver")


def check_interpreter(gpu: bool, probe: dict | None, triton_pinned_by_torch: bool) -> Finding:
    """Triton's interpreter on a CPU machine: ``probe`` is what ``python -m kernels.interpreter``
    printed ({ok, error, triton}) or None when it could not be run (the error then in ``probe_error``)."""
    if gpu:
        return Finding("triton interpreter", "n/a", "a GPU is visible: the Triton kernels run natively")
    if probe is None:
        return Finding("triton interpreter", "degraded", "the interpreter capability probe could not run",
                       "see `python -m kernels.interpreter` with TRITON_INTERPRET=1 for the error")
    if probe.get("ok"):
        when = f" (on {probe['cached']}, with this same stack: cached)" if probe.get("cached") else ""
        return Finding("triton interpreter", "ok", f"triton {probe.get('triton')}'s interpreter ran the capability "
                       f"probe correctly{when}: the triton and decode suites run their kernels on this CPU")
    how = ("torch pins this triton, so upgrade torch to a release whose pinned triton passes"
           if triton_pinned_by_torch else "pip install -U triton (this torch pins no triton)")
    return Finding("triton interpreter", "degraded",
                   f"triton {probe.get('triton')}'s interpreter fails the capability probe ({probe.get('error')}): "
                   "the Triton kernels' cases skip on this CPU with that reason",
                   f"{how}; seen passing: triton 3.8.0 (torch 2.14.1), 3.9.0 (CPU torch 2.13.0); seen failing: 3.6.0")


def probe_cache(torch_version: str) -> Path | None:
    """Where a passing probe of this exact stack is kept: a file named by Python's, torch's, triton's
    (or pytorch-triton's) and numpy's versions, the size and time of triton's interpreter and language
    sources and its compiled library, and the probe's own code (every ``kernels/*.py``: it imports them
    all); any of them changed, the probe runs again. None where there is no cache folder or no triton."""
    import hashlib

    folder = user_cache()
    spec = importlib.util.find_spec("triton")
    if folder is None or spec is None or not spec.submodule_search_locations:
        return None
    tr = Path(spec.submodule_search_locations[0])
    parts = [sys.version, torch_version, _dist_version("triton") or _dist_version("pytorch-triton") or "",
             _dist_version("numpy") or ""]
    try:
        for f in sorted([tr / "runtime" / "interpreter.py", *tr.glob("language/*.py"), *tr.glob("_C/*.so")]):
            st = f.stat()
            parts.append(f"{f.relative_to(tr)}:{st.st_size}:{st.st_mtime_ns}")
        h = hashlib.sha256("|".join(parts).encode())
        for src in kernel_sources():
            h.update(src.read_bytes())
    except OSError:
        return None
    return folder / "interpreter-probe" / f"{h.hexdigest()[:24]}.json"


def cached_interpreter_probe(torch_version: str) -> tuple[dict | None, str | None]:
    """``run_interpreter_probe``, or its passing result from an earlier run with this same stack
    (``probe_cache``; the probe takes ~3 s of a CPU command's start: a Python process importing torch).
    A failed probe is never kept: it runs again next time."""
    import json
    import time

    from nsa_validate import safefs
    path = probe_cache(torch_version)
    try:
        if path is not None and path.is_file():
            kept = json.loads(path.read_text())
            if isinstance(kept, dict) and kept.get("ok") is True and kept.get("cached"):
                return kept, None
    except (OSError, ValueError):
        pass                           # unreadable: probe again
    probe, why = run_interpreter_probe()
    if path is not None and probe is not None and probe.get("ok") is True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            safefs.atomic_write(path, json.dumps({**probe, "cached": time.strftime("%Y-%m-%d %H:%M")}))
        except OSError:
            pass                       # a cache that cannot be written: the next run probes again
    return probe, why


def run_interpreter_probe(timeout: float = 180) -> tuple[dict | None, str | None]:
    """Run ``kernels.interpreter`` in a child process set up as a CPU suite's (``interpret.child_env``:
    Triton reads the switch when a kernel is defined, so this process's own kernels are unaffected)."""
    import json

    from nsa_validate import orphans
    from nsa_validate.env import interpret
    env = interpret.child_env("cpu")
    try:
        p = subprocess.run([sys.executable, "-m", "kernels.interpreter"], capture_output=True, text=True,
                           timeout=timeout, cwd=REPO_ROOT, env=env,
                           preexec_fn=orphans.die_with_parent())
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    for line in reversed(p.stdout.strip().splitlines()):
        try:
            return json.loads(line), None
        except json.JSONDecodeError:
            continue
    return None, (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]


def check_kernels_shadow(origin: str | None, repo_root: Path = REPO_ROOT) -> Finding:
    want = (repo_root / "kernels" / "__init__.py").resolve()
    if origin is None:
        return Finding("import kernels", "broken", "`import kernels` finds nothing",
                       "run from the repo root or `pip install -e .` in this repo")
    if Path(origin).resolve() != want:
        return Finding("import kernels", "broken",
                       f"`import kernels` resolves to {origin}, not this repo's {want} "
                       "(the unrelated PyPI distribution 'kernels' shadows it?)",
                       "pip uninstall kernels, or run with this repo first on sys.path (pip install -e .)")
    return Finding("import kernels", "ok", f"resolves to this repo ({want})")


# -- probes ------------------------------------------------------------------------------
def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def driver_cuda_version() -> int | None:
    for lib in ("libcuda.so.1", "libcuda.so"):
        try:
            cuda = ctypes.CDLL(lib)
        except OSError:
            continue
        v = ctypes.c_int()
        if cuda.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return v.value
    return None


def gpu_telemetry() -> dict:
    """Driver, clocks, power, temperature from nvidia-smi (empty if unavailable)."""
    if not shutil.which("nvidia-smi"):
        return {}
    fields = ["driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "power.draw",
              "power.limit", "temperature.gpu", "pstate"]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if not out:
        return {}
    return dict(zip(fields, [v.strip() for v in out[0].split(",")]))


def _flash_attn_version() -> str | None:
    v = _dist_version("flash_attn", "flash-attn")
    if v:
        return v
    spec = importlib.util.find_spec("flash_attn")
    if spec and spec.origin:
        m = re.search(r'__version__\s*=\s*["\']([^"\']+)', Path(spec.origin).read_text())
        return m.group(1) if m else None
    return None


def check_flash_attn(torch, tag: str) -> tuple[Finding, dict]:
    facts: dict = {"installed": False}
    if importlib.util.find_spec("flash_attn") is None:
        if torch.version.cuda is None:
            return Finding("flash-attn", "degraded", "flash-attn is not installed (optional; it needs a CUDA GPU "
                           "and a CUDA build of torch)", "on a GPU machine: pip install flash-attn --no-build-isolation"), facts
        return Finding("flash-attn", "degraded", "flash-attn is not installed (optional: the fa2 suite's "
                       "flash_attn backend will be skipped)",
                       f"pip install flash-attn --no-build-isolation (a prebuilt wheel for this stack ends in {tag}.whl)"), facts
    version = _flash_attn_version()
    facts.update(installed=True, version=version)
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_varlen_func
    except (ImportError, OSError) as e:
        facts["import_error"] = str(e)[:500]
        return diagnose_flash_import(str(e), version, tag), facts
    if not torch.cuda.is_available():
        return Finding("flash-attn", "info", f"flash-attn {version} imports; no GPU to run it on"), facts
    cap = torch.cuda.get_device_capability()
    if cap < (8, 0):
        return Finding("flash-attn", "degraded", f"flash-attn {version} needs sm80+, this GPU is sm{cap[0]}{cap[1]}",
                       "use the SDPA / torch backends on this GPU"), facts
    try:
        q = torch.randn(5, 2, 64, device="cuda", dtype=torch.float16)
        cu = torch.tensor([0, 2, 5], device="cuda", dtype=torch.int32)
        out = flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, causal=True)
        torch.cuda.synchronize()
        if not torch.isfinite(out).all():
            raise RuntimeError("non-finite output")
    except Exception as e:  # noqa: BLE001 - any failure of the tiny call is the finding
        facts["call_error"] = str(e)[:500]
        return Finding("flash-attn", "degraded", f"flash-attn {version} imports but a tiny varlen call fails on "
                       f"this GPU: {str(e).strip()[:200]} (wheel built without sm{cap[0]}{cap[1]}?)",
                       f"install a flash-attn build that includes sm{cap[0]}{cap[1]}"), facts
    facts["tiny_call"] = "ok"
    return Finding("flash-attn", "ok", f"flash-attn {version}: extension loads, tiny varlen call ran on sm{cap[0]}{cap[1]}"), facts


def _collect_env() -> dict:
    """PyTorch's own environment report (``torch.utils.collect_env``: OS, libc, compilers, CUDA,
    cuDNN, driver, CPU, the pip and conda package lists), as strings, and the seconds it took
    (``seconds``); {"error": …} if it fails."""
    t = time.monotonic()
    try:
        from torch.utils import collect_env
        info = {k: v if isinstance(v, (str, bool, int, float)) or v is None else str(v)
                for k, v in collect_env.get_env_info()._asdict().items()}
    except Exception as e:  # noqa: BLE001  (a report helper must not break the check)
        info = {"error": f"{type(e).__name__}: {e}"}
    return {**info, "seconds": round(time.monotonic() - t, 2)}


def collect(wait: bool = True) -> EnvReport:
    """The environment report. PyTorch's own (``_collect_env``: subprocesses such as ``pip list``, seconds
    on a pod whose cores the warming keeps busy) runs on a thread beside the checks; ``wait=False``
    returns without it (the checks' findings and verdict never depend on it): ``EnvReport.complete()``
    adds it once it is needed, so that a run's suites need not wait for it."""
    rep = EnvReport()
    f = rep.facts
    f["python"] = platform.python_version()
    f["platform"] = f"{platform.system()} {platform.machine()}"
    f["host"] = platform.node()
    missing = [n for n in REQUIRED if _dist_version(n) is None]
    f["packages"] = {n: _dist_version(n) for n in REQUIRED}
    if missing:
        rep.findings.append(Finding("harness dependencies", "broken", f"missing: {', '.join(missing)}",
                                    "pip install -e .  (or make oneshot, which sets up a virtualenv)"))
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        rep.findings.append(Finding("torch", "broken", f"torch does not import: {e}", "pip install torch"))
        return rep
    f["torch"] = torch.__version__
    f["torch_cuda"] = torch.version.cuda
    # a daemon thread: a process that ends (a usage error, the run done) does not wait for it
    rep.pending = pending = concurrent.futures.Future()
    threading.Thread(target=lambda: pending.set_result(_collect_env()), name="collect_env", daemon=True).start()
    try:
        _checks(rep, torch)
    finally:
        if wait:
            rep.complete()
    return rep


def _checks(rep: EnvReport, torch) -> None:
    """The pairing checks once torch imports (``collect``)."""
    f = rep.facts
    f["cxx11abi"] = bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    installed = {"triton": _dist_version("triton"), "pytorch-triton": _dist_version("pytorch-triton")}
    f["triton"] = installed["triton"] or installed["pytorch-triton"]
    try:
        requires = md.distribution("torch").requires
    except md.PackageNotFoundError:
        requires = None
    rep.findings.append(check_torch_triton(torch.__version__, requires, installed, torch.version.cuda))
    if platform.system() == "Linux":
        try:
            import triton  # noqa: F401
        except Exception as e:  # noqa: BLE001
            rep.findings.append(Finding("triton", "broken", f"triton does not import: {e}", "pip install triton"))
    gpu = torch.cuda.is_available()
    f["cuda_available"] = gpu
    if gpu:
        p = torch.cuda.get_device_properties(0)
        f["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sm": f"sm{p.major}{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count,
                    "count": torch.cuda.device_count()}
        f["cudnn"] = torch.backends.cudnn.version()
        f["telemetry"] = gpu_telemetry()
    else:
        rep.findings.append(Finding("GPU", "info", "no CUDA GPU visible: GPU-only suites will skip with a reason"))
    drv = driver_cuda_version()
    f["driver_cuda"] = f"{drv // 1000}.{(drv % 1000) // 10}" if drv else None
    rep.findings.append(check_cuda_driver(torch.version.cuda, drv))
    tag = flash_attn_wheel_tag(torch.version.cuda, torch.__version__, f["cxx11abi"], sys.version_info[:2])
    fa, fa_facts = check_flash_attn(torch, tag)
    f["flash_attn"] = fa_facts
    rep.findings.append(fa)
    f["varlen_attn"] = _has_module("torch.nn.attention.varlen")
    spec = importlib.util.find_spec("kernels")
    shadow = check_kernels_shadow(spec.origin if spec else None)
    rep.findings.append(shadow)
    if not gpu and platform.system() == "Linux" and shadow.status == "ok" and f["triton"]:
        probe, why = cached_interpreter_probe(torch.__version__)
        f["interpreter_probe"] = probe or {"ok": False, "error": why}
        rep.findings.append(check_interpreter(gpu, probe, triton_pin(requires) is not None))
    else:
        rep.findings.append(check_interpreter(gpu, {"ok": True}, False) if gpu else
                            Finding("triton interpreter", "n/a", "not probed (no triton, or `kernels` is not this repo's)"))


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
