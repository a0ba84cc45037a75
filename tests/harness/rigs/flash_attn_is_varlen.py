"""A planted fault (pytest plugin, ``-p tests.harness.rigs.flash_attn_is_varlen``): the ``flash_attn`` backend
wrapper silently calls PyTorch's varlen kernel while the dispatch log still says ``flash_attn``.
Both are correct, so parity passes and the dispatch log is fooled; only the kernel names the GPU
ran can tell, and the fa2 suite must fail on them."""
import pytest


@pytest.fixture(autouse=True)
def _flash_attn_is_really_varlen(monkeypatch):
    from kernels import fa2

    def impostor(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1)):
        return fa2._call("varlen", q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, window_size[0])
    monkeypatch.setattr(fa2, "_flash_attn_func", lambda: impostor)
