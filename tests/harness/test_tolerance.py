"""The tolerance rule itself, pinned: an output just outside twice the low-precision oracle's error (plus
the dtype's floor) fails and one just inside passes, in every dtype; the floor is the dtype's, not wider;
the relative-RMS bar holds on its own. A rule loosened in ``nsa_validate/measure/tolerance.py`` fails here."""
import pytest
import torch

from nsa_validate.measure.tolerance import REL_RMS_BAR, compare

# the rule as docs/method.md states it, written out here rather than read from the module under test: a
# floor or factor widened there fails these tests
FLOOR = {torch.bfloat16: 1e-3, torch.float16: 1e-4, torch.float32: 2e-5}


def _pair(dtype_err: float, n: int = 4096):
    """ref32 in [-1, 1] with |ref32| reaching 1 (the floor's scale is then 1), and a low-precision oracle
    off by exactly ``dtype_err`` at one element."""
    g = torch.Generator().manual_seed(0)
    ref32 = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1
    ref32[0] = 1.0
    ref_lp = ref32.clone()
    ref_lp[1] += dtype_err
    return ref32, ref_lp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("factor", [2.0, 3.0], ids=["outputs", "gradients"])
def test_an_error_just_outside_the_bound_fails_and_just_inside_passes(dtype, factor):
    base = 0.01
    ref32, ref_lp = _pair(base)
    bound = factor * base + FLOOR[dtype]
    for over, ok in ((0.999, True), (1.001, False)):
        out = ref32.clone()
        out[2] += over * bound
        r = compare(out, ref32, ref_lp, dtype=dtype, **({} if factor == 2.0 else {"factor": factor}))
        assert r["ok"] is ok and r["bound"] == pytest.approx(bound), (over, r)


def test_fp32_is_judged_by_its_floor_alone():
    ref32, _ = _pair(0.0)
    for over, ok in ((0.99, True), (1.01, False)):
        out = ref32.clone()
        out[2] += over * FLOOR[torch.float32]
        assert compare(out, ref32, None, dtype=torch.float32)["ok"] is ok, over


def test_the_floor_scales_with_the_largest_reference_value_only_above_one():
    ref32, ref_lp = _pair(0.0)
    small = compare(ref32 + 0.5 * FLOOR[torch.bfloat16], ref32 * 1, ref_lp, dtype=torch.bfloat16)
    assert small["bound"] == pytest.approx(FLOOR[torch.bfloat16])
    big = compare(ref32 * 10, ref32 * 10, ref_lp * 10, dtype=torch.bfloat16)
    assert big["bound"] == pytest.approx(10 * FLOOR[torch.bfloat16])


def test_the_rel_rms_bar_fails_a_spread_error_the_max_rule_would_pass():
    assert REL_RMS_BAR <= 5e-3
    ref32, ref_lp = _pair(0.05)                     # a large lowp error at one element: a wide max-abs bound
    out = ref32 + 1.2 * REL_RMS_BAR * ref32.norm() / ref32.numel() ** 0.5 * torch.sign(ref32)
    r = compare(out, ref32, ref_lp, dtype=torch.bfloat16)
    assert r["max_abs"] <= r["bound"] and r["rel_rms"] > REL_RMS_BAR and not r["ok"], r
    assert compare(out, ref32, ref_lp, dtype=torch.bfloat16, apply_rel_rms_bar=False)["ok"]


def test_non_finite_output_fails_whatever_the_bound():
    ref32, ref_lp = _pair(1.0)
    out = ref32.clone()
    out[3] = float("nan")
    assert not compare(out, ref32, ref_lp, dtype=torch.bfloat16)["ok"]
