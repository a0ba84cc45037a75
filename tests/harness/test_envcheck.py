"""Pairing logic with faked versions and metadata."""
from pathlib import Path

from nsa_validate.env import envcheck as ec

TORCH_211 = ['filelock', 'triton==3.6.0; platform_system == "Linux"', 'sympy>=1.13.3',
             'opt-einsum>=3.3; extra == "opt-einsum"']
NIGHTLY = ['pytorch-triton==3.7.0+git1234abcd; platform_system == "Linux"']


def test_pin_matches():
    f = ec.check_torch_triton("2.11.0+cu130", TORCH_211, {"triton": "3.6.0"}, "13.0")
    assert f.status == "ok" and "3.6.0" in f.detail


def test_pin_mismatch_is_broken_with_exact_fix():
    f = ec.check_torch_triton("2.11.0+cu130", TORCH_211, {"triton": "3.5.1"}, "13.0")
    assert f.status == "broken" and f.fix == 'pip install "triton==3.6.0"'


def test_pin_present_but_triton_missing():
    f = ec.check_torch_triton("2.11.0+cu130", TORCH_211, {"triton": None}, "13.0")
    assert f.status == "broken" and "not installed" in f.detail


def test_nightly_pytorch_triton_pin():
    ok = ec.check_torch_triton("2.13.0.dev20260101+cu130", NIGHTLY, {"pytorch-triton": "3.7.0+git1234abcd"}, "13.0")
    bad = ec.check_torch_triton("2.13.0.dev20260101+cu130", NIGHTLY, {"pytorch-triton": "3.6.0", "triton": "3.6.0"}, "13.0")
    assert ok.status == "ok" and bad.status == "broken" and "pytorch-triton" in bad.fix


def test_cpu_build_is_not_applicable():
    f = ec.check_torch_triton("2.13.0+cpu", ["filelock"], {"triton": "3.9.0"}, None)
    assert f.status == "n/a" and "not applicable" in f.detail


def test_known_pairs_fallback_when_metadata_has_no_pin():
    assert ec.check_torch_triton("2.4.1", None, {"triton": "3.0.0"}, "12.1").status == "ok"
    f = ec.check_torch_triton("2.4.1", None, {"triton": "3.1.0"}, "12.1")
    assert f.status == "broken" and "3.0" in f.fix
    assert ec.check_torch_triton("2.99.0", None, {"triton": "9.0"}, "12.1").status == "degraded"


def test_undefined_symbol_names_the_wheel_that_fits():
    tag = ec.flash_attn_wheel_tag("12.4", "2.5.1+cu124", False, (3, 10))
    assert tag == "+cu12torch2.5cxx11abiFALSE-cp310-cp310-linux_x86_64"
    err = ("/x/flash_attn_2_cuda.cpython-310-x86_64-linux-gnu.so: undefined symbol: "
           "_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE")
    f = ec.diagnose_flash_import(err, "2.8.3", tag)
    assert f.status == "degraded" and "built against another torch" in f.detail
    assert "flash_attn-2.8.3+cu12torch2.5cxx11abiFALSE-cp310-cp310-linux_x86_64.whl" in f.fix


def test_other_import_error():
    f = ec.diagnose_flash_import("No module named 'einops'", "2.8.3", "+x")
    assert f.status == "degraded" and "einops" in f.detail


def test_cuda_runtime_vs_driver():
    assert ec.check_cuda_driver("12.4", 12040).status == "ok"
    assert ec.check_cuda_driver("13.0", 12080).status == "broken"
    assert ec.check_cuda_driver("12.8", 12040).status == "degraded"
    assert ec.check_cuda_driver(None, None).status == "n/a"


def test_kernels_shadowing(tmp_path):
    root = tmp_path / "repo"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "__init__.py").write_text("")
    assert ec.check_kernels_shadow(str(root / "kernels" / "__init__.py"), root).status == "ok"
    f = ec.check_kernels_shadow("/usr/lib/python3/site-packages/kernels/__init__.py", root)
    assert f.status == "broken" and "PyPI" in f.detail
    assert ec.check_kernels_shadow(None, root).status == "broken"


def test_verdict_order():
    r = ec.EnvReport(findings=[ec.Finding("a", "ok", ""), ec.Finding("b", "degraded", "")])
    assert r.verdict == "degraded"
    r.findings.append(ec.Finding("c", "broken", ""))
    assert r.verdict == "broken"


def test_collect_runs_here():
    rep = ec.collect()
    assert rep.verdict in ("ok", "degraded", "broken")
    assert rep.facts["torch"] and Path(__file__).exists()


def test_collect_can_leave_pytorchs_own_report_to_finish_later():
    """A run does not wait for ``torch.utils.collect_env`` (its subprocesses take seconds on a busy pod): the
    checks and the verdict come without it, ``complete()`` adds it."""
    rep = ec.collect(wait=False)
    assert rep.verdict in ("ok", "degraded", "broken") and "collect_env" not in rep.facts
    ce = rep.complete().facts["collect_env"]
    assert rep.pending is None and "error" not in ce and ce["seconds"] >= 0
    assert rep.to_dict()["facts"]["collect_env"] is ce


def test_pytorchs_own_report_is_waited_for_a_bounded_time_on_a_thread_that_never_holds_the_process(monkeypatch):
    """Its ``pip list`` or ``nvidia-smi`` can hang: ``complete(timeout)`` says so in the facts and goes on, and
    its thread is a daemon (a process that ends, on a usage error or at the run's end, does not wait for it)."""
    import threading
    import time as _time
    monkeypatch.setattr(ec, "_collect_env", lambda: _time.sleep(3) or {"os": "late"})
    rep = ec.collect(wait=False)
    (th,) = [t for t in threading.enumerate() if t.name == "collect_env"]
    assert th.daemon
    assert rep.complete(timeout=0.2).facts["collect_env"] == {"error": "not finished after 0.2 s"}
    assert rep.pending is None and rep.complete().facts["collect_env"]["error"]     # once only


def test_interpreter_finding_names_the_probe_error_and_the_fix():
    bad = {"ok": False, "error": "InterpreterError: TypeError('only 0-dimensional arrays')", "triton": "3.6.0"}
    f = ec.check_interpreter(False, bad, triton_pinned_by_torch=True)
    assert f.status == "degraded" and "0-dimensional" in f.detail and "3.6.0" in f.detail
    assert "upgrade torch" in f.fix
    assert "pip install -U triton" in ec.check_interpreter(False, bad, triton_pinned_by_torch=False).fix
    assert ec.check_interpreter(False, {"ok": True, "triton": "3.8.0"}, True).status == "ok"
    assert ec.check_interpreter(True, None, True).status == "n/a"
    assert ec.check_interpreter(False, None, True).status == "degraded"


def test_a_passing_interpreter_probe_is_kept_for_this_stack_and_a_failing_one_is_not(tmp_path, monkeypatch):
    """The probe (a Python process importing torch: ~3 s of every CPU command's start) runs once per
    stack: a pass is kept under the cache folder and said to be kept; a failure, or another torch, probes
    again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runs = []

    def probe(ok):
        def run(timeout=180):
            runs.append(ok)
            return {"ok": ok, "error": None if ok else "wrong values", "triton": "3.x"}, None
        return run
    monkeypatch.setattr(ec, "run_interpreter_probe", probe(False))
    assert ec.cached_interpreter_probe("2.0")[0]["ok"] is False
    assert ec.cached_interpreter_probe("2.0")[0]["ok"] is False and runs == [False, False]     # not kept
    monkeypatch.setattr(ec, "run_interpreter_probe", probe(True))
    first = ec.cached_interpreter_probe("2.0")[0]
    kept = ec.cached_interpreter_probe("2.0")[0]
    assert runs == [False, False, True] and first["ok"] and "cached" not in first and kept["cached"]
    assert "cached" in ec.check_interpreter(False, kept, True).detail
    ec.cached_interpreter_probe("2.1")                  # another torch: probed again
    assert runs == [False, False, True, True]
    assert ec.probe_cache("2.0").parent == tmp_path / "nsa-validate" / "interpreter-probe"


def test_a_kept_probe_file_that_is_not_a_kept_pass_is_probed_again(tmp_path, monkeypatch):
    """A file in the probe's place that is not what the check writes (not JSON, JSON of another shape, a
    pass that does not say when it ran) never stands in for the probe, and never breaks the check."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runs = []
    monkeypatch.setattr(ec, "run_interpreter_probe", lambda timeout=180: (runs.append(1), ({"ok": True}, None))[1])
    path = ec.probe_cache("2.0")
    path.parent.mkdir(parents=True)
    for text in ("not json", "null", "[1]", '"ok"', '{"ok": true}'):
        path.write_text(text)
        assert ec.cached_interpreter_probe("2.0")[0]["ok"] is True
    assert len(runs) == 5                          # each time probed, none of them taken for a pass
