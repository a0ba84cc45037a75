"""The validation suites the CLI drives (each a pytest module run in its own process)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Suite:
    name: str
    module: str                 # its file under suites/
    proves: str


SUITES = {s.name: s for s in [
    Suite("sanity", "test_sanity.py",
          "tiny prefill + decode end to end; each branch (gate forced one-hot) vs the oracle; finite outputs"),
    Suite("triton", "test_triton.py",
          "Triton selection, compressed attention and block scoring kernels vs the oracle; GQA, varlen, determinism, module on the kernels; bench"),
    Suite("fa2", "test_fa2.py", "FA-2 varlen (flash_attn, torch varlen_attn) for window/compressed branches vs oracle; bench"),
    Suite("decode", "test_decode.py",
          "Triton decode step vs the oracle; step time (CUDA graphs), per branch, dense baseline, roofline"),
    Suite("layer", "test_layer.py",
          "the whole NSA layer (prefill fwd, fwd+bwd, peak memory, stage breakdown) vs a dense layer; needle at long range"),
    Suite("counters", "test_counters.py",
          "decode read counters measured from the gathered indices == formula at every step; paper Table 4"),
]}


def path_of(suite: Suite) -> Path:
    return HERE / suite.module
