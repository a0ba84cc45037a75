"""The bundled NSA implementation: config, fp32 oracle, module, decode cache, routing.

Names are imported on first use (PEP 562), so ``nsa_core.config`` and ``nsa_core.routing`` load
without torch: the CLI's ``--help``, ``list``, ``report`` and ``compare`` never import it.

``nsa_core`` imports nothing of ``kernels``: the Triton and FA-2 backends register themselves with
``nsa_core.routing`` when ``kernels`` is imported (``import kernels``); until then every branch
runs on torch and each routing decision says why."""
import importlib

_WHERE = {"NSAConfig": "config", "PAPER": "config", "tiny": "config", "NSAAttention": "module",
          "StepInfo": "module", "DecodeCache": "cache", "RoutingPolicy": "routing", "BRANCHES": "config"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"nsa_core.{_WHERE[name]}"), name)
    if name in ("reference", "module", "cache", "config", "routing", "torch_branches"):
        return importlib.import_module(f"nsa_core.{name}")
    raise AttributeError(f"module 'nsa_core' has no attribute {name!r}")
