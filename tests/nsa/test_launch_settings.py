"""Every launch setting a kernel may fall back to on a GPU with less shared memory computes what
its measured settings compute (run here from each index with ``common.forced_config``), and
``launch_fitting`` moves on only past OutOfResources, remembering what loaded. Runs under the
interpreter without a GPU."""
import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
T, G, h, DK, DV, L, N_SEL, CMP_LEN, CMP_STRIDE = 150, 2, 2, 32, 16, 16, 4, 8, 4


def _kernels():
    from kernels import routes
    why = routes.triton_unavailable(device=DEV, dtype=torch.float32)
    if why:
        pytest.skip(f"Triton kernels cannot run here: {why}")
    from kernels import common, compressed, scoring, selection
    return common, compressed, scoring, selection


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    N = (T - CMP_LEN) // CMP_STRIDE + 1
    return r(T, G * h, DK), r(T, G, DK), r(T, G, DV), r(N, G, DK), r(N, G, DV), r(T, G * h, DV)


def _run_all(common, compressed, scoring, selection, index, dtype):
    q, k, v, kc, vc, do = _inputs(dtype)
    with common.forced_config(index):
        cu = torch.tensor([0, T], dtype=torch.int32, device=DEV)
        cu_c = compressed.cmp_cu_seqlens(cu, CMP_LEN, CMP_STRIDE)
        o, lse = compressed.compressed_attention_fwd(q, kc, vc, CMP_LEN, CMP_STRIDE, cu, cu_c, max_seqlen=T)
        grads_c = compressed.compressed_attention_bwd(do, q, kc, vc, o, lse, CMP_LEN, CMP_STRIDE, cu, cu_c, max_seqlen=T)
        idx = scoring.select_blocks(q, kc, lse, CMP_LEN, CMP_STRIDE, L, N_SEL, cu, cu_c, max_seqlen=T)
        os_, lse_s = selection.selection_attention_fwd(q, k, v, idx, L, cu, max_seqlen=T)
        grads_s = selection.selection_attention_bwd(do, q, k, v, os_, lse_s, idx, L, cu, max_seqlen=T)
    return {"cmp_o": o, "cmp_lse": lse, **{f"cmp_d{n}": x for n, x in zip("qkv", grads_c)},
            "idx": idx, "sel_o": os_, **{f"sel_d{n}": x for n, x in zip("qkv", grads_s)}}


# fp16 takes the 2-byte lists (those of bf16, which the interpreter cannot run), fp32 its own;
# the tolerance covers sums taken in another order (fp32 accumulators, rounded once)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
def test_every_fallback_setting_computes_the_same(dtype, tol):
    mods = _kernels()
    common, compressed, scoring, selection = mods
    size = torch.tensor([], dtype=dtype).element_size()
    longest = max(len(compressed.launch_configs(k, h, DK, DV, size)) for k in ("fwd", "dq", "dkdv"))
    longest = max(longest, len(scoring.launch_configs(h, DK, N_SEL, size)),
                  *(len(selection.launch_configs(k, DK, DV)) for k in ("fwd", "dq", "dkdv")))
    want = _run_all(*mods, 0, dtype)
    assert (want["idx"] >= 0).any()
    for i in range(1, longest):            # an index past a kernel's list runs that list's last
        got = _run_all(*mods, i, dtype)
        assert torch.equal(got["idx"], want["idx"]), f"settings {i}: another block selection"
        for name, x in want.items():
            if name != "idx":
                assert torch.allclose(got[name].float(), x.float(), rtol=10 * tol, atol=tol), (
                    f"settings {i}: {name} differs by {(got[name].float() - x.float()).abs().max():.3g}")


def test_launch_fitting_moves_past_out_of_resources_only():
    common = _kernels()[0]
    tried = []

    def launch(cfg):
        tried.append(cfg["n"])
        if cfg["n"] < 2:
            raise common.OutOfResources(cfg["n"] * 1000, 500, "shared memory")
        return cfg["n"] * 10
    configs = [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 3}]
    from nsa_core import routing
    with routing.capture() as log:
        assert common.launch_fitting("t", (1,), configs, launch) == 20 and tried == [0, 1, 2]
    assert log.ran("kernel", "t@settings2", "triton") == 1              # the fallback is on record
    tried.clear()
    assert common.launch_fitting("t", (1,), configs, launch) == 20 and tried == [2]      # remembered
    with pytest.raises(common.OutOfResources):
        common.launch_fitting("t", (2,), [{"n": 0}, {"n": 1}], launch)                 # none fits
    with pytest.raises(ValueError):
        common.launch_fitting("t", (3,), configs, lambda cfg: (_ for _ in ()).throw(ValueError("bug")))


def test_descriptors_only_for_tensors_tma_can_address():
    """Tensor descriptors (TMA) need 16-byte aligned bases and strides, a contiguous last dimension
    and a non-empty tensor; anything else takes the pointer path."""
    common = _kernels()[0]
    if not common.descriptors_usable(torch.zeros(8, 2, 16, device=DEV, dtype=torch.float16)):
        pytest.skip("tensor descriptors are not usable here (no sm90 GPU, or the interpreter's descriptor "
                    "loads failed their probe): the kernels take their pointer paths")
    x = torch.zeros(8, 2, 16, device=DEV, dtype=torch.float16)
    assert not common.descriptors_usable(torch.zeros(8, 2, 12, device=DEV, dtype=torch.float16))   # rows of 24 bytes
    assert not common.descriptors_usable(torch.zeros(64, device=DEV, dtype=torch.float16)[1:33].view(8, 2, 2))
    assert not common.descriptors_usable(x.transpose(0, 2))             # last dimension strided
    assert not common.descriptors_usable(torch.zeros(0, 2, 16, device=DEV, dtype=torch.float16))
    assert common.descriptors_usable(x, x[:, 1:])                       # a head slice: aligned
