"""CUDA-graph capture that Python's garbage collector cannot invalidate.

``torch.cuda.graph`` captures in CUDA's "global" mode, in which an unsafe CUDA call from the process
while the graph records invalidates the capture: it then fails at whichever later launch notices
("operation failed due to a previous error during capture"), and every capture after it in the
process fails on torch's RNG state. Freeing an earlier CUDA graph is such a call (H200, torch 2.11:
a graph held by an unreachable reference cycle, collected with ``gc.collect()`` between two ops of
another capture, failed it so; a cycle holding tensors, a graph's pool tensors or a stream and event
did not). Python's cyclic collector runs at arbitrary allocations, and a ``DecodeCache`` and the
decode step it kept held each other, so a cache dropped with its step's graph was freed whenever the
collector next ran: in the middle of a later capture, `oneshot`'s counters suite (a layer and a
cache per case) had a layer step's capture invalidated at the scores launch of one case and then
failed 15 cases (H200, with the suites sharing the GPU), where `pytest suites` had passed the same
suite. ``capturing`` keeps the collector off while the graph records (what it would have freed
then is freed at its next run, after); and a step kept by its cache now holds the cache weakly
(``kernels.decode.DecodeStep``), so that a dropped cache and its graph are freed at once, not later
inside someone else's capture.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
    """``torch.cuda.graph(graph, stream=stream)`` with no garbage collection while it records. (No
    collection before it either, which ``torch.cuda.graph`` makes only under
    ``torch.compiler.config.force_cudagraph_gc``, off by default in torch 2.13: ``gc.collect()`` took
    ~85 ms in a process with the suites' imports, ~190k objects tracked, on a CPU machine, and the timing
    helper captures twice a bench.)"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, stream=stream):
            yield
    finally:
        if was_enabled:
            gc.enable()
