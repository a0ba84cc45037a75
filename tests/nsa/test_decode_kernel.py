"""The Triton decode step (kernels/decode.py) against the fp32 oracle's row t: its block selection
equals the oracle's, each branch's output is within the tolerance rule, and its measured reads
equal the formula of docs/nsa.md, at positions around every boundary (t < l, t < w, partial blocks,
more causal blocks than n). Runs under the interpreter without a GPU."""
import pytest
import torch
import triton
import triton.language as tl

from kernels.common import topk_of_runs

from nsa_core import DecodeCache, NSAAttention, reference, routing, tiny
from nsa_core.config import BRANCHES
from nsa_validate.measure.tolerance import compare

# the cache is NaN-poisoned past the prefill: under the interpreter a read of it warns, and fails
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFG = tiny(block_size=16, n_selected=4, window=20)
POSITIONS = [0, CFG.cmp_len - 2, CFG.cmp_len - 1, 17, CFG.window, 47, 80, 99]


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def layer(request):
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[request.param]
    m = NSAAttention(CFG).to(DEV).to(dtype)
    x = torch.randn(2, 100, CFG.d_model, device=DEV).to(dtype)
    return m, x, dtype


def _cache_at(m, x, t, dtype, capacity=None):
    """Cache of ``capacity`` rows (default: x's length) holding tokens 0..t of x (NaN past them), and q of token t."""
    q, k, v = m.project(x[:, :t + 1])
    cache = DecodeCache(CFG, x.shape[0], capacity or x.shape[1], device=DEV, dtype=dtype)
    cache.write_prefill(k, v, m.cmp_k(k), m.cmp_v(v))
    return q[:, t], cache


@pytest.fixture(params=["block-tiles", "two-block-tiles"])
def tiles(request, monkeypatch):
    """Window / selection tiles of one selection block or two (``TWO_BLOCK_TILES``; a GPU picks by B·G)."""
    from kernels import decode
    monkeypatch.setattr(decode, "TWO_BLOCK_TILES", (0, 0) if request.param == "block-tiles" else (0, 10 ** 9))
    return request.param


@pytest.fixture(params=["sums-reshaped", "sums-by-products"])
def sums(request, monkeypatch):
    """The compressed programs' block sums by reshaping p (``SUMS_BY_RESHAPE``, the paper geometry and this
    one) or by products with the overlap matrix (every other geometry)."""
    from kernels import decode
    monkeypatch.setattr(decode, "SUMS_BY_RESHAPE", request.param == "sums-reshaped")
    return request.param


# ``tiles`` and ``sums`` paired, not crossed: they set different launches (the tiles: the window / selection
# partials' BPT and BN; the sums: the compressed partials' SUM_RESHAPE, whose BNC does not depend on the tiles),
# which meet only through the selected blocks, asserted equal to the oracle's either way. So each pairing runs
# every path of both; a cross product ran each one twice on the same inputs
TILES_AND_SUMS = pytest.mark.parametrize("tiles,sums", [("block-tiles", "sums-reshaped"),
                                                        ("two-block-tiles", "sums-by-products")], indirect=True)


def _against_oracle_row(r, q, cache, t, dtype, oracle=None):
    """Step result ``r`` for token t vs the oracle's row: the same blocks (the kernel selected from its own
    compressed logits), each branch within the tolerance rule, reads == formula. Returns the fp32 oracle's
    row and the low-precision one (None in fp32): ``oracle``, to check another step of the same cache
    contents against them, without computing them again."""
    if oracle is None:
        ref = reference.decode_row(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, t, CFG)
        ref_lp = None if dtype == torch.float32 else \
            reference.decode_row(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, t, CFG, idx=ref["idx"], dtype=dtype)
    else:
        ref, ref_lp = oracle
    assert torch.equal(r.idx.long(), ref["idx"]), (r.idx.tolist(), ref["idx"].tolist())
    for br in ("cmp", "sel", "win"):
        res = compare(r.out[br], ref[f"o_{br}"], None if ref_lp is None else ref_lp[f"o_{br}"], dtype=dtype)
        assert res["ok"], (br, res)
        want = CFG.expected_reads(t)[br]
        assert (r.reads[br] == want).all(), (br, r.reads[br].tolist(), want)
    return ref, ref_lp


@TILES_AND_SUMS
@pytest.mark.parametrize("t", POSITIONS)
def test_decode_step_matches_oracle_row_and_reads_formula(t, layer, tiles, sums):
    """Token t's step, at every boundary position, both ways a step gets the token, against the one oracle
    row of the same cache contents: ``decode_attention`` on a cache holding token t, with a gate (the gate
    mix too); then ``DecodeStep`` given the new token's k/v (token t not yet in the cache, NaN there), as
    the bench and graph-captured decoding run it: the compressed launch appends the token, the step after
    it reads it. Each: the oracle's blocks, outputs and reads; the append: the token written. (On Hopper
    the window programs then take token t from the new token's buffer without waiting,
    ``kernels.decode.WIN_NOWAIT``; here the test below runs that path.)"""
    from kernels.decode import DecodeStep, decode_attention
    m, x, dtype = layer
    with torch.no_grad():
        q, cache = _cache_at(m, x, t, dtype)
        pos = torch.full((2,), t, dtype=torch.int32, device=DEV)
        gate = torch.rand(2, CFG.n_heads, 3, device=DEV).to(dtype)
        with routing.capture() as log:
            r = decode_attention(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, pos, CFG, gate=gate)
        assert all(log.ran("decode", br, "triton") for br in ("cmp", "sel", "win"))
        ref, ref_lp = oracle = _against_oracle_row(r, q, cache, t, dtype)
        mixed = sum(gate[..., i:i + 1].float() * ref[f"o_{br}"] for i, br in enumerate(("cmp", "sel", "win")))
        mixed_lp = None if ref_lp is None else sum(gate[..., i:i + 1] * ref_lp[f"o_{br}"]
                                                   for i, br in enumerate(("cmp", "sel", "win")))
        assert compare(r.mixed, mixed, mixed_lp, dtype=dtype)["ok"]
        # the same token appended by the step: the cache ends as it was, so the oracle's row is the same
        k_t, v_t = cache.k[:, t].clone(), cache.v[:, t].clone()
        cache.k[:, t], cache.v[:, t] = float("nan"), float("nan")
        with routing.capture() as log:
            step = DecodeStep(CFG, cache)
            r = step(q, k_t, v_t, pos=pos)
        assert all(log.ran("decode", br, "triton") for br in ("cmp", "sel", "win"))
        assert step.plan.sums_by_reshape == (sums == "sums-reshaped")
        assert torch.equal(cache.k[:, t], k_t) and torch.equal(cache.v[:, t], v_t)
        _against_oracle_row(r, q, cache, t, dtype, oracle)


# Every tiling and trigger mode in fp32; fp16 (its new-token key converted to fp32, the one dtype-dependent step this
# path adds) in one of them: the test above runs the rest of the step in both dtypes. The full cross product of
# dtypes cost 31 s more of `make test`
TRIGGERS = {2: "early-trigger", 3: "late-trigger"}
WINDOW_CASES = [pytest.param(dt, tiles, gdc, id=f"{dt}-{tiles}-{TRIGGERS[gdc]}")
                for dt, tiles, gdc in [*(("fp32", tiles, gdc) for tiles in ("block-tiles", "two-block-tiles")
                                         for gdc in TRIGGERS), ("fp16", "two-block-tiles", 2)]]


@pytest.mark.skipif(DEV == "cuda", reason="a GPU with programmatic dependent launch runs this path in the test above")
@pytest.mark.parametrize("layer,tiles,gdc", WINDOW_CASES, indirect=["layer", "tiles"])
@pytest.mark.parametrize("t", [0, CFG.cmp_len - 1, CFG.window, 99])
def test_window_programs_that_do_not_wait_take_the_new_token_from_its_buffer(t, gdc, layer, tiles, monkeypatch):
    """The step as Hopper runs it (``WIN_NOWAIT``: the window programs start without waiting and take token t's
    k/v from the new token's buffer, addressed from the cache's pointer), here under the interpreter: the
    programmatic-dependent-launch mode forced on and its waits made no-ops (the interpreter runs the launches
    one after another). The oracle's blocks, outputs and reads, as in the test above. Then, since here the
    cache already holds token t when the window programs run, the same step with the window + selection launch
    given another new-token buffer: the window's output moves (its token t is the buffer's), the other
    branches' do not (the selection's token t is the cache's, the compressed launch appended it). At the early
    trigger and B·G 4 the step makes no top-n launch: its selection programs rank (``TOPN_IN_SELECTION_ROWS``),
    several a row (the plan made for 64 SMs), each taking its own slots of the blocks it ranked."""
    import triton.language as tl
    from kernels import decode
    from kernels.decode import DecodeStep
    if gdc == 2:
        monkeypatch.setattr(decode, "sm_count", lambda device: 64)
    monkeypatch.setattr(decode, "_gdc", lambda device, rows: gdc)
    monkeypatch.setattr(tl.extra.cuda, "gdc_wait", lambda *a, **k: None)
    monkeypatch.setattr(tl.extra.cuda, "gdc_launch_dependents", lambda *a, **k: None)
    seen, other, real, ranked = [], [], decode._winsel_partial_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(q, k, v, kn, vn, *args, **kwargs):
                seen.append(kwargs["WIN_NOWAIT"])
                ranked.append(kwargs.get("TOPN", False))
                if other:
                    kn, vn = 2 * kn + 1, 2 * vn + 1
                return real[grid](q, k, v, kn, vn, *args, **kwargs)
            return launch
    monkeypatch.setattr(decode, "_winsel_partial_kernel", Spy())
    test_decode_step_matches_oracle_row_and_reads_formula(t, layer, tiles, "sums-reshaped")
    assert seen == [False, True]          # decode_attention on a cache holding t waits; DecodeStep's append: not
    m, x, dtype = layer
    with torch.no_grad():
        q, cache = _cache_at(m, x, t, dtype)
        pos = torch.full((2,), t, dtype=torch.int32, device=DEV)
        k_t, v_t = cache.k[:, t].clone(), cache.v[:, t].clone()
        step = DecodeStep(CFG, cache)
        same = {br: o.clone() for br, o in step(q, k_t, v_t, pos=pos).out.items()}
        other.append(True)
        moved = step(q, k_t, v_t, pos=pos).out
    assert seen[2:] == [True, True]
    # at few rows under the early trigger (here B·G = 4) the selection programs ranked the blocks: no top-n launch
    assert ranked == [gdc == 2] * 4
    assert not torch.equal(moved["win"], same["win"])
    assert torch.equal(moved["sel"], same["sel"]) and torch.equal(moved["cmp"], same["cmp"])


@pytest.mark.parametrize("d_k, d_v, cmp_tile", [(24, 8, 64), (48, 16, 32), (16, 8, 16)],
                         ids=["dk24-split16+16-tile64", "dk48-split32+16-tile32", "dk16-tile16"])
def test_split_head_dim_and_compressed_tile_sizes(d_k, d_v, cmp_tile, monkeypatch):
    """d_k taken as two power-of-two parts (the paper's 192 = 128 + 64) and compressed tiles other
    than the window/selection tile: the oracle's blocks, outputs and the formula's reads."""
    from kernels import decode
    monkeypatch.setattr(decode, "CMP_TILE", cmp_tile)
    cfg = tiny(block_size=16, n_selected=4, window=20, d_k=d_k, d_v=d_v)
    torch.manual_seed(5)
    m = NSAAttention(cfg).to(DEV)
    x = torch.randn(2, 100, cfg.d_model, device=DEV)
    p = decode.plan(cfg, 2, 100, cfg.n_cmp(99), DEV, torch.float32)
    assert (p.BDA + p.BDB >= d_k) and (p.BDB > 0) == (d_k not in (16, 32, 64)) and p.BNC == cmp_tile
    with torch.no_grad():
        for t in (47, 99):
            q, k, v = m.project(x[:, :t + 1])
            cache = DecodeCache(cfg, 2, 100, device=DEV)
            cache.write_prefill(k, v, m.cmp_k(k), m.cmp_v(v))
            pos = torch.full((2,), t, dtype=torch.int32, device=DEV)
            r = decode.decode_attention(q[:, t], cache.k, cache.v, cache.k_cmp, cache.v_cmp, pos, cfg, p=p)
            ref = reference.decode_row(q[:, t], cache.k, cache.v, cache.k_cmp, cache.v_cmp, t, cfg)
            assert torch.equal(r.idx.long(), ref["idx"]), t
            for br in ("cmp", "sel", "win"):
                assert compare(r.out[br], ref[f"o_{br}"], None, dtype=torch.float32)["ok"], (t, br)
                assert (r.reads[br] == cfg.expected_reads(t)[br]).all(), (t, br)


@pytest.mark.parametrize("gdc,rows,top_n_launched", [(0, 4, True), (2, 4, False), (2, 8, False), (2, 16, True),
                                                     (3, 64, True)])
def test_the_top_n_launch_is_left_out_only_at_few_rows_under_the_early_trigger(gdc, rows, top_n_launched,
                                                                                monkeypatch):
    """``step_launches``: every launch of ``LAUNCHES``, but the top-n where the plan has its selection programs rank
    (the early trigger, B·G up to TOPN_IN_SELECTION_ROWS: 8); the launch floor chains as many."""
    from kernels import decode
    monkeypatch.setattr(decode, "_gdc", lambda device, rows: gdc)
    names = decode.step_launches(DEV, rows)
    assert ("top-n" in names) == top_n_launched
    assert names == tuple(n for n in decode.LAUNCHES if top_n_launched or n != "top-n")
    launched = []
    monkeypatch.setattr(decode, "_empty_kernel", type("K", (), {"__getitem__": lambda self, g: lambda *a, **k:
                                                                launched.append(k["GDC"])})())
    decode.launch_floor(DEV, rows)()
    assert len(launched) == len(names)


def test_the_merge_groups_compressed_chunks_only_above_the_early_trigger():
    """``merge_group``: all at once at B·G up to EARLY_TRIGGER_ROWS or below MERGE_GROUP chunks; above, groups of half
    the chunks' power of two, at most MERGE_GROUP (8 chunks, of which a 2x cache at B=16 128k uses 4: groups of 4)."""
    from kernels.decode import EARLY_TRIGGER_ROWS, MERGE_GROUP, merge_group
    many = EARLY_TRIGGER_ROWS + 1
    assert merge_group(64, EARLY_TRIGGER_ROWS) == 0 and merge_group(MERGE_GROUP - 1, many) == 0
    assert merge_group(MERGE_GROUP, many) == MERGE_GROUP // 2
    assert [merge_group(c, many) for c in (MERGE_GROUP + 1, 2 * MERGE_GROUP, 8 * MERGE_GROUP)] == [MERGE_GROUP] * 3


@pytest.mark.parametrize("cap", [7, 24, 600, 2048, 65600, 100_000, 131_072])
def test_a_position_s_horizon_serves_it_and_ends_its_range(cap):
    """``horizon`` (the tokens a step for position t is planned for): above t, at most the capacity, one of at most
    log2(HORIZON_PARTS) + 1 values a cache, each the end of the range of positions that map to it; at a power of two
    of tokens in a cache of twice that, the tokens held (the bench's caches run a full cache's plan)."""
    from kernels.decode import HORIZON_PARTS, horizon
    hs = [horizon(CFG, t, cap) for t in range(cap)]
    assert all(t < h <= cap for t, h in enumerate(hs))
    assert len(set(hs)) <= HORIZON_PARTS.bit_length()
    assert all(h == hs[t + 1] or h == t + 1 for t, h in enumerate(hs[:-1]))      # a range ends at its horizon
    assert hs == sorted(hs)
    if cap % 2 == 0 and cap & (cap - 1) == 0 and cap >= 2 * CFG.block_size * 64:
        assert horizon(CFG, cap // 2 - 1, cap) == cap // 2


@pytest.mark.parametrize("t", [127, 128])
def test_a_step_planned_for_its_horizon_gives_the_oracles_step(t, monkeypatch):
    """A step planned for fewer tokens than its cache holds rows (``DecodeStep``'s ``horizon``, as
    ``NSAAttention.decode`` makes it) gives the oracle's step at the last position it serves (t = 127 of a horizon
    of 128) and at the first of the next (t = 128: 256), with fewer blocks in its plan than the capacity's: scoring
    programs of 8 blocks, compressed tiles of 16 tokens, so that a capacity of 512 has several of each."""
    from kernels import decode
    monkeypatch.setattr(decode, "CMP_TILE", 16)
    monkeypatch.setattr(decode, "SCORE_BLOCKS", 8)
    cap = 512
    assert decode.horizon(CFG, t, cap) == (128 if t == 127 else 256)
    torch.manual_seed(9)
    m = NSAAttention(CFG).to(DEV)
    x = torch.randn(2, t + 1, CFG.d_model, device=DEV)
    with torch.no_grad():
        q, k, v = m.project(x)
        cache = DecodeCache(CFG, 2, cap, device=DEV)
        cache.write_prefill(k, v, m.cmp_k(k), m.cmp_v(v))
        step = decode.DecodeStep(CFG, cache, horizon=decode.horizon(CFG, t, cap))
        assert step.plan.nbp < decode.DecodeStep(CFG, cache).plan.nbp
        _against_oracle_row(step(q[:, t], pos=torch.full((2,), t, dtype=torch.int32, device=DEV)), q[:, t], cache, t,
                            torch.float32)
    with pytest.raises(ValueError, match="horizon 513 outside"):
        decode.DecodeStep(CFG, cache, horizon=cap + 1)


@pytest.mark.parametrize("merge", ["merge-at-once", "early-trigger", "merge-in-groups"])
@pytest.mark.parametrize("t", [5, 47, 150, 300])
def test_a_cache_with_room_to_grow_gives_the_full_caches_step(t, merge, monkeypatch):
    """A cache allocated for more tokens than it holds (as a generation loop allocates it: capacity
    t + 1 + 64, 2·(t + 1), 4·(t + 1)) gives the step of a cache of exactly t + 1 tokens: the oracle's
    blocks, outputs within the tolerance rule and the formula's reads, each capacity on its own, since
    the compressed launch is split by the tokens held and the scorer and top-n rank only the causal
    blocks; its rows past t, NaN, are never read. Compressed tiles of 16 tokens, scoring programs of 8
    blocks (each keeping its best n: up to 3 groups a row, t = 300) and a top-n over chunks of 16 keys (a
    half chunk while the keys fit in it, t ≤ 150) or of 4, so that the split, the groups and the chunks
    vary. The chunk is the top-n launch's alone (``top_n``): the step runs with chunks of 16, then its
    top-n again over chunks of 4 on the step's own candidate keys, which must give the oracle's blocks
    too (the launches after it would then see the blocks they saw). ``merge-in-groups``: the merge takes the
    compressed partials a chunk at a time (groups of 1, as a GPU does at B·G above EARLY_TRIGGER_ROWS by groups of
    ``merge_group``), as many as are in use, whatever the capacity; and there the step runs as it does above
    EARLY_TRIGGER_ROWS (the late trigger, its waits no-ops: the interpreter runs launches one after another), so
    that the scorer's idle programs return before their wait and its groups are taken from the last
    (``_scores_kernel``'s IDLE_EXIT). ``early-trigger``: the step as it runs at few rows, with no top-n launch,
    each selection program ranking the candidates itself (``TOPN_IN_SELECTION_ROWS``), the plan made for 64 SMs
    so that a row has several selection programs, each taking its own slots of the blocks it ranked."""
    import triton.language as tl
    from kernels import decode
    if merge == "merge-in-groups":
        # (the rule's B·G bound aside)
        monkeypatch.setattr(decode, "merge_group", lambda c_cmp, rows: 1 if c_cmp > 1 else 0)
    if merge == "early-trigger":
        monkeypatch.setattr(decode, "sm_count", lambda device: 64)
    # the trigger: forced under the interpreter, its waits no-ops; a GPU runs its own, with real waits (B·G 4: on
    # Hopper the early trigger, no top-n launch)
    gdc = {"merge-at-once": 0, "early-trigger": 2, "merge-in-groups": 3}[merge] if DEV == "cpu" else \
        decode._gdc(DEV, 2 * CFG.n_kv_heads)
    if DEV == "cpu" and gdc:
        monkeypatch.setattr(decode, "_gdc", lambda device, rows: gdc)
        monkeypatch.setattr(tl.extra.cuda, "gdc_wait", lambda *a, **k: None)
        monkeypatch.setattr(tl.extra.cuda, "gdc_launch_dependents", lambda *a, **k: None)
    topn_launches, top_n = [], decode.top_n
    monkeypatch.setattr(decode, "top_n", lambda *a, **k: topn_launches.append(1) or top_n(*a, **k))
    monkeypatch.setattr(decode, "CMP_TILE", 16)
    monkeypatch.setattr(decode, "TOPN_CHUNK", 16)
    monkeypatch.setattr(decode, "SCORE_BLOCKS", 8)
    cfg = CFG
    torch.manual_seed(8)
    m = NSAAttention(cfg).to(DEV)
    x = torch.randn(2, t + 1, cfg.d_model, device=DEV)
    with torch.no_grad():
        q, k, v = m.project(x)
        pos = torch.full((2,), t, dtype=torch.int32, device=DEV)
        oracle = None           # every capacity holds the same tokens: one oracle row for all
        kept_best = False       # some capacity's groups kept their best n, not all their keys
        for cap in (t + 1, t + 65, 2 * (t + 1), 4 * (t + 1)):
            cache = DecodeCache(cfg, 2, cap, device=DEV)
            cache.write_prefill(k, v, m.cmp_k(k), m.cmp_v(v))
            step = decode.DecodeStep(cfg, cache)
            assert step.plan.nbp >= cap // cfg.block_size
            assert step.plan.merge_group == (1 if merge == "merge-in-groups" and step.plan.C_CMP > 1 else 0)
            assert step.plan.gdc == gdc and step.plan.topn_in_selection == (gdc == 2)
            assert step.plan.C_SEL > 1 or merge != "early-trigger"
            kept_best |= step.plan.cands < step.plan.score_blocks
            n_launched = len(topn_launches)
            oracle = _against_oracle_row(step(q[:, t], pos=pos), q[:, t], cache, t, torch.float32, oracle)
            assert len(topn_launches) - n_launched == (gdc != 2)
            with monkeypatch.context() as mp:
                mp.setattr(decode, "TOPN_CHUNK", 4)
                idx = torch.full_like(step.ws.idx, 99)
                top_n(step.ws.cand, pos, idx, cfg, step.plan.score_blocks, step.plan.cands)
            assert torch.equal(idx.long(), oracle[0]["idx"]), (cap, idx.tolist(), oracle[0]["idx"].tolist())
    assert kept_best or t < 16          # (at t = 5 every capacity is 4 blocks or fewer: one group, all its keys)


def test_one_branch_alone_runs_only_its_work_and_matches_the_full_step(layer, tiles):
    """branches=(b,), for each branch b: the same output and reads as the full step, and only b noted as
    run. (The full step, run once, is compared with each branch alone: each call has its own workspace.)"""
    from kernels.decode import decode_attention
    m, x, dtype = layer
    t = 80
    with torch.no_grad():
        q, cache = _cache_at(m, x, t, dtype)
        pos = torch.full((2,), t, dtype=torch.int32, device=DEV)
        full = decode_attention(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, pos, CFG)
        for branch in BRANCHES:
            with routing.capture() as log:
                one = decode_attention(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, pos, CFG, branches=(branch,))
            assert set(one.out) == {branch} and log.backends("decode") == {branch: ["triton"]}, branch
            assert torch.equal(one.out[branch], full.out[branch]), branch
            assert torch.equal(one.reads[branch], full.reads[branch]), branch


def _top_n_positions(cfg, NB: int, chunk: int) -> range:
    """Positions for the top-n cases: the top-n depends on t only through its block t // l', so one
    position a block, at a different offset in each (every 97th token past 64 blocks; chunks of 4 keys
    make each launch loop over up to a quarter of its keys' chunks under the interpreter: every fifth of
    those)."""
    step = (cfg.block_size + 1 if NB <= 64 else 97) * (5 if chunk < NB and NB > 16 else 1)
    return range(0, NB * cfg.block_size, step)


def _top_n_at(s, positions, cfg, keep_all=False):
    """The step's block selection (``decode.top_n_of``: the scorer's candidates, then the top-n) at every
    position in one launch: the positions along the
    kernel's batch dimension (row b at positions[b], its program reading its own position), each row
    the same block scores. s [G, NB] fp32 -> idx [len(positions), G, n] int64 on the CPU. One launch,
    not one a position: the interpreter runs a launch's programs one after the other, so this is the
    same programs, without a launch's own work (the arguments copied to the host and back) per position."""
    from kernels import decode
    G, NB = s.shape
    pos = torch.tensor(list(positions), dtype=torch.int32, device=DEV)
    idx = torch.full((len(pos), G, cfg.n_selected), 99, dtype=torch.int32, device=DEV)
    decode.top_n_of(s.to(DEV).expand(len(pos), G, NB).reshape(-1, NB).contiguous(), pos, idx, cfg, keep_all=keep_all)
    return idx.cpu().long()


# chunks of 4 keys only for caches of more than 4 blocks: ``top_n`` ranks at least 4 keys a chunk, so a cache of 4
# blocks or fewer is one chunk of 4 either way (the same launch, at the same positions). With chunks of 4 or 16 the
# scorer's groups are of 16 blocks (``SCORE_BLOCKS``): several groups a row, each keeping its best n (n < 16) or
# all its keys (n = 16). Where a group keeps its best n, n a power of two below the chunk, the top-n ranks from
# the groups' sorted runs (``topk_of_runs``): 128 blocks with n = 16 (one chunk of two runs), and chunks of 16
# with n = 8 (chunks of two runs, several chunks)
TOP_N_CASES = [pytest.param(nb, n_sel, chunk, id=f"{name}-{nb}-blocks-n{n_sel}")
               for chunk, name in ((1 << 20, "one-chunk"), (4, "chunks-of-4-groups-of-16"))
               for nb, n_sel in ((64, 5), (128, 16), (8, 4), (4, 16), (2, 4)) if chunk != 4 or nb > 4]
TOP_N_CASES.append(pytest.param(128, 8, 16, id="chunks-of-16-groups-of-16-128-blocks-n8"))


@pytest.mark.parametrize("keep_all", [False, True], ids=["best-n-a-group", "all-keys"])
@pytest.mark.parametrize("scores", ["distinct", "quarter-steps", "all-equal", "falling"])
@pytest.mark.parametrize("nb,n_sel,chunk", TOP_N_CASES)
def test_top_n_takes_the_oracle_blocks_under_exact_ties(scores, chunk, monkeypatch, nb, n_sel, keep_all):
    """The step's block selection alone (the scorer's keys, each group's best n or all of them:
    ``_candidates``; then ``_topn_kernel``) on block scores with exact ties: forced block 0 and
    the local blocks, then the highest, ties to the lower index, ascending and −1 padded — the
    oracle's ``select_blocks`` on the same scores, at positions all through the cache (one launch,
    ``_top_n_at``), caches of fewer blocks than n included (4 blocks with n = 16, 2 with n = 4: every
    slot past the chosen −1). Scores [G, NB]: two KV heads of different random scores (distinct,
    quarter-steps); one head where the pattern has one row (all-equal, falling: a second head would be
    the same program on the same inputs). (The interpreter's argmax always breaks ties to the lower
    index; on a GPU the kernel's own rule is what this checks.)"""
    from kernels import decode
    monkeypatch.setattr(decode, "TOPN_CHUNK", chunk)
    if chunk < 1 << 20:
        monkeypatch.setattr(decode, "SCORE_BLOCKS", 16)
    cfg = tiny(block_size=16, n_selected=n_sel)
    NB = nb
    torch.manual_seed(5)
    s = {"distinct": torch.rand(2, NB), "quarter-steps": torch.randint(0, 4, (2, NB)) / 4,
         "all-equal": torch.ones(1, NB), "falling": -torch.arange(NB).float()[None]}[scores]
    positions = _top_n_positions(cfg, NB, chunk)
    got = _top_n_at(s, positions, cfg, keep_all)
    ref = reference.select_blocks(s.expand(1, len(positions), *s.shape), torch.tensor(list(positions)), cfg)[0]
    for t, g, r in zip(positions, got, ref):
        assert torch.equal(g, r), (t, g.tolist(), r.tolist())


@triton.jit
def _topk_pair(X, OURS, TRITONS, LOG_N: tl.constexpr, LOG_K: tl.constexpr, LOG_R: tl.constexpr):
    x = tl.load(X + tl.arange(0, 2 ** LOG_N))
    tl.store(OURS + tl.arange(0, 2 ** LOG_K), topk_of_runs(x, LOG_N, LOG_K, LOG_R))
    tl.store(TRITONS + tl.arange(0, 2 ** LOG_K), tl.topk(x, 2 ** LOG_K))


@pytest.mark.parametrize("keys", ["distinct", "repeated"])
@pytest.mark.parametrize("log_n,log_k,log_r", [(8, 4, 4), (8, 4, 1), (8, 4, 0), (5, 4, 4), (10, 2, 2)],
                         ids=lambda v: str(v))
def test_top_k_of_sorted_runs_is_tritons_top_k(log_n, log_k, log_r, keys):
    """``topk_of_runs`` on int64 keys held as sorted runs (even ones ascending, odd descending) gives what
    ``tl.topk`` gives on the same keys, and the k largest: with distinct keys, and with runs of repeats and of the
    least int64 (the padding of the groups past the new token's)."""
    torch.manual_seed(log_n * 100 + log_r)
    n, r = 2 ** log_n, 2 ** log_r
    x = torch.randint(-2 ** 62, 2 ** 62, (n,), dtype=torch.int64)
    if keys == "repeated":
        x[::3] = 7
        x[n // 2:] = -2 ** 63
    runs = x.view(n // r, r).sort(dim=1, descending=True).values
    runs[0::2] = runs[0::2].flip(1)
    x = runs.reshape(-1).to(DEV)
    ours, tritons = (torch.empty(2 ** log_k, dtype=torch.int64, device=DEV) for _ in range(2))
    _topk_pair[(1,)](x, ours, tritons, log_n, log_k, log_r)
    assert torch.equal(ours, tritons)
    assert torch.equal(ours.cpu(), x.cpu().sort(descending=True).values[:2 ** log_k])


@pytest.mark.parametrize("nb,n_sel", [(64, 16), (8, 4)], ids=["64-blocks-n16", "8-blocks-n4"])
@pytest.mark.parametrize("chunk", [1 << 20, 4], ids=["one-chunk", "chunks-of-4"])
def test_top_n_writes_real_blocks_whatever_the_scores(chunk, monkeypatch, nb, n_sel):
    """The step's top-n on scores [G = 2, NB] holding NaN, +inf and -inf (what inputs that overflow give):
    in every block (it depends on t only through t // l'; all positions in one launch, ``_top_n_at``) it
    still writes min(n, causal blocks) distinct causal blocks, ascending, block 0 and the local blocks
    among them, the rest -1 — never a block past the query (a NaN ranks lowest)."""
    from kernels import decode
    monkeypatch.setattr(decode, "TOPN_CHUNK", chunk)
    if chunk == 4:
        monkeypatch.setattr(decode, "SCORE_BLOCKS", 16)
    cfg = tiny(block_size=16, n_selected=n_sel)
    NB, G = nb, 2
    torch.manual_seed(6)
    s = torch.rand(G, NB)
    for i, bad in enumerate((float("nan"), float("inf"), float("-inf"))):
        s[:, i::3][torch.rand(G, len(range(i, NB, 3))) < 0.4] = bad
    positions = _top_n_positions(cfg, NB, chunk)
    for t, idx in zip(positions, _top_n_at(s, positions, cfg)):
        cur, take = t // cfg.block_size, min(n_sel, t // cfg.block_size + 1)
        for row in idx.tolist():
            blocks = row[:take]
            assert blocks == sorted(set(blocks)) and all(0 <= j <= cur for j in blocks), (t, row)
            assert {0, cur, max(cur - 1, 0)} <= set(blocks) and row[take:] == [-1] * (n_sel - take), (t, row)


@pytest.mark.parametrize("t,later", [(120, True), (300, False)],
                         ids=["t120-one-tile-later-keys-nearer", "t300-two-tiles-earlier-keys-nearer"])
def test_selection_matches_the_oracle_when_every_compressed_logit_is_far_below_zero(t, later):
    """The compressed keys all along one direction, q far along the opposite one, so that every scaled
    logit is below -128 (in log2 units) and the softmax's max M is too; the keys' lengths ramp so that the
    scores favour the later blocks (t=120: all 8 blocks in the first tile of compressed tokens) or the
    earlier ones (t=300: blocks 0-15 in the first tile, 16-18 in the second). The scorer rescales each
    tile's block sums by exp2(tile max - M): a term of a tile that does not reach a block must add 0, not
    0 times exp2(0 - M) = 0 * inf (NaN: the block then ranked lowest, and the step picked another free
    block than the oracle's). fp32, against the oracle's row: its blocks, outputs and reads. Logits this large
    leave the fp32 oracle itself off the exact result (fp32's spacing at |s| ~ 1100 is 1.2e-4: the compressed
    branch's fp32 oracle was 6.3e-5 off the fp64 one, more than the fp32 floor), so the outputs' truth is the
    oracle in fp64 and the fp32 oracle is the low-precision one of the tolerance rule: the step may be off by
    twice what an fp32 computation of the same definition is."""
    from kernels.common import LOG2E
    from kernels.decode import decode_attention
    B, G, dk = 1, CFG.n_kv_heads, CFG.d_k
    torch.manual_seed(7)
    cache = DecodeCache(CFG, B, 320, device=DEV, dtype=torch.float32)
    N, u = CFG.n_cmp(t), torch.ones(dk, device=DEV)
    ramp = torch.linspace(1.0, 0.9, N, device=DEV) if later else torch.linspace(0.9, 1.0, N, device=DEV)
    k_cmp = (ramp[:, None] * u)[None, :, None, :].expand(B, N, G, dk)
    cache.write_prefill(torch.randn(B, t + 1, G, dk, device=DEV), torch.randn(B, t + 1, G, CFG.d_v, device=DEV),
                        k_cmp.contiguous(), torch.randn(B, N, G, CFG.d_v, device=DEV))
    q = (-200.0 * u).expand(B, CFG.n_heads, dk).contiguous()
    assert (q[0, 0] @ k_cmp[0, :, 0].T).max() * CFG.scale * LOG2E < -128
    pos = torch.full((B,), t, dtype=torch.int32, device=DEV)
    with torch.no_grad():
        r = decode_attention(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, pos, CFG)
    ref32 = reference.decode_row(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, t, CFG)
    ref64 = reference.decode_row(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, t, CFG, idx=ref32["idx"],
                                 dtype=torch.float64)
    _against_oracle_row(r, q, cache, t, torch.float32, oracle=({**ref64, "idx": ref32["idx"]}, ref32))


@pytest.mark.parametrize("d_k,branches", [(16, BRANCHES), (144, BRANCHES), (16, ("win",))],
                         ids=["append-in-compressed-launch", "append-d_k-144-two-pieces", "append-own-launch"])
def test_graph_step_writes_the_token_and_allocates_nothing(d_k, branches, tiles):
    """DecodeStep: writes k/v at pos into the cache (in the compressed launch, or its own launch when
    that does not run), reuses its workspace (same output buffers every call), and gives the oracle's
    row t after the append."""
    from kernels.decode import DecodeStep
    torch.manual_seed(3)
    cfg = tiny(block_size=16, n_selected=4, window=20, d_k=d_k) if d_k != CFG.d_k else CFG
    m = NSAAttention(cfg).to(DEV)
    x = torch.randn(2, 100, cfg.d_model, device=DEV)
    t = 63
    with torch.no_grad():
        q, k, v = m.project(x[:, :t + 1])
        cache = DecodeCache(cfg, 2, 100, device=DEV)
        cache.write_prefill(k[:, :t], v[:, :t], m.cmp_k(k), m.cmp_v(v))      # token t not yet written
        step = DecodeStep(cfg, cache, branches=branches)
        pos = torch.full((2,), t, dtype=torch.int32, device=DEV)
        r1 = step(q[:, t], k[:, t], v[:, t], pos=pos)
        assert torch.equal(cache.k[:, t], k[:, t]) and torch.equal(cache.v[:, t], v[:, t])
        ptr = r1.out[branches[0]].data_ptr()
        r2 = step(q[:, t], k[:, t], v[:, t], pos=pos)
        assert r2.out[branches[0]].data_ptr() == ptr
        ref = reference.forward(m, x[:, :t + 1])
    for br in branches:
        assert compare(r1.out[br], ref[f"o_{br}"][:, t], None, dtype=torch.float32)["ok"], br


def test_module_decode_on_the_kernel_matches_oracle_rows_and_counts_reads(monkeypatch):
    """NSAAttention.decode routed to the kernel (profile decode_backend: triton): prefill 50 tokens,
    decode 20 (t = 50..69: the window full, five compressed spans completed, past t = 64 where the
    causal blocks outnumber n); every step's output equals oracle row t and its reads equal the
    formula; the step's plan and workspace are made once for the cache, not per token. The steps
    before the window fills are the kernel's own tests' (``test_decode_step_matches…``)."""
    from kernels import decode
    from nsa_core.routing import RoutingPolicy
    made = []
    real = decode.Workspace.__init__
    monkeypatch.setattr(decode.Workspace, "__init__", lambda self, *a, **k: (made.append(1), real(self, *a, **k))[1])
    torch.manual_seed(1)
    m = NSAAttention(CFG, RoutingPolicy(decode_backend="triton")).to(DEV)
    T, P = 70, 50
    x = torch.randn(2, T, CFG.d_model, device=DEV)
    cache = DecodeCache(CFG, 2, T, device=DEV)
    steps, idx = [], []
    with torch.no_grad(), routing.capture() as log:
        m(x[:, :P], cache=cache)
        for t in range(P, T):
            before = {br: log.ran("decode", br, "triton") for br in BRANCHES}
            out, info = m.decode(x[:, t:t + 1], cache)
            # every step ran each branch on the kernel (on a GPU the step that sets up the layer's CUDA graph
            # runs it twice: once to warm up, once replayed from the graph)
            ran = {br: log.ran("decode", br, "triton") - before[br] for br in BRANCHES}
            assert all(n >= 1 for n in ran.values()), (t, ran, log.backends("decode"))
            steps.append(out)
            idx.append(info.idx)
            want = CFG.expected_reads(t)
            for br in BRANCHES:
                assert (info.reads[br] == want[br]).all(), (t, br, info.reads[br].tolist(), want[br])
    assert all(log.backends("decode")[br] == ["triton"] for br in BRANCHES), log.backends("decode")
    assert len(made) == 1, f"{len(made)} workspaces for {T - P} steps on one cache"
    full_idx = torch.cat([m.select(x)[:, :P], torch.stack(idx, 1)], 1)
    ref = reference.forward(m, x, idx=full_idx)["out"][:, P:]
    r = compare(torch.cat(steps, 1), ref, None, dtype=torch.float32)
    assert r["ok"], r


@pytest.mark.parametrize("cap,dtype,tiles,want", [
    ((9, 0), torch.bfloat16, 16, 3), ((9, 0), torch.float16, 8, 3), ((9, 0), torch.bfloat16, 4, 2),
    ((9, 0), torch.float32, 16, 2), ((10, 0), torch.bfloat16, 16, 2), ((8, 0), torch.bfloat16, 16, 2)],
    ids=["sm90-bf16-16tiles", "sm90-fp16-8tiles", "sm90-bf16-4tiles", "sm90-fp32", "sm100", "sm80"])
def test_partial_launches_pipeline_three_stages_only_where_measured(cap, dtype, tiles, want, monkeypatch):
    """3 stages where they were measured faster (Hopper, 16-bit caches, compressed programs of DEEP_TILES
    tiles or more, window + selection programs of any); fp32 tiles would outgrow the shared memory, other GPUs
    were not measured; the CPU: 2."""
    from kernels import decode
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: cap)
    assert decode._stages("cuda", dtype, tiles) == want
    assert decode._stages("cpu", dtype, tiles) == decode.PARTIAL_STAGES
    # the window + selection launch: 3 at any tiles where 3 are taken at all (sm90, 16-bit)
    assert decode._stages("cuda", dtype, decode.DEEP_TILES) == (3 if cap[0] == 9 and dtype.itemsize == 2 else 2)


@pytest.mark.parametrize("regs,spills,shared,three", [
    (168, 0, 49152, True), (170, 0, 49152, False), (176, 0, 49152, False), (168, 8, 49152, False),
    (168, 0, 80 * 1024, False), (128, 0, 75 * 1024, True)],
    ids=["168-regs", "170-regs", "176-regs", "spills", "80KB-shared", "75KB-shared"])
def test_three_programs_an_sm_need_the_registers_and_shared_memory_and_no_spill(regs, spills, shared, three):
    """``fits``: an H100/H200 SM has 65,536 registers and 228 KB of shared memory (1 KB of it reserved per
    program): three programs of 4 warps need at most 170 registers a thread, allocated in eights: 168 (170 takes
    176)."""
    from kernels import decode
    assert decode.fits(regs, spills, shared, 4, 3, 65536, 228 * 1024) is three


@pytest.mark.parametrize("B,capacity,tiles,chunks", [
    pytest.param(B, cap, tiles, chunks, id=f"B{B}-cap{cap}") for B, cap, tiles, chunks in
    [(16, 262144, 32, 8), (16, 131072, 32, 4), (32, 65536, 32, 2), (64, 65536, 32, 2), (16, 65536, 16, 4),
     (8, 262144, 32, 8), (1, 131072, 2, 64)]])
def test_compressed_programs_take_up_to_32_tiles_while_every_sm_keeps_one(B, capacity, tiles, chunks, monkeypatch):
    """The compressed launch's plan on 132 SMs (an H100/H200; paper config, bf16): tiles a program up to
    CMP_MAX_TILES (32), halved while its chunks over the capacity's tiles leave an SM without a program (the kernel
    halves them again at the position, ``_cmp_split``): half the programs of 16-tile ones wherever 32 still leave every
    SM one (B=16 128k on a full cache: one wave of 256). The window + selection programs keep MAX_TILES (16)."""
    from kernels import decode
    from nsa_validate.bench.decode import layer_config
    cfg = layer_config(True)
    monkeypatch.setattr(decode, "_capability", lambda dev: (9, 0))
    monkeypatch.setattr(decode, "sm_count", lambda dev: 132)
    monkeypatch.setattr(decode, "_fits_per_sm", lambda p, *a: True)
    p = decode.plan(cfg, B, capacity, cfg.n_cmp(capacity - 1), "cpu", torch.bfloat16)
    assert (p.cmp_tiles, p.C_CMP) == (tiles, chunks)
    assert decode.CMP_MAX_TILES == 32 and p.win_tiles <= decode.MAX_TILES == 16


def test_compressed_programs_of_32_tiles_give_the_oracles_step(monkeypatch):
    """A plan whose compressed programs take 32 tiles (CMP_MAX_TILES; made here with compressed tiles of 16 tokens
    on one SM, so that a small cache gets it): the kernels compiled for it (CMP_TILES 32, five halvings) give the
    oracle's blocks, outputs and reads, on a full cache and on one with room to grow (a loop of 32 tiles at most,
    walking the tiles the tokens fill)."""
    from kernels import decode
    monkeypatch.setattr(decode, "CMP_TILE", 16)
    monkeypatch.setattr(decode, "sm_count", lambda device: 1)
    t = 300
    torch.manual_seed(9)
    m = NSAAttention(CFG).to(DEV)
    x = torch.randn(2, t + 1, CFG.d_model, device=DEV)
    pos = torch.full((2,), t, dtype=torch.int32, device=DEV)
    oracle, tiles = None, []
    with torch.no_grad():
        for cap in (t + 1, 4 * (t + 1)):
            q, cache = _cache_at(m, x, t, torch.float32, cap)
            step = decode.DecodeStep(CFG, cache)
            tiles.append(step.plan.cmp_tiles)
            oracle = _against_oracle_row(step(q, pos=pos), q, cache, t, torch.float32, oracle)
    assert tiles[-1] == decode.CMP_MAX_TILES == 32, tiles


@pytest.mark.parametrize("fit", [True, False], ids=["kernel-fits-three", "kernel-fits-two"])
def test_shallow_window_selection_launch_only_where_its_kernel_fits_three_an_sm(fit, monkeypatch):
    """On an sm90 GPU at B=16, 64k (paper config, bf16), the plan takes the shallow window + selection launch (4
    tiles a program, 2 stages) only where ``_fits_per_sm`` says its kernel runs three programs an SM; else the
    deep one (8 tiles, 3 stages), whose chunk counts the workspace and the merge follow."""
    from kernels import decode
    from nsa_validate.bench.decode import layer_config
    cfg = layer_config(True)
    asked = []
    monkeypatch.setattr(decode, "_capability", lambda dev: (9, 0))
    monkeypatch.setattr(decode, "sm_count", lambda dev: 132)
    monkeypatch.setattr(decode, "_fits_per_sm", lambda p, *a: asked.append(p) or fit)
    p = decode.plan(cfg, 16, 2 * 65536, cfg.n_cmp(2 * 65536 - 1), "cpu", torch.bfloat16)
    assert len(asked) == 1 and (asked[0].win_tiles, asked[0].win_stages) == (4, 2)
    want = (4, 4, 2, 2, 4) if fit else (8, 8, 3, 1, 2)
    assert (p.win_tiles, p.sel_tiles, p.win_stages, p.C_WIN, p.C_SEL) == want
    # B=8 (B·G 32): two tiles a program would be shallow enough: no compile asked, the deep launch
    asked.clear()
    assert decode.plan(cfg, 8, 2 * 65536, cfg.n_cmp(2 * 65536 - 1), "cpu", torch.bfloat16).win_stages == 3
    assert not asked


def test_the_fit_probe_compiles_the_launch_a_decode_step_makes(monkeypatch):
    """``_fits_per_sm`` compiles the window + selection launch with dtypes for tensors (``_probe_args``): the same
    specialization, argument for argument, as the launch a ``DecodeStep`` that appends its token makes, so that
    its first launch finds the kernel compiled and the launch list holds it once."""
    from triton.runtime.jit import MockTensor
    from kernels import decode
    from nsa_validate.bench.decode import make_inputs
    from nsa_validate.suite import launches
    seen = []

    class Stop(Exception):
        pass

    class Caught:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((args, kw))
                raise Stop
            return launch

    monkeypatch.setattr(decode, "_winsel_partial_kernel", Caught())
    cache, new = make_inputs(CFG, 2, 100, torch.float16, DEV, seed=0, capacity=160)
    step = decode.DecodeStep(CFG, cache)
    with pytest.raises(Stop):
        step(**new)
    ((args, kw),) = seen
    pargs, pkw = decode._probe_args(step.plan, CFG, 160, torch.float16)
    enc = [launches._encode(a) for a in args]
    assert [launches._encode(MockTensor.wrap_dtype(a)) for a in pargs] == enc
    assert pkw == kw
