import pytest

from nsa_validate.config import profiles
from nsa_validate.errors import UsageError

SHIPPED = ["cpu", "sm80", "sm86", "sm89", "sm90", "sm100"]


@pytest.mark.parametrize("level", profiles.LEVELS)
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load(name, level):
    p = profiles.load(name, level)
    assert p.name == name and p.level == level and p.suites.sanity.dtypes


def test_levels_override_the_full_sweep():
    full, std, quick = (profiles.load("sm90", lv) for lv in ("full", "standard", "quick"))
    assert full.suites.triton.dtypes == ["bf16", "fp16"] and std.suites.triton.dtypes == ["bf16"]
    assert std.suites.triton.kv_heads == full.suites.triton.kv_heads        # not overridden: merged, kept
    assert len(quick.suites.decode.contexts) == 1 < len(std.suites.decode.contexts) < len(full.suites.decode.contexts)
    assert profiles.load("sm90").level == profiles.DEFAULT_LEVEL == "standard"


@pytest.mark.parametrize("text,level,needle", [
    ("name: x\n", "medium", "level 'medium' is not one of quick, standard, full"),
    ("name: x\nlevels: {full: {suites: {}}}\n", "standard", "levels.full"),
    ("name: x\nlevels: {quick: {routing: {}}}\n", "quick", "levels.quick' may only hold 'suites'"),
    ("name: x\nlevels: {quick: {suites: {sanity: {batchh: 1}}}}\n", "quick", "suites.sanity.batchh"),
    ("name: x\nlevel: quick\n", "quick", "chosen when the profile is loaded"),
], ids=["unknown-level", "full-overridden", "not-suites", "unknown-field", "level-in-file"])
def test_bad_levels_are_usage_errors(tmp_path, text, level, needle):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(UsageError) as e:
        profiles.load(str(f), level)
    assert needle in str(e.value), str(e.value)


def test_auto_name():
    assert profiles.auto_name(None) == "cpu"
    assert profiles.auto_name((9, 0)) == "sm90"
    assert profiles.auto_name((8, 7)) == "sm86"
    assert profiles.auto_name((12, 0)) == "sm100"


@pytest.mark.parametrize("text,needle", [
    ("name: x\nrouting: {sel_triton_min_lenn: 5}\n", "routing.sel_triton_min_lenn"),
    ("name: x\nsuites: {sanity: {batch: two}}\n", "suites.sanity.batch"),
    ("name: x\nsuites: {decode: {contexts: [1, x]}}\n", "suites.decode.contexts[1]"),
    ("name: x\nsuites: {decode: {capacity: 0.5x}}\n", "suites.decode.capacity"),
    ("name: x\nsuites: {decode: {capacity: twice}}\n", "suites.decode.capacity"),
    ("name: x\nsuites: {decode: {capacity: 2}}\n", "suites.decode.capacity"),
    ("name: [unclosed\n", "malformed YAML"),
    ("- just a list\n", "mapping"),
    ("description: no name\n", "name"),
])
def test_bad_profiles_name_the_field(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(UsageError) as e:
        profiles.load(str(p))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_missing_profile():
    with pytest.raises(UsageError, match="not found"):
        profiles.load("sm999")


def test_expectations_per_device_name():
    p = profiles.load("sm90")
    h200, key = p.expectations("NVIDIA H200")
    assert key == "H200" and h200.peak_bandwidth_gbs == 4800
    own = p.expect_by_device["H200"].decode_roofline_min                 # its own bar (measured on an H200)
    assert h200.decode_roofline_min == own and own < p.expect.decode_roofline_min
    assert p.expect_by_device["H200"].decode_dram_ratio_max is None      # not overridden: the family's
    assert h200.decode_dram_ratio_max == p.expect.decode_dram_ratio_max is not None
    h100, key = p.expectations("NVIDIA H100 80GB HBM3")
    assert key is None and h100 is p.expect and h100.peak_bandwidth_gbs == 3350
    assert p.expectations(None) == (p.expect, None)


def test_longest_device_key_wins(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("name: x\nexpect: {peak_bandwidth_gbs: 1}\n"
                 "expect_by_device: {H100: {peak_bandwidth_gbs: 2}, H100 PCIe: {peak_bandwidth_gbs: 3}}\n")
    p = profiles.load(str(f))
    assert p.expectations("NVIDIA H100 PCIe")[0].peak_bandwidth_gbs == 3
    assert p.expectations("NVIDIA H100 80GB HBM3")[0].peak_bandwidth_gbs == 2


@pytest.mark.parametrize("text,needle", [
    ("name: x\nexpect_by_device: {H200: {peak_bandwidth_gbs: -1}}\n", "expect_by_device.H200.peak_bandwidth_gbs"),
    ("name: x\nexpect_by_device: {H200: {decode_dram_ratio_max: 0.9}}\n", "expect_by_device.H200.decode_dram_ratio_max"),
    ("name: x\nexpect_by_device: {H200: {bandwidth: 1}}\n", "expect_by_device.H200.bandwidth"),
    ("name: x\nexpect: {decode_dram_ratio_max: 0.5}\n", "expect.decode_dram_ratio_max"),
], ids=["negative", "ratio-below-1", "unknown-field", "family-ratio-below-1"])
def test_bad_device_expectations_name_the_field(tmp_path, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(UsageError) as e:
        profiles.load(str(f))
    assert needle in str(e.value)


def test_extends_puts_the_base_underneath_and_refuses_cycles(tmp_path):
    """`extends:` merges the named file underneath (mappings key by key, lists replaced); a copy of a
    shipped profile finds base/gpu among the shipped ones; a cycle is one clear error."""
    from nsa_validate.config import profiles
    from nsa_validate.errors import UsageError
    shipped = profiles.load("sm86", "full")
    assert shipped.suites.triton.long_seq_lens == [32768] and shipped.suites.triton.dtypes == ["bf16", "fp16"]
    assert profiles.load("sm86", "quick").suites.decode.dram_counters is False      # from base/gpu's quick
    copy = tmp_path / "mine.yaml"
    copy.write_text((profiles.PROFILE_DIR / "sm90.yaml").read_text().replace("name: sm90", "name: mine"))
    mine = profiles.load(str(copy), "standard")
    want = profiles.load("sm90", "standard")
    assert mine.suites == want.suites and mine.routing == want.routing and mine.name == "mine"
    (tmp_path / "a.yaml").write_text("name: a\nextends: b\n")
    (tmp_path / "b.yaml").write_text("name: b\nextends: a\n")
    with pytest.raises(UsageError, match="cycle"):
        profiles.load(str(tmp_path / "a.yaml"))
    (tmp_path / "c.yaml").write_text("name: c\nextends: nowhere\n")
    with pytest.raises(UsageError, match="names no file"):
        profiles.load(str(tmp_path / "c.yaml"))


def _functions_with_cases(level: str) -> set[str]:
    """The suites' test functions with a real case (not a "not-in-profile" stand-in) on the cpu profile."""
    import subprocess
    import sys

    from nsa_validate.paths import REPO_ROOT
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "suites",
                          f"--nsa-level={level}"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    return {i.split("[")[0] for i in ids if "not-in-profile" not in i}


def test_the_cpu_first_run_keeps_every_check_of_the_full_sweep():
    """`make oneshot` on a CPU (level standard) runs fewer sizes than `make test` (full), never fewer
    kinds of check: every suite function with a case in the full sweep has one at standard."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a plain pytest takes the GPU's profile here, not the cpu profile")
    full = _functions_with_cases("full")
    assert full and _functions_with_cases("standard") == full


def test_a_named_profile_is_read_before_torch_is_imported():
    """A bad profile name is reported in a moment: ``resolve`` reads a named profile before it imports torch."""
    import subprocess
    import sys

    from nsa_validate.paths import REPO_ROOT
    code = ("import sys\nfrom nsa_validate.config import profiles\nfrom nsa_validate.errors import UsageError\n"
            "try:\n    profiles.resolve('sm999')\nexcept UsageError as e:\n    print('torch' in sys.modules, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.stdout.startswith("False profile 'sm999' not found"), out.stdout + out.stderr
