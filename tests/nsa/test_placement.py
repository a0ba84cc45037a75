"""NSAAttention on a GPU that is not the current one (``.to("cuda:1")`` while the process's current
device is 0, as pipeline-parallel code places layers): prefill forward and backward and decode
(the Triton route, replayed from a CUDA graph) run every kernel on the layer's own GPU and give
what the same layer gives on the current GPU. Needs two CUDA GPUs."""
import pytest
import torch

from nsa_core import DecodeCache, NSAAttention, routing, tiny
from nsa_core.routing import RoutingPolicy

pytest.importorskip("triton")
import kernels  # noqa: E402,F401  (registers the Triton routes)

CFG = tiny(d_model=32, n_kv_heads=2)
EVERY_STAGE_ON_TRITON = RoutingPolicy.triton_everywhere(decode_backend="triton")


def _run(m, x, steps: int):
    """Prefill x[:, :-steps] (forward, backward) into a cache, then decode the last ``steps`` tokens ->
    (y, dx, decoded outputs [B, steps, D], the prefill's and decode's backends)."""
    dev = next(m.parameters()).device
    x = x.to(dev).requires_grad_(True)
    P = x.shape[1] - steps
    cache = DecodeCache(CFG, x.shape[0], x.shape[1], device=dev)
    with routing.capture() as log:
        y = m(x[:, :P], cache=cache)
        y.square().sum().backward()
        with torch.no_grad():
            outs = torch.cat([m.decode(x[:, t:t + 1].detach(), cache)[0] for t in range(P, x.shape[1])], 1)
    return y.detach(), x.grad, outs, (log.backends("prefill"), log.backends("decode"))


def test_layer_on_a_gpu_other_than_the_current_one():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    torch.cuda.set_device(0)
    torch.manual_seed(8)
    m1 = NSAAttention(CFG, EVERY_STAGE_ON_TRITON).to("cuda:1")
    m0 = NSAAttention(CFG, EVERY_STAGE_ON_TRITON).to("cuda:0")
    m0.load_state_dict(m1.state_dict())
    x = torch.randn(2, 40, CFG.d_model)
    want = _run(m0, x, steps=6)            # on the current GPU first: its decode captures a graph there first
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = _run(m1, x, steps=6)
        torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert got[3] == want[3] and all(b == ["triton"] for b in got[3][0].values()), got[3]
    ran = {(e.device_index, e.name) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert {d for d, _ in ran} == {1}, sorted(ran)[:8]
    assert any("kernel" in n for _, n in ran), "no Triton kernel in the profile"
    for name, a, b in zip(("y", "dx", "decode"), got[:3], want[:3]):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-5, msg=name)
