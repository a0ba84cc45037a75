"""Reads measured by effect (suites/read_effect.py) catch decode paths whose counters flatter them.

Each planted path reports the formula's counts, so a comparison of numbers passes it; only the
effect of the cached tokens on the output can tell. A correct path passes the same check.
"""
import dataclasses

import pytest
import torch

from nsa_core import DecodeCache, NSAAttention, tiny
from nsa_core import torch_branches as tb
from suites import read_effect

CFG = tiny(window=12)
P = 60                                   # past the window, several compressed tokens and blocks


def _window_of(w_compute):
    """win_attention that attends over a window of ``w_compute`` tokens but reports the real one's counts."""
    real = tb.win_attention

    def planted(q, k, v, cfg, start=0, phase="prefill", want_used=False):
        out, _ = real(q, k, v, dataclasses.replace(cfg, window=w_compute), start, phase, True)
        _, used = real(q, k, v, cfg, start, phase, True)
        return (out, used) if want_used else out
    return planted


def _check(branch, tamper=None):
    """One decode step at t = P on the torch path, then read_effect.check_step for ``branch``."""
    torch.manual_seed(0)
    m = NSAAttention(CFG)
    x = torch.randn(1, P + 1, CFG.d_model)
    cache = DecodeCache(CFG, 1, P + 1)
    with torch.no_grad():
        m.fill_cache(x[:, :P], cache)
        before = read_effect.copy_rows(cache, 1)
        _, info = m.decode(x[:, P:], cache)
    reported = read_effect.reported_sets(CFG, P, info.reads, info.idx)
    if tamper:
        tamper(reported)
    formula = read_effect.formula_sets(CFG, P, info.idx[0])
    n_cached = P if branch != "cmp" else CFG.n_cmp_total(P)
    return read_effect.check_step(read_effect.module_step(m, x[:, P:]), CFG, P, before, branch,
                                  reported[branch], formula[branch], n_cached)


@pytest.mark.parametrize("branch", ["cmp", "sel", "win"])
def test_the_torch_path_reads_exactly_the_formula(branch):
    got = _check(branch)
    assert got["read"] > 0
    assert got["unread_poisoned"] > 0 or branch == "cmp"     # cmp reads every compressed token


def test_a_window_one_token_short_is_caught_by_perturbation(monkeypatch):
    monkeypatch.setattr(tb, "win_attention", _window_of(CFG.window - 1))
    with pytest.raises(AssertionError, match="did not change the output"):
        _check("win")


def test_a_window_one_token_long_is_caught_by_nan_poison(monkeypatch):
    monkeypatch.setattr(tb, "win_attention", _window_of(CFG.window + 1))
    with pytest.raises(AssertionError, match="NaN in an unread cached token"):
        _check("win")


def test_a_count_that_differs_from_the_formula_is_caught():
    def drop_one(reported):
        reported["cmp"][1] = set(sorted(reported["cmp"][1])[:-1])
    with pytest.raises(AssertionError, match="cmp KV head 1 .* reports reading"):
        _check("cmp", drop_one)
