"""The interpreter capability probe agrees with the kernels it stands for.

The probe decides whether the Triton suites run on a CPU machine, so it must be neither too lax
(kernels then fail in the suites) nor too strict (kernels then skip although they work): here the
selection forward and backward (the loops over loaded bounds) run whatever the probe says, and
their success must equal the probe's verdict.
"""
import pytest
import torch

from kernels.interpreter import interpreting, probe
from nsa_core import reference, tiny

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not interpreting(),
                                reason="kernels run natively on a GPU: the interpreter probe is not used")


def _kernels_work() -> str | None:
    """None when the selection kernels' forward and backward run and match the oracle here."""
    from kernels import selection
    cfg = tiny(block_size=16)
    T, G, h, L = 50, cfg.n_kv_heads, cfg.heads_per_group, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(T, G * h, cfg.d_k, generator=g, requires_grad=True)
    k = torch.randn(T, G, cfg.d_k, generator=g, requires_grad=True)
    v = torch.randn(T, G, cfg.d_v, generator=g, requires_grad=True)
    # block 0, the block before t's and t's own (-1 where they coincide), the same for every KV head
    blocks = [sorted({0, max(t // L - 1, 0), t // L}) for t in range(T)]
    idx = torch.tensor([b + [-1] * (3 - len(b)) for b in blocks])[:, None, :].expand(T, G, 3).contiguous()
    try:
        o = selection.selection_attention(q, k, v, idx, L, scale=cfg.scale)
        o.square().sum().backward()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    pos = torch.arange(T)
    mask = reference.selection_mask(cfg, idx[None], pos, T)
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    ref = reference.masked_attention(qq.view(1, T, G, h, -1), kk[None], vv[None], mask, cfg.scale)
    ref.square().sum().backward()
    if not torch.allclose(o.detach(), ref.reshape(T, G * h, -1), atol=1e-4):
        return "selection forward differs from the oracle"
    for name, a, b in (("dq", q, qq), ("dk", k, kk), ("dv", v, vv)):
        if not torch.allclose(a.grad, b.grad, atol=1e-3):
            return f"selection backward {name} differs from the oracle"
    return None


def test_probe_verdict_matches_the_kernels():
    kernels_fail = _kernels_work()
    probe_fail = probe()
    assert (kernels_fail is None) == (probe_fail is None), (
        f"probe says {probe_fail or 'ok'}; the selection kernels {kernels_fail or 'ran correctly'}")



triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _sort_kernel(X, OUT, N: tl.constexpr):
    """Each program's row of X [rows, N] doubled (a nested call) and sorted, descending (``tl.sort``)."""
    offs = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(OUT + offs, tl.sort(_twice(tl.load(X + offs)), descending=True))


def test_nested_calls_run_right_with_the_language_patched_once_a_launch():
    """``kernels`` makes the interpreter patch triton.language once a launch (``patch_lang_once_per_launch``):
    a kernel whose nested @jit calls (a helper of its own, ``tl.sort``'s steps) need the patched language
    still gives torch's answer, launch after launch, and after each launch the language is restored."""
    import kernels  # noqa: F401  (installs it)
    from triton.runtime import interpreter as ti
    if not getattr(ti._patch_lang, "__nsa_once__", False):
        pytest.skip("this Triton's interpreter lacks what the patch wraps: it runs as Triton ships it")
    arange = tl.arange
    x = torch.randn(3, 16)
    for _ in range(2):
        out = torch.empty_like(x)
        _sort_kernel[(3,)](x, out, N=16)
        assert torch.equal(out, (x * 2).sort(dim=1, descending=True).values)
        assert tl.arange is arange, "the launch left triton.language patched"


@triton.jit
def _xor_topk_kernel(X, XOR, TOP, N: tl.constexpr, K: tl.constexpr):
    """Row-wise ``tl.xor_sum`` of X [rows, N] (int32) and its K largest (``tl.topk``, descending)."""
    row = tl.program_id(0)
    x = tl.load(X + row * N + tl.arange(0, N))
    tl.store(XOR + row, tl.xor_sum(x, 0))
    tl.store(TOP + row * K + tl.arange(0, K), tl.topk(x, K))


def test_xor_reductions_run_in_numpy_and_give_the_element_loops_answer():
    """``kernels`` makes the interpreter reduce ``^`` in one numpy call (``reduce_xor_in_numpy``): no
    reduction of the kernel runs element by element, an xor reduction equals the one computed here, and
    ``tl.topk`` (whose bitonic steps reduce with ``^``) gives torch's top k, ties and negatives included."""
    import functools

    import kernels  # noqa: F401  (installs it)
    from triton.runtime import interpreter as ti
    if not getattr(ti.ReduceOps.apply_impl, "__nsa_xor__", False):
        pytest.skip("this Triton's interpreter lacks what the patch wraps: it runs as Triton ships it")
    def element_loop(self, input):                       # the path the patch takes the xor reductions off
        raise AssertionError(f"an element-by-element reduction ran ({self.combine_fn})")
    real, ti.ReduceOps.generic_reduce = ti.ReduceOps.generic_reduce, element_loop
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-2**31, 2**31 - 1, (4, 32), generator=g, dtype=torch.int64).to(torch.int32)
    x[1, :8] = x[1, 8:16]                                   # ties
    xor, top = torch.empty(4, dtype=torch.int32), torch.empty(4, 8, dtype=torch.int32)
    try:
        _xor_topk_kernel[(4,)](x, xor, top, N=32, K=8)
    finally:
        ti.ReduceOps.generic_reduce = real
    assert xor.tolist() == [functools.reduce(lambda a, b: a ^ b, row) for row in x.tolist()]
    assert torch.equal(top, x.sort(dim=1, descending=True).values[:, :8])


@triton.jit
def _int32_kernel(X, Y, OUT, N: tl.constexpr):
    """Row-wise x·3 + y − 7 of int32 rows X, Y [rows, N] (wrapping, as a GPU does)."""
    offs = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(OUT + offs, tl.load(X + offs) * 3 + tl.load(Y + offs) - 7)


def test_int32_arithmetic_runs_no_overflow_check_and_wraps_as_on_a_gpu():
    """``kernels`` turns off the interpreter's overflow checks, which its ``debug`` off makes dead
    (``no_dead_overflow_checks``): an int32 kernel's ``*``, ``+`` and ``−`` cast nothing to int64 (the checks'
    path), and give the wrapped int32 results a GPU gives, overflowing values included."""
    import kernels  # noqa: F401  (installs it)
    from triton.runtime import interpreter as ti
    opts = ti.interpreter_builder.options
    if getattr(opts, "debug", True) or not hasattr(opts, "sanitize_overflow"):
        pytest.skip("this Triton's interpreter runs with debug on or lacks the options: it runs as Triton ships it")
    casts, cast = [], ti.interpreter_semantic.cast

    def spy(input, dst_ty, *args, **kwargs):
        casts.append(dst_ty)
        return cast(input, dst_ty, *args, **kwargs)
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-2**31, 2**31 - 1, (3, 16), generator=g, dtype=torch.int64).to(torch.int32)
    y = torch.randint(-2**31, 2**31 - 1, (3, 16), generator=g, dtype=torch.int64).to(torch.int32)
    out = torch.empty_like(x)
    ti.interpreter_semantic.cast = spy
    try:
        _int32_kernel[(3,)](x, y, out, N=16)
    finally:
        ti.interpreter_semantic.cast = cast
    assert tl.int64 not in casts, "an int32 operation was checked for overflow in int64"
    assert torch.equal(out, x * 3 + y - 7)          # torch's int32 arithmetic wraps too


@triton.jit
def _broadcast_kernel(X, Y, OUT, N: tl.constexpr, M: tl.constexpr):
    """OUT [N, M] fp32 = x[:, None] * y[None, :] + (x[:, None] + 2) + y[None, :] * 0.5 - rows·cols (int32),
    from X [N] fp16 and Y [M] fp32: operands of equal shapes and dtypes, equal shapes and other dtypes,
    column and row vectors broadcast to a tile, scalars splat onto it."""
    r = tl.arange(0, N)
    c = tl.arange(0, M)
    x = tl.load(X + r)[:, None]
    y = tl.load(Y + c)[None, :]
    tile = x * y + (x + 2) + y * 0.5 - r[:, None] * c[None, :]
    tl.store(OUT + r[:, None] * M + c[None, :], tile + tl.zeros((N, M), tl.float32))


@triton.jit
def _odd_tile_kernel(OUT, N: tl.constexpr):
    tl.store(OUT + tl.arange(0, 4), tl.sum(tl.zeros((N, 4), tl.float32), 0))


def test_block_types_built_once_a_shape_keep_triton_s_answers_and_errors():
    """``kernels`` makes the interpreter keep each block shape's objects (``block_types_once``): block types of
    the same dimensions share their shape, a broadcast of equal shapes hands its operands back; a kernel
    mixing equal shapes, other dtypes, row and column broadcasts and splats still gives torch's answer,
    launch after launch; a tile whose dimension is not a power of two is still Triton's error."""
    import kernels  # noqa: F401  (installs it)
    bt = tl.core.block_type
    if not getattr(bt.__init__, "__nsa_once__", False):
        pytest.skip("this Triton's interpreter lacks what the patch wraps: it runs as Triton ships it")
    a, b = bt(tl.float16, [16, 32]), bt(tl.int32, [tl.constexpr(16), 32])
    assert a.shape is b.shape and a == bt(tl.float16, [16, 32]) and a != b and str(b) == "<['16', '32'], int32>"
    with pytest.raises(TypeError, match="constexpr"):      # Triton's check of each dimension, shape kept or not
        bt(tl.float16, [16.0, 32])
    g = torch.Generator().manual_seed(3)
    for N, M in ((16, 32), (32, 16), (16, 32)):
        x, y = torch.randn(N, generator=g).half(), torch.randn(M, generator=g)
        out = torch.empty(N, M)
        _broadcast_kernel[(1,)](x, y, out, N=N, M=M)
        xf = x.float()[:, None]             # x + 2 stays fp16, as in Triton; fp16 · fp32 is fp32
        want = xf * y[None] + (x[:, None] + 2).float() + y[None] * 0.5 \
            - (torch.arange(N)[:, None] * torch.arange(M)[None]).float()
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-5)
    for _ in range(2):                 # the error is Triton's, and a failed shape is never kept
        with pytest.raises(Exception, match="power of 2"):
            _odd_tile_kernel[(1,)](torch.empty(4), N=3)


def test_numpy_dtypes_looked_up_once_give_triton_s_own():
    """``kernels`` makes the interpreter keep each type's numpy dtype (``numpy_dtypes_once``): for scalar
    types, blocks of them, pointers and blocks of pointers it gives what Triton's own lookup gives."""
    import kernels  # noqa: F401  (installs it)
    from triton.runtime import interpreter as ti
    if not getattr(ti._get_np_dtype, "__nsa_once__", False):
        pytest.skip("this Triton's interpreter lacks what the patch wraps: it runs as Triton ships it")
    own = ti._get_np_dtype.__wrapped__
    types = [tl.int1, tl.float16, tl.bfloat16, tl.float32, tl.int32, tl.uint32, tl.int64, tl.float8e5,
             tl.pointer_type(tl.float32), tl.pointer_type(tl.int8)]
    types += [tl.core.block_type(t, [8, 4]) for t in types]
    for _ in range(2):
        assert [ti._get_np_dtype(t) for t in types] == [own(t) for t in types]


@triton.jit
def _mixed_ops_kernel(X, I, U, OUT, OUT_I, N: tl.constexpr):
    """From X [N] fp16, I [N] int32 and U [N] uint32: OUT [N] fp32 = (x * 0.5 + 2) / 3 - (1.5 - x) (fp16 with
    numbers, a division in fp32) + i (int32 to fp32) * scalar x[0]; OUT_I [N] int64 = (i * 3 - 7) % 5 + u // 2
    + x[0] < 1 (a comparison's int1) + i (an int64 operand)."""
    r = tl.arange(0, N)
    x, i, u = tl.load(X + r), tl.load(I + r), tl.load(U + r)
    x0 = tl.load(X)
    tl.store(OUT + r, (x * 0.5 + 2) / 3 - (1.5 - x) + i * x0)
    tl.store(OUT_I + r, (i * 3 - 7) % 5 + (u // 2).to(tl.int32) + (x0 < 1) + i.to(tl.int64))


def test_operand_types_decided_once_match_triton_s_own():
    """``kernels`` makes the interpreter keep a binary operation's type decisions per pair of types
    (``operand_types_once``): over numbers, scalar and block tensors of every type the kernels use and pointers,
    in every pair and under every flag combination, it gives what Triton's own function gives (types, values and
    errors); a kernel mixing numbers, fp16, int32, uint32 and int64 operands still gives torch's answer."""
    import kernels  # noqa: F401  (installs it)
    from kernels import interpreter
    from triton.runtime import interpreter as ti
    fast = ti.interpreter_semantic.binary_op_type_checking_impl
    if not getattr(fast, "__nsa_once__", False):
        pytest.skip("this Triton's interpreter lacks what the patch wraps: it runs as Triton ships it")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, generator=g).half()
    i = torch.randint(-50, 50, (16,), generator=g, dtype=torch.int32)
    u = torch.randint(0, 50, (16,), generator=g, dtype=torch.int32)
    out, out_i = torch.empty(16), torch.empty(16, dtype=torch.int64)
    _mixed_ops_kernel[(1,)](x, i, u, out, out_i, N=16)
    assert interpreter.operand_types_once.why is None, interpreter.operand_types_once.why
    xf = x.float()
    # fp16 with Python numbers stays fp16 (the products and sums rounded there), the division is fp32
    want = ((x * 0.5 + 2).float() / 3 - (1.5 - x).float()) + i.float() * xf[0]
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
    want_i = torch.remainder(i * 3 - 7, 5)
    want_i = torch.where((i * 3 - 7 < 0) & (want_i != 0), want_i - 5, want_i)     # Triton's % keeps the sign
    assert torch.equal(out_i, want_i.long() + (u // 2).long() + int(xf[0] < 1) + i.long())
    own = ti.interpreter_semantic.binary_op_type_checking_impl.__wrapped__
    assert interpreter._same_as_triton(ti, own, ti.interpreter_semantic.binary_op_type_checking_impl,
                                       blocks=True) is None
