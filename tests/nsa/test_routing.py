"""Routing to the Triton selection kernel: the decision, and the reason when it cannot run."""
import torch

from nsa_core import routing, tiny
from nsa_core.routing import RoutingPolicy
from kernels import routes

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_threshold_picks_triton_from_min_len():
    pol = RoutingPolicy(sel_triton_min_len=64)
    cfg = tiny(block_size=16)
    below = routing.decide(pol, "prefill", "sel", 63, cfg=cfg, device=DEV, dtype=torch.float32)
    at = routing.decide(pol, "prefill", "sel", 64, cfg=cfg, device=DEV, dtype=torch.float32)
    assert below.backend == "torch" and "63 < sel_triton_min_len=64" in below.reason
    # on a GPU the kernel runs natively; without one, under the interpreter (see conftest.py)
    assert at.backend == "triton", at.reason


def test_fallback_carries_the_reason():
    pol = RoutingPolicy(sel_triton_min_len=0)
    d = routing.decide(pol, "prefill", "sel", 100, cfg=tiny(block_size=12), device=DEV, dtype=torch.float32)
    assert d.backend == "torch" and "not a power of two" in d.reason


def test_unavailable_reasons(monkeypatch):
    monkeypatch.setattr(routes, "probe", lambda: None)        # an interpreter that passed the probe
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET is not set" in routes.triton_unavailable(device="cpu", dtype=torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "bf16" in routes.triton_unavailable(device="cpu", dtype=torch.bfloat16)
    assert routes.triton_unavailable(device="cpu", dtype=torch.float16, cfg=tiny(block_size=16)) is None


def test_interpreter_that_fails_the_probe_is_refused_with_the_probe_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(routes, "probe", lambda: "InterpreterError: TypeError('only 0-dimensional arrays')")
    why = routes.triton_unavailable(device="cpu", dtype=torch.float32)
    assert "failed the capability probe" in why and "0-dimensional" in why


def test_nested_captures_each_see_their_own_calls():
    with routing.capture() as outer:
        routing.note("decode", "win", "torch")
        with routing.capture() as inner:       # two empty logs at entry: removal is by identity
            routing.note("decode", "cmp", "torch")
        routing.note("decode", "sel", "torch")
    assert inner.backends() == {"cmp": ["torch"]}
    assert outer.backends() == {"cmp": ["torch"], "sel": ["torch"], "win": ["torch"]}


def test_compressed_branch_falls_back_to_fa2_when_triton_cannot_run(monkeypatch):
    """Both thresholds met: Triton is preferred; where it cannot run, the next backend whose
    threshold is met (FA-2) is used, not torch, and the reason names both."""
    import torch
    from nsa_core import PAPER, routing
    from nsa_core.routing import RoutingPolicy
    monkeypatch.setitem(routing._IMPLS, ("prefill", "cmp", "fa2:fake"), (lambda **_: None, lambda **_: None))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pol = RoutingPolicy(cmp_triton_min_len=128, fa2_min_len_cmp=256, fa2_backend="fake")
    d = routing.decide(pol, "prefill", "cmp", 1024, cfg=PAPER, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert d.backend == "fa2:fake" and d.reason == "S=1024 >= fa2_min_len_cmp=256"
    d = routing.decide(pol, "prefill", "cmp", 200, cfg=PAPER, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert d.backend == "torch" and "triton unavailable" in d.reason and "S=200 < fa2_min_len_cmp=256" in d.reason


def test_decode_route_is_decided_once_and_noted_at_every_call(monkeypatch):
    """``decode_route``: the decision is made once per (policy, cfg, device, dtype), each call still notes it
    in the dispatch log, and a change of the registry (a backend registered) makes it decide again."""
    pol, cfg = RoutingPolicy(decode_backend="triton"), tiny(block_size=16)
    asked = []
    real = routing._decide
    monkeypatch.setattr(routing, "_decide", lambda *a, **k: (asked.append(a), real(*a, **k))[1])
    routing._DECODE_ROUTES.clear()
    with routing.capture() as log:
        first = [routing.decode_route(pol, cfg, torch.device(DEV), torch.float32) for _ in range(3)]
    assert len(asked) == 1 and all(r == first[0] for r in first)
    d, layer = first[0]
    assert d.backend == "triton" and layer is routes.decode_layer, d.reason   # the interpreter or a GPU runs it
    assert any(v.startswith("triton: decode_backend=triton") for v in log.decisions[("decode", "step")])
    routing.decode_route(RoutingPolicy(decode_backend="triton"), cfg, torch.device(DEV), torch.float32)
    assert len(asked) == 2                    # another policy object: decided for it
    routing.register("decode", "step", "fake2", lambda **_: None)
    routing.decode_route(pol, cfg, torch.device(DEV), torch.float32)
    assert len(asked) == 3                    # the registry changed: decided again
    routing._IMPLS.pop(("decode", "step", "fake2"))
