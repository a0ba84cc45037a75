"""kernels.decode_layer.LayerDecodeStep (the whole layer's decode step as device operations of
fixed shapes) gives what NSAAttention.decode gives on the torch route, step after step, across
compressed-span completions, from a prefilled and from an empty cache; and NSAAttention.decode on
the Triton route (which runs a LayerDecodeStep per cache) gives the same, with the same reads and
blocks in its StepInfo."""
import gc
import weakref

import pytest
import torch

from nsa_core import DecodeCache, NSAAttention, routing, tiny
from nsa_core.cuda_graph import capturing
from nsa_core.routing import RoutingPolicy
from nsa_core.module import StepInfo

pytest.importorskip("triton")
from kernels import routes  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFGS = {"mlp": tiny(d_model=32, n_kv_heads=2),
        # φ = mean, a span length that is no power of two
        "mean-l6": tiny(d_model=32, n_kv_heads=2, compress="mean", cmp_len=6, cmp_stride=3)}


def _twins(cfg, seed: int) -> tuple[NSAAttention, NSAAttention]:
    """(a layer decoding on the Triton route, the same weights on the torch route)."""
    torch.manual_seed(seed)
    m = NSAAttention(cfg, RoutingPolicy(decode_backend="triton")).to(DEV)
    ref = NSAAttention(cfg, RoutingPolicy()).to(DEV)
    ref.load_state_dict(m.state_dict())
    return m, ref


@pytest.mark.parametrize("phi", list(CFGS))
@pytest.mark.parametrize("prefill", [0, 21])
def test_layer_step_equals_module_decode(prefill, phi):
    """Step after step, a ``LayerDecodeStep`` run eagerly and ``m.decode`` on the Triton route each give the
    torch route's output, blocks and reads; the module's results are new tensors (held across later steps);
    each cache ends at the torch route's length and compressed slots, none written past the spans. On a
    CPU ``m.decode`` runs the layer step eagerly itself (``LayerDecodeStep.decode``), on the same inputs:
    there the step is run once a token, by ``m.decode``, and every check is made on it; on a GPU
    ``m.decode`` replays it from a CUDA graph, so the eager step runs beside it, on a cache of its own."""
    CFG = CFGS[phi]
    why = routes.triton_unavailable(cfg=CFG, device=DEV, dtype=torch.float32)
    if why:
        pytest.skip(f"Triton decode kernel cannot run here: {why}")
    from kernels.decode_layer import LayerDecodeStep
    m, ref = _twins(CFG, 4)
    steps = 2 * CFG.cmp_len + 3                                    # several spans complete
    x = torch.randn(2, prefill + steps, CFG.d_model, device=DEV)
    eager = DEV == "cuda"                   # a LayerDecodeStep of its own beside m.decode's
    ref_cache, mod_cache, *eager_cache = (DecodeCache(CFG, 2, prefill + steps, device=DEV)
                                          for _ in range(3 if eager else 2))
    with torch.no_grad():
        if prefill:
            for c in (ref_cache, mod_cache, *eager_cache):
                m(x[:, :prefill], cache=c)
        step = LayerDecodeStep(m, eager_cache[0]) if eager else None
        kept = []                           # the module's results, held across later steps
        for t in range(prefill, prefill + steps):
            with routing.capture() as log:
                want, info = ref.decode(x[:, t:t + 1], ref_cache)
            assert log.backends("decode") == {br: ["torch"] for br in ("cmp", "sel", "win", "mix")}
            if eager:
                got = step(x[:, t:t + 1])
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"t={t}")
                assert torch.equal(step.last.idx.long(), info.idx), f"t={t}: selected blocks differ"
            with routing.capture() as log:
                got_m, info_m = m.decode(x[:, t:t + 1], mod_cache)
            assert log.backends("decode") == {br: ["triton"] for br in ("cmp", "sel", "win", "step")}
            torch.testing.assert_close(got_m, want, rtol=1e-5, atol=1e-5, msg=f"t={t} (module, Triton route)")
            assert torch.equal(info_m.idx, info.idx), f"t={t}: the module's selected blocks differ"
            assert all(torch.equal(info_m.reads[br], info.reads[br]) for br in info.reads), f"t={t}: reads differ"
            kept.append(((got_m, info_m.idx, *info_m.reads.values()), (want, info.idx, *info.reads.values())))
    for i, (held, ref_held) in enumerate(kept):     # not buffers that a later step overwrote
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(held, ref_held)), f"step {i} changed"
    if eager:                               # on a GPU the module's route replayed the step from a CUDA graph
        assert mod_cache.kernel_state[(routing.TRITON, "layer")][1]._graph is not None
    n = CFG.n_cmp_total(prefill + steps)
    for cache in (mod_cache, *eager_cache):
        assert cache.length == ref_cache.length and int(cache.pos[0]) == prefill + steps - 1
        torch.testing.assert_close(cache.k_cmp[:, :n], ref_cache.k_cmp[:, :n], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cache.v_cmp[:, :n], ref_cache.v_cmp[:, :n], rtol=1e-6, atol=1e-6)
        assert torch.isnan(cache.k_cmp[:, n:]).all(), "a compressed slot past the spans was written"


def test_layer_step_plans_for_the_tokens_held_and_records_for_the_capacity():
    """On a cache with room to grow, ``m.decode`` runs the attention step planned for the next power of two of
    tokens (``kernels.decode.horizon``), not for the capacity, and takes the next plan as the position passes it
    (here from 512 to 1024 tokens of 1100): outputs, blocks and reads equal the torch route's on both sides. On a
    GPU a caller's CUDA graph then records the step planned for the capacity (made, and its kernels compiled,
    while the graph records) and its replays decode the following tokens as the torch route does."""
    CFG = CFGS["mlp"]
    why = routes.triton_unavailable(cfg=CFG, device=DEV, dtype=torch.float32)
    if why:
        pytest.skip(f"Triton decode kernel cannot run here: {why}")
    from kernels import decode
    m, ref = _twins(CFG, 9)
    cap, start, steps = 1100, 509, 5
    assert [decode.horizon(CFG, t, cap) for t in (start, 511, 512)] == [512, 512, 1024]
    replays = 3 if DEV == "cuda" else 0
    x = torch.randn(2, start + steps + replays, CFG.d_model, device=DEV)
    cache, ref_cache = (DecodeCache(CFG, 2, cap, device=DEV) for _ in range(2))

    def check(got, info, t):
        want, winfo = ref.decode(x[:, t:t + 1], ref_cache)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"t={t}")
        assert torch.equal(info.idx, winfo.idx), f"t={t}: selected blocks differ"
        assert all(torch.equal(info.reads[br], winfo.reads[br]) for br in winfo.reads), f"t={t}: reads differ"

    with torch.no_grad():
        for mod, c in ((m, cache), (ref, ref_cache)):
            mod(x[:, :start], cache=c)
        for t in range(start, start + steps):
            check(*m.decode(x[:, t:t + 1], cache), t)
        step = cache.kernel_state[(routing.TRITON, "layer")][1]
        assert sorted(step._steps) == [512, 1024], f"plans made: {sorted(step._steps)}"
        assert step.attention(start).plan.nbp < step.attention(start, whole=True).plan.nbp
        if not replays:
            return
        graph, static = torch.cuda.CUDAGraph(), x[:, start + steps:start + steps + 1].clone()
        with capturing(graph):
            out, info = m.decode(static, cache)
        assert cap in step._steps, "the caller's graph did not record the step planned for the capacity"
        for t in range(start + steps, start + steps + replays):
            static.copy_(x[:, t:t + 1])
            graph.replay()
            check(out, info, t)


def test_back_to_back_decodes_queued_past_the_ring_keep_every_output():
    """``NSAAttention.decode`` replays hand x and a fresh output to the graph through a ring of pinned
    addresses (``kernels.decode_layer.RING``). Calls queued behind a sleeping GPU, more than the ring
    holds, each with a temporary x freed at once and its memory filled with NaN by later work: every
    output kept equals the torch route's row for its token (the host waited for slots, never wrote one the
    GPU had not taken; no x read after it was reused)."""
    if DEV != "cuda":
        pytest.skip("the route replays a CUDA graph only on a CUDA GPU")
    from kernels.decode_layer import RING
    CFG = CFGS["mlp"]
    m, ref = _twins(CFG, 8)
    steps = 2 * RING + 3
    x = torch.randn(2, steps, CFG.d_model, device=DEV)
    cache, ref_cache = (DecodeCache(CFG, 2, steps, device=DEV) for _ in range(2))
    kept = []
    with torch.no_grad():
        kept.append(m.decode(x[:, 0:1].clone(), cache))       # captures the step
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)                         # ~0.1 s: the host runs far ahead
        for t in range(1, steps):
            kept.append(m.decode(x[:, t:t + 1].clone(), cache))   # x: a temporary, freed on return
            torch.full((2, 1, CFG.d_model), float("nan"), device=DEV)   # likely in x's memory, queued after
        torch.cuda.synchronize()
        for t in range(steps):
            want, info = ref.decode(x[:, t:t + 1], ref_cache)
            got, got_info = kept[t]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"t={t}")
            assert torch.equal(got_info.idx, info.idx), f"t={t}: selected blocks differ"
            assert all(torch.equal(got_info.reads[br], info.reads[br]) for br in info.reads), f"t={t}: reads differ"
    step = cache.kernel_state[(routing.TRITON, "layer")][1]
    assert step._graph is not None and step._calls == steps + 1     # (+1: the hand-over's warm-up at capture)


def test_first_capture_hands_over_after_its_counters_are_zeroed(monkeypatch):
    """A step's first capture makes its device counters (zeroed on the current stream) and then runs the
    hand-over launches once on its side stream. Found on an H200 (an illegal address in the counters suite,
    3 of 5 quick runs): the side stream did not wait for the zeroing, and a take that read a stale count
    (memory a freed step's counters had held) took an unwritten slot's address. Here the counters' memory
    holds a stale 7 and their zeroing is queued behind ~50 ms of sleep: the first decode must still equal
    the torch route's."""
    if DEV != "cuda":
        pytest.skip("the route replays a CUDA graph only on a CUDA GPU")
    from kernels import decode_layer
    real_hand_over, real_zeros = decode_layer.LayerDecodeStep._hand_over, torch.zeros

    def stale_then_late(*shape, device=None, **kw):
        if device is None or torch.device(device).type != "cuda":
            return real_zeros(*shape, device=device, **kw)
        t = torch.full(shape, 7, device=device, **kw)
        torch.cuda.current_stream(t.device).synchronize()        # 7s, there before the side stream's take
        torch.cuda._sleep(100_000_000)
        return t.zero_()                                          # queued behind the sleep

    def hand_over(self, device):
        monkeypatch.setattr(torch, "zeros", stale_then_late)
        try:
            return real_hand_over(self, device)
        finally:
            monkeypatch.setattr(torch, "zeros", real_zeros)
    CFG = CFGS["mlp"]
    m, ref = _twins(CFG, 9)
    x = torch.randn(2, 1, CFG.d_model, device=DEV)
    cache, ref_cache, first = (DecodeCache(CFG, 2, 4, device=DEV) for _ in range(3))
    with torch.no_grad():
        # a first step compiles the kernels (on a cold cache, seconds of host time in which the sleep would end)
        m.decode(x, first)
        torch.cuda.synchronize()
        monkeypatch.setattr(decode_layer.LayerDecodeStep, "_hand_over", hand_over)
        got, _ = m.decode(x, cache)                               # another cache: a step of its own
        want, _ = ref.decode(x, ref_cache)
        torch.cuda.synchronize()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_module_decode_captures_again_where_a_parameter_was_replaced():
    """The Triton route replays a CUDA graph that reads the module's weights where they lived at
    capture: a parameter replaced by a new tensor (not updated in place), or whose storage moved, must
    make the next decode capture again, or it would read the old tensor (here kept and overwritten with NaN, as freed
    memory may be). Output vs the torch route, same weights."""
    if DEV != "cuda":
        pytest.skip("the route replays a CUDA graph only on a CUDA GPU")
    CFG = CFGS["mlp"]
    m, ref = _twins(CFG, 6)
    x = torch.randn(2, 8, CFG.d_model, device=DEV)
    cache, ref_cache = (DecodeCache(CFG, 2, 8, device=DEV) for _ in range(2))
    with torch.no_grad():
        for t in range(8):
            if t == 4:                      # o_proj's and the gate's fc1 weights replaced by new tensors
                for lin, ref_lin in ((m.o_proj, ref.o_proj), (m.gate.fc1, ref.gate.fc1)):
                    old, new = lin.weight, torch.randn_like(lin.weight)
                    lin.weight = torch.nn.Parameter(new.clone())
                    ref_lin.weight.copy_(new)
                    old.fill_(float("nan"))
            if t == 6:                      # the gate's fc2 weight moved to new storage (as .to() does): no registration
                old, new = m.gate.fc2.weight.data, torch.randn_like(m.gate.fc2.weight)
                m.gate.fc2.weight.data = new.clone()
                ref.gate.fc2.weight.copy_(new)
                old.fill_(float("nan"))
            with routing.capture() as log:
                got, _ = m.decode(x[:, t:t + 1], cache)
            assert log.backends("decode")["step"] == ["triton"], log.backends("decode")
            want, _ = ref.decode(x[:, t:t + 1], ref_cache)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"t={t}")
    assert cache.kernel_state[(routing.TRITON, "layer")][1]._graph is not None


def test_step_info_packed_is_cut_when_first_asked_for():
    """A replayed step hands its reads and blocks over packed: made into views on first access, once."""
    made, t = [], torch.arange(2 * 3 * 7).view(2, 3, 7)
    info = StepInfo.packed(lambda: made.append(1) or t, ["cmp", "sel", "win"])
    assert made == []
    assert torch.equal(info.reads["sel"], t[..., 1]) and torch.equal(info.idx, t[..., 3:]) and made == [1]
    assert list(info.reads) == ["cmp", "sel", "win"] and info.idx.shape == (2, 3, 4) and made == [1]
    assert torch.equal(StepInfo({"win": t[..., 0]}, None).reads["win"], t[..., 0])


@pytest.mark.parametrize("batch", [40])
def test_phi_at_a_batch_past_one_tile_of_rows(batch):
    """φ and the gate in the decode step over B·G = 80 rows / B = 40 (more than the 64 of the paper
    config at B=16, and no power of two): the slot a step completes equals the module's φ over that
    span, and the gate the module's gate, every row."""
    from kernels.decode_layer import LayerDecodeStep
    CFG = CFGS["mlp"]
    why = routes.triton_unavailable(cfg=CFG, device=DEV, dtype=torch.float32)
    if why:
        pytest.skip(f"Triton decode kernel cannot run here: {why}")
    torch.manual_seed(5)
    m = NSAAttention(CFG, RoutingPolicy(decode_backend="triton")).to(DEV)
    t = 2 * CFG.cmp_stride + CFG.cmp_len - 1                       # token t completes a span
    x = torch.randn(batch, t + 1, CFG.d_model, device=DEV)
    cache = DecodeCache(CFG, batch, t + 1, device=DEV)
    with torch.no_grad():
        m(x[:, :t], cache=cache)
        step = LayerDecodeStep(m, cache)
        step(x[:, t:t + 1])
        torch.testing.assert_close(step.g, m.gates(x[:, t:t + 1])[:, 0], rtol=1e-5, atol=1e-5)
        slot = (t + 1 - CFG.cmp_len) // CFG.cmp_stride
        span = slice(t + 1 - CFG.cmp_len, t + 1)
        for got, phi, raw in ((cache.k_cmp, m.cmp_k, cache.k), (cache.v_cmp, m.cmp_v, cache.v)):
            torch.testing.assert_close(got[:, slot:slot + 1], phi(raw[:, span]), rtol=1e-5, atol=1e-5)


def test_position_stays_on_the_last_row():
    """The step's position update (``_advance_kernel``) and ``seek`` (``_seek_kernel``) at and past
    the cache's last row (max_len 7): the position stays on row 6 (a step replayed from a caller's
    CUDA graph on a full cache rewrites that row rather than writing past the buffers), and a step
    on row 6 after the row was written sets the overflow flag, which a seek clears."""
    why = routes.triton_unavailable(cfg=CFGS["mlp"], device=DEV, dtype=torch.float32)
    if why:
        pytest.skip(f"Triton decode kernel cannot run here: {why}")
    from kernels.decode_layer import _advance_kernel, _seek_kernel
    i32 = dict(dtype=torch.int32, device=DEV)
    nxt, pos, over = torch.full((3,), 5, **i32), torch.full((3,), 4, **i32), torch.zeros(1, **i32)
    seen = []

    def advance():
        _advance_kernel[(1,)](nxt, pos, over, 3, 7, BB=4)
        seen.append((nxt.tolist(), pos.tolist(), over.item()))

    def seek(t):
        _seek_kernel[(1,)](nxt, pos, over, t, 3, 7, BB=4)
        seen.append((nxt.tolist(), pos.tolist(), over.item()))

    advance(), advance(), advance()          # rows 5, 6 (the last), then 6 again: overflow
    seek(6), advance()                       # back to row 6: written once, no overflow
    seek(7), advance()                       # a seek to a full cache: the next step overflows
    seek(3)
    assert seen == [([6] * 3, [5] * 3, 0), ([6] * 3, [6] * 3, 0), ([6] * 3, [6] * 3, 1),
                    ([6] * 3, [5] * 3, 0), ([6] * 3, [6] * 3, 0),
                    ([6] * 3, [6] * 3, 0), ([6] * 3, [6] * 3, 1),
                    ([3] * 3, [2] * 3, 0)]


def test_module_decode_picks_up_a_host_route_step():
    """The Triton route after a step on the host route (``only=``, which appends through
    ``DecodeCache.append``) on the same cache: the layer step seeks to the cache's length and goes
    on from there, step after step, vs the torch route; once the host route has filled the cache,
    the step is refused and its position stays on the last row."""
    CFG = CFGS["mlp"]
    why = routes.triton_unavailable(cfg=CFG, device=DEV, dtype=torch.float32)
    if why:
        pytest.skip(f"Triton decode kernel cannot run here: {why}")
    m, ref = _twins(CFG, 8)
    T = 12
    x = torch.randn(2, T, CFG.d_model, device=DEV)
    cache, ref_cache = (DecodeCache(CFG, 2, T, device=DEV) for _ in range(2))
    with torch.no_grad():
        for mod, c in ((m, cache), (ref, ref_cache)):
            mod(x[:, :5], cache=c)
        for t in range(5, T):
            want, winfo = ref.decode(x[:, t:t + 1], ref_cache)
            if t in (7, 8, T - 1):           # the host route, then the layer step again; the host route fills it
                got, info = m.decode(x[:, t:t + 1], cache, only="win")
                torch.testing.assert_close(info.reads["win"], winfo.reads["win"])
                continue
            got, info = m.decode(x[:, t:t + 1], cache)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"t={t}")
            assert torch.equal(info.idx, winfo.idx), f"t={t}: selected blocks differ"
        with pytest.raises(ValueError, match="DecodeCache full"):       # the step catches up with a full cache
            m.decode(x[:, -1:], cache)
    step = cache.kernel_state[(routing.TRITON, "layer")][1]
    assert cache.length == step.length == T and int(cache.pos[0]) == T - 1
    assert int(step.next_t[0]) == T - 1 and int(cache.overflow[0]) == 0, "the step's position left the last row"
    torch.testing.assert_close(cache.k, ref_cache.k, rtol=1e-6, atol=1e-6)


def test_device_owned_cache_reads_its_length_from_the_device():
    cache = DecodeCache(CFGS["mlp"], 2, 12, device=DEV)
    cache.length = 3
    cache.device_owned = True
    cache.pos.fill_(9)
    assert cache.length == 10
    cache.advanced()                       # the device counted it: the host adds nothing
    assert cache.length == 10
    cache.overflow.fill_(1)
    with pytest.raises(ValueError, match="DecodeCache full: a decode step replayed from a CUDA graph"):
        cache.length


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")        # the refused capture's
def test_module_decode_in_a_callers_cuda_graph():
    """``m.decode`` captured inside the caller's own CUDA graph (as a whole-model decode graph
    does): without a warm-up call it is refused with one clear error, as are the torch route and a
    branch alone (which keep the position on the host); after one, each replay decodes the next
    token (vs the torch route, outputs, blocks and reads), the cache's length follows the replays,
    an eager call goes on from where the replays left off and the replays from where it left off,
    host-route calls on the cache are refused, and once replays have filled the cache an eager call
    is refused without moving the position, and a replay rewrites only the last row and makes the
    next length read raise."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs need a CUDA GPU")
    CFG = CFGS["mlp"]
    m, ref = _twins(CFG, 7)
    prefill, steps = 5, 2 * CFG.cmp_len + 3
    T = prefill + steps
    x = torch.randn(2, T, CFG.d_model, device=DEV)
    cache, ref_cache = (DecodeCache(CFG, 2, T, device=DEV) for _ in range(2))
    static = x[:, prefill:prefill + 1].clone()
    with torch.no_grad():
        for mod, c in ((m, cache), (ref, ref_cache)):
            mod(x[:, :prefill], cache=c)
        with pytest.raises(ValueError, match="call it once on this cache outside the capture first"):
            with capturing(torch.cuda.CUDAGraph()):
                m.decode(static, cache)
        assert cache.length == prefill and not cache.device_owned
        for mod, c, only in ((ref, ref_cache, None), (m, cache, "sel")):     # the torch route; a branch alone
            with pytest.raises(ValueError, match="needs the whole-layer Triton step"):
                with capturing(torch.cuda.CUDAGraph()):
                    mod.decode(static, c, only=only)
        assert ref_cache.length == cache.length == prefill

        def check(got, info, t):
            want, winfo = ref.decode(x[:, t:t + 1], ref_cache)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"t={t}")
            assert torch.equal(info.idx, winfo.idx), f"t={t}: selected blocks differ"
            assert all(torch.equal(info.reads[br], winfo.reads[br]) for br in winfo.reads), f"t={t}: reads differ"

        check(*m.decode(x[:, prefill:prefill + 1], cache), prefill)          # the warm-up call
        graph = torch.cuda.CUDAGraph()
        with routing.capture() as log, capturing(graph):
            out, info = m.decode(static, cache)
        assert not log.counts, f"recording was counted as running: {log.summary()}"
        assert cache.device_owned and cache.length == prefill + 1, "the capture moved the cache"
        for t in range(prefill + 1, T):
            if t == T - 3:                     # an eager call goes on from the replays' position, the replays from its
                check(*m.decode(x[:, t:t + 1], cache), t)
            else:
                static.copy_(x[:, t:t + 1])
                graph.replay()
                check(out, info, t)
            assert cache.length == t + 1
            if t == T - 2:                     # the host route would write where the graph does not look
                with pytest.raises(ValueError, match="kept on the GPU by a decode step recorded into a CUDA graph"):
                    m.decode(x[:, t:t + 1], cache, only="win")
        with pytest.raises(ValueError, match="DecodeCache full"):     # replays filled it: refused, nothing moved
            m.decode(x[:, -1:], cache)
        assert cache.length == T and int(cache.kernel_state[(routing.TRITON, "layer")][1].next_t[0]) == T - 1
        held = [b.clone() for b in (cache.k, cache.v, cache.k_cmp, cache.v_cmp)]
        graph.replay()                        # on the full cache
        torch.cuda.synchronize()
        for before, now in zip(held, (cache.k, cache.v)):
            assert torch.equal(before[:, :-1], now[:, :-1]), "a replay on a full cache wrote another row"
        n = CFG.n_cmp_total(T - 1)             # the slots complete before the last row (which may complete one)
        for before, now in zip(held[2:], (cache.k_cmp, cache.v_cmp)):
            assert torch.equal(before[:, :n], now[:, :n]), "a replay on a full cache wrote another compressed slot"
            assert now[:, CFG.n_cmp_total(T):].isnan().all(), "a replay on a full cache wrote past the spans"
        with pytest.raises(ValueError, match="ran past max_len"):
            cache.length


@pytest.mark.parametrize("only", [None, "sel"], ids=["layer-step", "branch-step"])
def test_a_dropped_cache_is_freed_at_once(only):
    """A cache the Triton route decoded on keeps its step (plan, workspace and, on a GPU, the layer step's
    CUDA graph) in ``kernel_state``; the step holds the cache weakly, so that dropping the cache frees both
    at once, with the collector off: no reference cycle is left for Python's collector to free at some
    later allocation, which could fall in the middle of a caller's CUDA-graph capture and invalidate it
    (``nsa_core.cuda_graph``)."""
    CFG = CFGS["mlp"]
    why = routes.triton_unavailable(cfg=CFG, device=DEV, dtype=torch.float32)
    if why:
        pytest.skip(f"Triton decode kernel cannot run here: {why}")
    m, _ = _twins(CFG, 5)
    x = torch.randn(2, 3, CFG.d_model, device=DEV)
    cache = DecodeCache(CFG, 2, 3, device=DEV)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            for t in range(2):
                m.decode(x[:, t:t + 1], cache, only=only)
        steps = [v[1] if isinstance(v, tuple) else v for v in cache.kernel_state.values()]
        assert steps, "the Triton route kept no step on the cache: nothing was tested"
        kept = [weakref.ref(o) for o in (cache, *steps)]
        del steps, cache
        alive = [r() for r in kept if r() is not None]
        assert not alive, f"still alive after the cache was dropped: {[type(o).__name__ for o in alive]}"
    finally:
        if was_enabled:
            gc.enable()


def test_no_garbage_collection_while_a_step_records():
    """A layer step's capture runs with Python's cyclic collector held off (``nsa_core.cuda_graph``):
    a collection in the middle of a capture may free an unreachable CUDA graph (one held by a reference
    cycle, as a cache and its step were), an unsafe call in CUDA's global capture mode, which invalidates
    the capture (`oneshot`'s counters suite failed so, at random, on an H200). With the collector set to
    run at almost every allocation, collections run, none while a stream records, the earlier cache is
    freed, and the step decodes as the torch route does."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs need a CUDA GPU")
    CFG = CFGS["mlp"]
    m, ref = _twins(CFG, 3)
    x = torch.randn(2, 2, CFG.d_model, device=DEV)

    def decoded_once() -> DecodeCache:
        cache = DecodeCache(CFG, 2, 2, device=DEV)
        m.decode(x[:, :1], cache)              # sets up and captures a step, kept in the cache
        return cache

    collections = []                           # per collection: was a stream recording?
    record = lambda phase, _: collections.append(torch.cuda.is_current_stream_capturing()) if phase == "start" else None  # noqa: E731
    thresholds = gc.get_threshold()
    with torch.no_grad():
        earlier = weakref.ref(decoded_once())
        cache, ref_cache = DecodeCache(CFG, 2, 2, device=DEV), DecodeCache(CFG, 2, 2, device=DEV)
        gc.callbacks.append(record)
        gc.set_threshold(1)
        try:
            got, info = m.decode(x[:, :1], cache)     # a new step: set up, captured, replayed
        finally:
            gc.set_threshold(*thresholds)
            gc.callbacks.remove(record)
        want, winfo = ref.decode(x[:, :1], ref_cache)
    assert collections, "no collection ran: the test exercised nothing"
    assert earlier() is None, "the earlier cache and step were never freed"
    assert not any(collections), f"{sum(collections)} of {len(collections)} collections ran during a capture"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(info.idx, winfo.idx)


def _syncs(fn) -> int:
    """How many times fn() made the host wait for the GPU (torch's sync debug mode, as warnings)."""
    import warnings
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return sum("synchronizing CUDA operation" in str(w.message) for w in seen)


def test_module_decode_host_syncs():
    """An eager ``m.decode`` on a GPU (after its first call, which captures the step) never makes the
    host wait for the GPU where the host counts the cache's tokens, so a decode loop's launches queue
    ahead of the GPU; on a cache a caller's graph decodes into (``device_owned``) it waits once, to
    read the position before the step (it made four such reads, the last waiting for the step itself)."""
    if DEV != "cuda":
        pytest.skip("host synchronisation with the device exists only on a GPU")
    CFG = CFGS["mlp"]
    m, _ = _twins(CFG, 9)
    T = 12
    x = torch.randn(2, T, CFG.d_model, device=DEV)
    cache = DecodeCache(CFG, 2, T, device=DEV)
    with torch.no_grad():
        m.decode(x[:, :1], cache)                            # sets up and captures the step
        assert _syncs(lambda: [m.decode(x[:, t:t + 1], cache) for t in (1, 2, 3)]) == 0
        static = x[:, 4:5].clone()
        with capturing(torch.cuda.CUDAGraph()):
            m.decode(static, cache)                          # recorded (never replayed): the cache is device_owned
        assert cache.device_owned and cache.length == 4
        assert _syncs(lambda: m.decode(x[:, 4:5], cache)) == 1
        assert _syncs(lambda: m.decode(x[:, 5:6], cache)) == 1
        assert cache.length == 6


def test_decode_graph_bench():
    """``nsa_validate.bench.decode_graph`` (a stack of layers decoded per layer from Python vs as one
    caller's CUDA graph) at a tiny size: both ways give the same outputs, token after token, and
    leave the caches at the same length."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs need a CUDA GPU")
    from nsa_validate.bench.decode_graph import stack_decode
    row = stack_decode(CFGS["mlp"], batch=2, context=40, layers=2, tokens=5, dtype=torch.float32)
    assert row.tokens == 5 and row.max_abs_diff == 0, row
    assert row.lengths == (40 + 2 + 5, 40 + 2 + 5), row
    assert row.eager_ms > 0 and row.graph_ms > 0
