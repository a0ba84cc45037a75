"""Backend routing for the three NSA branches: ``RoutingPolicy``, what the profile *asks* for
(length thresholds per branch), the registry of implementations, and the decision per branch.
What *actually executed* is the dispatch log (``nsa_core.dispatch``, re-exported here).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from nsa_core.config import BRANCHES
from nsa_core.dispatch import RANGE_PREFIX, DispatchLog, capture, decided, note, profiler_range, ranged  # noqa: F401

FA2_BACKENDS = ("auto", "flash_attn", "varlen")   # auto: flash-attn when it loads, else torch's varlen kernel
DECODE_BACKENDS = ("torch", "triton")
PREFILL_STAGES = (*BRANCHES, "select", "mix")   # the routed prefill work: the branches, block selection, the gated mix


@dataclass(frozen=True)
class RoutingPolicy:
    """Which backend each branch should use, by sequence length (from the profile's ``routing``).

    A threshold of ``None`` means the backend is never used. ``sel_triton_min_len`` gates the
    Triton selection kernel in prefill, ``cmp_triton_min_len`` the Triton compressed attention
    (it wins over FA-2 where both thresholds are met: it also gives the log-sum-exp scoring
    needs), ``select_triton_min_len`` the Triton block scoring + top-n, ``win_triton_min_len``
    the Triton sliding-window attention (before FA-2 where both are met); FA-2 thresholds gate
    the compressed and window branches; ``decode_backend`` picks the decode-step implementation.
    """
    sel_triton_min_len: int | None = None
    cmp_triton_min_len: int | None = None
    select_triton_min_len: int | None = None
    mix_triton_min_len: int | None = None
    win_triton_min_len: int | None = None
    fa2_min_len_cmp: int | None = None
    fa2_min_len_win: int | None = None
    fa2_backend: str = "auto"          # auto | flash_attn | varlen
    decode_backend: str = "torch"      # torch | triton

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def triton_everywhere(cls, **overrides) -> RoutingPolicy:
        """Every prefill stage (selection, compressed attention, block selection, mix, window) on the
        Triton kernels at every length, so the layer runs its one op; ``overrides`` set other fields
        (``decode_backend="triton"``, or a threshold back to None)."""
        stages = dict(sel_triton_min_len=0, cmp_triton_min_len=0, select_triton_min_len=0, mix_triton_min_len=0,
                      win_triton_min_len=0)
        return cls(**{**stages, **overrides})


# Backends and phases by name (the dispatch log and the results record these strings).
TORCH, TRITON, FA2 = "torch", "triton", "fa2"
PREFILL, DECODE = "prefill", "decode"


def fa2_route(fa2_backend: str) -> str:
    """The backend name of FA-2 through ``fa2_backend`` (``FA2_BACKENDS``): "fa2:auto", "fa2:varlen"…"""
    return f"{FA2}:{fa2_backend}"


# Registry of non-default implementations. ``nsa_core`` imports no implementation: the ``kernels``
# package registers its own when it is imported (``import kernels``; the harness does).
# key: (phase, branch, backend) -> (implementation, availability check returning a reason or None)
_IMPLS: dict[tuple[str, str, str], tuple[Callable, Callable[..., str | None]]] = {}


def register(phase: str, branch: str, backend: str, impl: Callable,
             unavailable: Callable[..., str | None] = lambda **_: None) -> None:
    _IMPLS[(phase, branch, backend)] = (impl, unavailable)
    _DECODE_ROUTES.clear()             # a decode route decided before may have another answer now


def lookup(phase: str, branch: str, backend: str, **query) -> tuple[Callable | None, str | None]:
    """(implementation, None) if usable for this query, else (None, reason)."""
    if (phase, branch, backend) not in _IMPLS:
        return None, (f"no {backend} implementation of {phase}/{branch} is registered "
                      f"(the kernels package registers them: import kernels)")
    impl, unavailable = _IMPLS[(phase, branch, backend)]
    reason = unavailable(**query)
    return (None, reason) if reason else (impl, None)


# The prefill backends a policy may pick per stage, in order of preference, each with the policy
# field holding the shortest length it is used from (None: never).
PREFILL_RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "cmp": ((TRITON, "cmp_triton_min_len"), (FA2, "fa2_min_len_cmp")),
    "sel": ((TRITON, "sel_triton_min_len"),),
    "win": ((TRITON, "win_triton_min_len"), (FA2, "fa2_min_len_win")),
    "select": ((TRITON, "select_triton_min_len"),),
    "mix": ((TRITON, "mix_triton_min_len"),),
}


@dataclass
class Decision:
    phase: str
    branch: str
    backend: str
    reason: str


def decide(policy: RoutingPolicy, phase: str, branch: str, seq_len: int, **query) -> Decision:
    """The backend the policy picks for one branch at this length, and why: the first backend
    whose threshold is met and that can run here (Triton before FA-2), else torch. Noted in the
    dispatch log (``dispatch.decided``)."""
    d = _decide(policy, phase, branch, seq_len, **query)
    asked = ", ".join(f"{k}={v}" for k, v in (("S", seq_len), ("dtype", query.get("dtype")),
                                                ("device", query.get("device"))) if v is not None)
    decided(phase, branch, d.backend, d.reason, asked.replace("torch.", ""))
    return d


def _decide(policy: RoutingPolicy, phase: str, branch: str, seq_len: int, **query) -> Decision:
    candidates, notes = [], []
    if phase == PREFILL:
        for backend, knob in PREFILL_RULES.get(branch, ()):
            thr = getattr(policy, knob)
            if thr is not None and seq_len >= thr:
                candidates.append((fa2_route(policy.fa2_backend) if backend == FA2 else backend,
                                   f"S={seq_len} >= {knob}={thr}"))
            elif thr is not None:
                notes.append(f"S={seq_len} < {knob}={thr}")
    elif phase == DECODE and policy.decode_backend != TORCH:
        candidates.append((policy.decode_backend, f"decode_backend={policy.decode_backend}"))
    for wanted, why in candidates:
        impl, reason = lookup(phase, branch, wanted, seq_len=seq_len, **query)
        if impl is not None:
            return Decision(phase, branch, wanted, why)
        notes.append(f"{why}, but {wanted} unavailable: {reason}")
    return Decision(phase, branch, TORCH, "; ".join(notes) or "default")


# decode_route's answers, by the ids of a (policy, cfg) pair (both frozen: hashing their fields cost more than
# the rest of the lookup) with the pair itself kept, and device and dtype; dropped when the registry changes
_DECODE_ROUTES: dict[tuple, tuple[Decision, tuple, Callable | None, tuple]] = {}


def decode_route(policy: RoutingPolicy, cfg, device, dtype) -> tuple[Decision, Callable | None]:
    """The decode step's route (``decide`` for DECODE/step) and, where that backend registers a whole-layer
    step (DECODE/layer), its implementation, else None. A decode decision does not depend on the
    position, so it is decided once per (policy, cfg, device, dtype) and kept: a decode loop pays a
    dictionary lookup a token, not the decision (~20 µs of host time on a CPU). Each call still notes
    the decision in the dispatch log, as ``decide`` does (without the position, which it did not use)."""
    key = (id(policy), id(cfg), device, dtype)
    hit = _DECODE_ROUTES.get(key)
    if hit is None or hit[3][0] is not policy or hit[3][1] is not cfg:
        d = _decide(policy, DECODE, "step", None, cfg=cfg, device=device, dtype=dtype)
        layer = lookup(DECODE, "layer", d.backend, cfg=cfg, device=device, dtype=dtype)[0] if d.backend != TORCH \
            else None
        asked = ", ".join(f"{k}={v}" for k, v in (("dtype", dtype), ("device", device)) if v is not None)
        hit = _DECODE_ROUTES[key] = (d, (DECODE, "step", d.backend, d.reason, asked.replace("torch.", "")), layer,
                                     (policy, cfg))
    decided(*hit[1])
    return hit[0], hit[2]


def prefill_routes(policy: RoutingPolicy, seq_len: int, **query) -> dict[str, Decision]:
    """The backend each prefill stage (``PREFILL_STAGES``) uses at this length under ``policy``, and why."""
    return {br: decide(policy, PREFILL, br, seq_len, **query) for br in PREFILL_STAGES}
