"""The bundled NSA implementation: config, fp32 oracle, module, decode cache, routing."""
from nsa_core.cache import DecodeCache
from nsa_core.config import PAPER, NSAConfig, tiny
from nsa_core.module import NSAAttention, StepInfo
from nsa_core.routing import BRANCHES, RoutingPolicy

__all__ = ["NSAConfig", "PAPER", "tiny", "NSAAttention", "DecodeCache", "StepInfo", "RoutingPolicy", "BRANCHES"]
