"""Kernel-name evidence: what each dispatch entry promises, names matched, and (on a GPU with
flash-attn) a wrapper that lies about its backend fails the fa2 suite."""
import subprocess
import sys

import pytest
import torch

from nsa_validate.measure import evidence
from nsa_validate.suite import plugin
from nsa_validate.paths import REPO_ROOT as REPO

FA = "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>, " \
     "false, true, false, false, true, true, false, false>(flash::Flash_fwd_params)"
TORCH_FA = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, " \
           "cutlass::bfloat16_t>, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)"
MATH = ["void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(float*, float const*, int)",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"]


def _log(*names, ranges=None):
    log = evidence.KernelLog(active=True)
    log.names.update(names)
    for k, v in (ranges or {}).items():
        log.by_range[k] = evidence.Counter(v)
    return log


def test_each_dispatch_entry_promises_a_kernel_family():
    assert evidence.family("kernel", "sel_fwd", "triton") == "triton:sel_fwd"
    assert evidence.family("kernel", "sel_bwd", "triton") == "triton:sel_bwd"
    assert evidence.family("decode", "cmp", "triton") == "triton:decode"
    assert evidence.family("prefill", "win", "fa2:flash_attn") == "flash_attn"
    assert evidence.family("prefill", "cmp", "fa2:varlen") == "varlen"
    assert evidence.family("prefill", "sel", "torch") is None


def test_pytorchs_bundled_flash_kernel_is_not_flash_attn():
    assert _log(FA).matching("flash_attn") and not _log(TORCH_FA).matching("flash_attn")
    assert _log(TORCH_FA).matching("varlen") and _log(TORCH_FA).matching("sdpa_fused")
    assert not _log(*MATH).matching("sdpa_fused")
    assert _log("_sel_fwd_kernel").matching("triton:sel_fwd") and not _log("_sel_fwd_kernel").matching("triton:sel_bwd")


def test_expect_ran_fails_on_the_kernels_the_gpu_ran(monkeypatch):
    """The dispatch log says flash_attn; the GPU ran PyTorch's kernel: the case fails."""
    from nsa_core.routing import DispatchLog
    rec = plugin.Recorder()
    log = DispatchLog()
    log.counts[("prefill", "win", "fa2:flash_attn")] = 1
    rec._klog = _log(TORCH_FA, ranges={"prefill/win": [TORCH_FA]})
    with pytest.raises(AssertionError, match="the GPU ran no flash_attn kernel for prefill/win"):
        rec.expect_ran(log, "prefill", "win", "fa2:flash_attn")
    rec = plugin.Recorder()          # a new case: the GPU ran flash-attn's own kernel
    rec._klog = _log(FA, ranges={"prefill/win": [FA]})
    rec.expect_ran(log, "prefill", "win", "fa2:flash_attn")
    assert rec.kernels["prefill/win"] == ["void flash::flash_fwd_kernel<…>(flash::Flash_fwd_params)"]


def test_a_path_observed_block_wide_keeps_only_its_own_kernels():
    """A Triton step's launches belong to no profiler range, so its kernels are found among the
    whole block's; the block's other kernels (a layer's projections) are not filed under the path."""
    from nsa_core.routing import DispatchLog
    log = DispatchLog()
    for br in ("cmp", "sel", "win"):
        log.counts[("decode", br, "triton")] = 1
    rec = plugin.Recorder()
    rec._klog = _log("_cmp_partial_kernel", "_merge_kernel", *MATH, ranges={"decode/step": [MATH[1]]})
    for br in ("cmp", "sel", "win"):
        rec.expect_ran(log, "decode", br, "triton")
        assert rec.kernels[f"decode/{br}"] == ["_cmp_partial_kernel", "_merge_kernel"]
    rec = plugin.Recorder()          # none of the family ran: the case fails and names what did
    rec._klog = _log(*MATH)
    with pytest.raises(AssertionError, match="the GPU ran no triton:decode kernel for decode/cmp.*sm90_xmma"):
        rec.expect_ran(log, "decode", "cmp", "triton")


def test_the_decode_family_names_every_kernel_the_step_launches():
    """The decode step's kernels, by their names in kernels/decode.py, are the ``triton:decode`` family
    (a renamed kernel would otherwise drop out of the evidence unnoticed); the stand-alone append, the
    launch floor and the candidates from given scores (``top_n_of``), which are not the step's attention,
    are not."""
    import re

    import triton
    from kernels import decode
    from nsa_validate.measure.evidence import EXPECT
    names = {n for n, f in vars(decode).items()       # JIT functions (interpreted ones too) that launch as kernels
             if isinstance(f, triton.runtime.jit.KernelInterface) and n.endswith("_kernel")}
    family = {n for n in names if re.search(EXPECT["triton:decode"], n)}
    outside = {"_append_kernel", "_empty_kernel", "_candidates_kernel"}
    assert family == names - outside, (sorted(family), sorted(names))
    assert len(family) == len(decode.LAUNCHES)


def test_a_capture_records_every_path_the_dispatch_log_saw(monkeypatch):
    """Not only the path a case asserts: a prefill run inside a decode case's capture is on record
    with its backend, so its kernels are never filed under "no backend logged"."""
    from types import SimpleNamespace

    from nsa_core import routing
    monkeypatch.setattr(plugin.context, "current", lambda: SimpleNamespace(device="cpu"))
    rec = plugin.Recorder()
    with rec.capture() as log:
        routing.note("prefill", "cmp", "torch")
        routing.note("decode", "cmp", "triton")
    rec.expect_ran(log, "decode", "cmp", "triton")
    assert rec.backends == {"prefill/cmp": ["torch"], "decode/cmp": ["triton"]}


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.skipif(not _has_flash_attn(), reason="needs a CUDA GPU with flash-attn installed")
def test_a_wrapper_that_lies_about_its_backend_fails_the_fa2_suite():
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "suites/test_fa2.py"),
         "-k", "window_branch and flash_attn", *extra], cwd=REPO, capture_output=True, text=True, timeout=600)
    honest = run()
    assert honest.returncode == 0, honest.stdout[-2000:]
    rigged = run("-p", "tests.harness.rigs.flash_attn_is_varlen")
    assert rigged.returncode == 1, rigged.stdout[-2000:]
    assert "the GPU ran no flash_attn kernel" in rigged.stdout and "pytorch_flash" in rigged.stdout


def test_notes_of_recorded_work_reach_outer_logs_only_when_replayed():
    """A CUDA graph's capture records kernels without running them: its notes must not count as runs
    (``dispatch.diverted``), and each replay counts them once (``dispatch.replay``)."""
    from nsa_core import dispatch
    with dispatch.capture() as outer:
        dispatch.note("decode", "win", "triton")                 # ran
        with dispatch.diverted() as recorded:
            dispatch.note("decode", "cmp", "triton")             # recorded only
        assert outer.ran("decode", "cmp", "triton") == 0 and recorded.ran("decode", "cmp", "triton") == 1
        dispatch.replay(recorded)
        dispatch.replay(recorded)
        dispatch.note("decode", "sel", "triton")                 # the outer logs are back
    assert outer.ran("decode", "cmp", "triton") == 2
    assert outer.ran("decode", "win", "triton") == outer.ran("decode", "sel", "triton") == 1


def test_a_capture_diverts_only_its_own_threads_notes():
    """Another thread's kernels run (and are noted) while this one captures a graph."""
    import threading
    from nsa_core import dispatch
    with dispatch.capture() as outer:
        with dispatch.diverted() as recorded:
            other = threading.Thread(target=dispatch.note, args=("prefill", "sel", "triton"))
            other.start()
            other.join()
    assert outer.ran("prefill", "sel", "triton") == 1 and recorded.ran("prefill", "sel", "triton") == 0


@pytest.mark.parametrize("counts", [{}, {("prefill", "sel", "torch"): 3}, {("prefill", "win", "triton"): 1},
                                    {("decode", "sel", "triton"): 1}],
                         ids=["nothing-ran", "another-backend", "another-branch", "another-phase"])
def test_expect_ran_fails_when_the_dispatch_log_lacks_the_path(counts):
    """On a CPU the dispatch log is the only evidence a path ran: ``expect_ran`` fails a case whose log holds
    no run of the exact (phase, branch, backend) asked for, and passes once it holds one. (A vacuous
    assertion there fails this test.)"""
    from nsa_core.routing import DispatchLog
    log = DispatchLog()
    log.counts.update(counts)
    with pytest.raises(AssertionError, match="path under test did not run: prefill/sel on triton"):
        plugin.Recorder().expect_ran(log, "prefill", "sel", "triton")
    log.counts[("prefill", "sel", "triton")] += 1
    rec = plugin.Recorder()
    rec.expect_ran(log, "prefill", "sel", "triton")
    assert rec.backends["prefill/sel"] == sorted({"triton", *(b for (p, br, b) in counts if (p, br) == ("prefill", "sel"))})
