"""The one tolerance helper (FlashAttention's rule, docs/method.md).

The oracle is computed twice: in fp32 (the truth) and in the test dtype (the low-precision
oracle). The implementation under test passes when

    max|out − ref32| <= factor · max|ref_lp − ref32| + floor(dtype) · max(1, max|ref32|)

with factor 2 for outputs and 3 for gradients, and its relative RMS error
‖out − ref32‖₂ / ‖ref32‖₂ is below 5e-3. The floor only absorbs fp32 reordering noise when
the test dtype is fp32 itself; it is never widened to make a case pass.
``lowp_rel_rms`` (the low-precision oracle's own rel-RMS) is recorded beside ``rel_rms``: it
shows what the dtype itself can reach.
"""
from __future__ import annotations

import torch

FLOOR = {torch.float32: 2e-5, torch.float64: 1e-10, torch.float16: 1e-4, torch.bfloat16: 1e-3}
REL_RMS_BAR = 5e-3
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


def compare(out: torch.Tensor, ref32: torch.Tensor, ref_lp: torch.Tensor | None, *,
            dtype: torch.dtype, factor: float = 2.0, apply_rel_rms_bar: bool = True) -> dict:
    """Metrics and verdict of ``out`` against the fp32 oracle; ``ref_lp`` = oracle in ``dtype``
    (None when dtype is fp32: then the low-precision error is 0). ``apply_rel_rms_bar=False``
    judges by the max-abs rule alone (rel-RMS still recorded); the caller must say why."""
    out32, ref32 = out.detach().double(), ref32.detach().double()
    finite = bool(torch.isfinite(out32).all())
    err = (out32 - ref32).abs().max().item() if out32.numel() else 0.0
    base = (ref_lp.detach().double() - ref32).abs().max().item() if ref_lp is not None and ref32.numel() else 0.0
    scale = max(1.0, ref32.abs().max().item() if ref32.numel() else 0.0)
    bound = factor * base + FLOOR[dtype] * scale
    denom = ref32.norm().item()
    rel_rms = (out32 - ref32).norm().item() / denom if denom > 0 else (0.0 if err == 0 else float("inf"))
    # the low-precision oracle's own rel-RMS: context for rel_rms (what this dtype can reach)
    lowp_rel_rms = ((ref_lp.detach().double() - ref32).norm().item() / denom
                    if ref_lp is not None and denom > 0 else None)
    rel_rms_bar = REL_RMS_BAR if apply_rel_rms_bar else None
    ok = finite and err <= bound and (rel_rms_bar is None or rel_rms < rel_rms_bar)
    return {"max_abs": err, "base_err": base, "ratio": err / base if base > 0 else None,
            "bound": bound, "rel_rms": rel_rms, "lowp_rel_rms": lowp_rel_rms,
            "rel_rms_bar": rel_rms_bar, "finite": finite,
            "factor": factor, "ok": ok}


def explain(m: dict) -> str:
    if not m["finite"]:
        return "output has NaN/Inf"
    lowp = f" (lowp oracle's {m['lowp_rel_rms']:.2e})" if m.get("lowp_rel_rms") is not None else ""
    return (f"max_abs {m['max_abs']:.3e} vs bound {m['bound']:.3e} "
            f"({m['factor']:g}x lowp err {m['base_err']:.3e} + floor); rel_rms {m['rel_rms']:.2e}{lowp}")
