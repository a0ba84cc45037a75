import pytest

from nsa_validate import profiles
from nsa_validate.errors import UsageError

SHIPPED = ["cpu", "sm80", "sm86", "sm89", "sm90", "sm100"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load(name):
    p = profiles.load(name)
    assert p.name == name and p.suites.sanity.dtypes


def test_auto_name():
    assert profiles.auto_name(None) == "cpu"
    assert profiles.auto_name((9, 0)) == "sm90"
    assert profiles.auto_name((8, 7)) == "sm86"
    assert profiles.auto_name((12, 0)) == "sm100"


@pytest.mark.parametrize("text,needle", [
    ("name: x\nrouting: {sel_triton_min_lenn: 5}\n", "routing.sel_triton_min_lenn"),
    ("name: x\nsuites: {sanity: {batch: two}}\n", "suites.sanity.batch"),
    ("name: x\nsuites: {decode: {contexts: [1, x]}}\n", "suites.decode.contexts[1]"),
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
