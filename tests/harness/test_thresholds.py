"""The FA-2 threshold rule on synthetic speedup tables, and the profile rewrite."""
import yaml

from nsa_validate.config.thresholds import pick_backend, recommend, rewrite_routing


def test_no_qualifying_length_disables():
    assert recommend({512: 0.5, 1024: 0.9, 2048: 1.1}) is None
    assert recommend({}) is None


def test_smallest_length_when_all_qualify():
    assert recommend({512: 1.3, 1024: 2.0, 4096: 5.0}) == 512


def test_a_dip_at_a_larger_length_moves_the_threshold_past_it():
    assert recommend({512: 1.5, 1024: 1.1, 2048: 1.4, 4096: 1.6}) == 2048


def test_a_dip_at_the_largest_length_disables():
    assert recommend({512: 3.0, 1024: 3.0, 2048: 1.19}) is None


def test_margin_is_inclusive():
    assert recommend({512: 1.2, 1024: 1.3}, margin=1.2) == 512


def test_pick_backend_prefers_the_earliest_useful():
    assert pick_backend({"flash_attn": 2048, "varlen": 1024}) == ("varlen", 1024)
    assert pick_backend({"flash_attn": 1024, "varlen": 1024}) == ("flash_attn", 1024)
    assert pick_backend({"flash_attn": None, "varlen": None}) == (None, None)


def test_rewrite_keeps_comments_and_parses():
    text = ("name: sm90\nrouting:\n  sel_triton_min_len: 1024   # keep\n  fa2_min_len_cmp: null    # note\n"
            "  fa2_min_len_win: null\n  fa2_backend: auto\n")
    out = rewrite_routing(text, {"fa2_min_len_cmp": 4096, "fa2_min_len_win": None, "fa2_backend": "varlen"},
                          "# suggested\n")
    assert out.startswith("# suggested\n") and "# note" in out and "# keep" in out
    r = yaml.safe_load(out)["routing"]
    assert r == {"sel_triton_min_len": 1024, "fa2_min_len_cmp": 4096, "fa2_min_len_win": None, "fa2_backend": "varlen"}
