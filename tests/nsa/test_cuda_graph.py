"""nsa_core.cuda_graph.capturing: Python's cyclic collector is off while a CUDA graph records and
back as it was after, also when the captured code raises. Checked here with ``torch.cuda.graph``
replaced by a recorder, so that the contract holds on machines without a GPU too; on a GPU,
tests/nsa/test_decode_layer.py::test_no_garbage_collection_while_a_step_records checks a real
capture with collections forced at almost every allocation."""
import gc
from contextlib import contextmanager, nullcontext

import pytest
import torch

from nsa_core import cuda_graph


@pytest.fixture
def recorder(monkeypatch):
    """Replaces torch.cuda.graph; returns the list of (graph, stream, collector enabled on entry)."""
    calls = []

    @contextmanager
    def graph(g, stream=None):
        calls.append((g, stream, gc.isenabled()))
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    return calls


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_collector_off_while_recording_and_restored_after(recorder, enabled, raises):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    g, stream, inside = object(), object(), []
    try:
        with pytest.raises(RuntimeError) if raises else nullcontext():
            with cuda_graph.capturing(g, stream=stream):
                inside.append(gc.isenabled())
                if raises:
                    raise RuntimeError("captured code failed")
        after = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert recorder == [(g, stream, False)], "torch.cuda.graph not entered once, on this graph and stream, collector off"
    assert inside == [False], "the collector ran while the graph recorded"
    assert after is enabled, "the collector's state was not restored"
