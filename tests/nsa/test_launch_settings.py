"""Every launch setting a kernel may fall back to on a GPU with less shared memory computes what
its measured settings compute (run here from each index with ``common.forced_config``), and
``launch_fitting`` moves on only past OutOfResources, remembering what loaded. Runs under the
interpreter without a GPU."""
import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
G, h, DK, DV, L, N_SEL, CMP_LEN, CMP_STRIDE = 2, 2, 32, 16, 16, 4, 8, 4
# tokens: past the largest tile of the compressed branch's settings (128 tokens of fp16's forward), with
# a partial last tile in each; the selection stages (scorer, selection forward and backward), whose tiles
# are at most 64 tokens and whose programs go token by token, at fewer: past a 64-token tile, more causal
# blocks than n, a partial last block (5 blocks and 6 tokens), every query selecting block 0 (172 rows:
# a partial last step of every dk/dv ``rows`` setting)
T_CMP, T_SEL = 150, 86
CMP_STAGES = ("cmp_fwd", "cmp_bwd")


def _kernels():
    from kernels import routes
    why = routes.triton_unavailable(device=DEV, dtype=torch.float32)
    if why:
        pytest.skip(f"Triton kernels cannot run here: {why}")
    from kernels import common, compressed, scoring, selection
    return common, compressed, scoring, selection


def _inputs(dtype, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    N = (T - CMP_LEN) // CMP_STRIDE + 1
    return r(T, G * h, DK), r(T, G, DK), r(T, G, DV), r(N, G, DK), r(N, G, DV), r(T, G * h, DV)


def _stages(compressed, scoring, selection, dtype, T):
    """The five kernel stages in order over T tokens, each with a function of the earlier stages'
    outputs (a dict) returning its own."""
    q, k, v, kc, vc, do = _inputs(dtype, T)
    size = q.element_size()
    cu = torch.tensor([0, T], dtype=torch.int32, device=DEV)
    cu_c = compressed.cmp_cu_seqlens(cu, CMP_LEN, CMP_STRIDE)

    def cmp_fwd(w):
        o, lse = compressed.compressed_attention_fwd(q, kc, vc, CMP_LEN, CMP_STRIDE, cu, cu_c, max_seqlen=T)
        return {"cmp_o": o, "cmp_lse": lse}

    def cmp_bwd(w):
        g = compressed.compressed_attention_bwd(do, q, kc, vc, w["cmp_o"], w["cmp_lse"], CMP_LEN, CMP_STRIDE, cu, cu_c,
                                                max_seqlen=T)
        return {f"cmp_d{n}": x for n, x in zip("qkv", g)}

    def scores(w):
        return {"idx": scoring.select_blocks(q, kc, w["cmp_lse"], CMP_LEN, CMP_STRIDE, L, N_SEL, cu, cu_c, max_seqlen=T)}

    def sel_fwd(w):
        o, lse = selection.selection_attention_fwd(q, k, v, w["idx"], L, cu, max_seqlen=T)
        return {"sel_o": o, "sel_lse": lse}

    def sel_bwd(w):
        g = selection.selection_attention_bwd(do, q, k, v, w["sel_o"], w["sel_lse"], w["idx"], L, cu, max_seqlen=T)
        return {f"sel_d{n}": x for n, x in zip("qkv", g)}
    return [("cmp_fwd", cmp_fwd), ("cmp_bwd", cmp_bwd), ("scores", scores), ("sel_fwd", sel_fwd), ("sel_bwd", sel_bwd)]


def _runs_as(config: dict) -> tuple:
    """What of a launch setting changes the computation here: Triton's interpreter drops num_warps
    and num_stages (it runs each program as numpy code), so on a CPU settings that differ only there
    compute alike; on a GPU every key counts."""
    from kernels.interpreter import interpreting
    skip = ("num_warps", "num_stages") if interpreting() else ()
    return tuple(sorted((k, v) for k, v in config.items() if k not in skip))


# fp16 takes the 2-byte lists (those of bf16, which the interpreter cannot run), fp32 its own;
# the tolerance covers sums taken in another order (fp32 accumulators, rounded once)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
def test_every_fallback_setting_computes_the_same(dtype, tol, monkeypatch):
    """Each stage from each of its settings (an index past a kernel's list runs that list's last),
    on the inputs its measured settings' upstream stages made, against its measured settings. The
    lists are those the launchers hand ``launch_fitting`` (recorded from the measured run); an index
    whose settings run as an earlier index's (``_runs_as``) is not run again."""
    common, compressed, scoring, selection = _kernels()
    taken: list[list[dict]] = []              # the settings lists of the stage running, one per launch

    def record_lists(kernel, spec, configs, launch):
        taken.append(configs)
        return common.launch_fitting(kernel, spec, configs, launch)
    for module in (compressed, scoring, selection):
        monkeypatch.setattr(module, "launch_fitting", record_lists)
    # the compressed stages over T_CMP tokens, the selection stages over T_SEL (their upstream
    # compressed forward run there at the measured settings)
    stages = []
    for T, runs, tested in ((T_CMP, CMP_STAGES, CMP_STAGES), (T_SEL, ("cmp_fwd", "scores", "sel_fwd", "sel_bwd"),
                                                               ("scores", "sel_fwd", "sel_bwd"))):
        want: dict = {}
        for stage, run in _stages(compressed, scoring, selection, dtype, T):
            if stage not in runs:
                continue
            taken.clear()
            with common.forced_config(0):
                want.update(run(want))
            if stage in tested:
                stages.append((stage, run, want, list(taken)))
    idx = stages[-1][2]["idx"]
    assert (idx >= 0).any() and (idx < 0).any()      # rows with fewer causal blocks than n (padded) too
    assert idx.max() >= N_SEL                         # and rows choosing n of more
    assert [s[0] for s in stages] == ["cmp_fwd", "cmp_bwd", "scores", "sel_fwd", "sel_bwd"]
    lists = {stage: taken_lists for stage, _, _, taken_lists in stages}
    for stage, run, want, _ in stages:
        done = set()
        for i in range(max(len(c) for c in lists[stage])):
            runs_as = tuple(_runs_as(c[min(i, len(c) - 1)]) for c in lists[stage])
            if runs_as in done:
                continue
            done.add(runs_as)
            if i == 0:
                continue                      # the measured settings: ``want``
            with common.forced_config(i):
                got = run(want)
            for name, x in got.items():
                if name == "idx":
                    assert torch.equal(x, want[name]), f"{stage} settings {i}: another block selection"
                else:
                    assert torch.allclose(x.float(), want[name].float(), rtol=10 * tol, atol=tol), (
                        f"{stage} settings {i}: {name} differs by {(x.float() - want[name].float()).abs().max():.3g}")


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
