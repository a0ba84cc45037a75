"""Can Triton's interpreter run our kernels here? Found by running a kernel, not by a version number.

On a machine without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``),
which executes a program as numpy code. Interpreters differ between triton releases in ways that
break real kernels without an error: on triton 3.6.0 a scalar loaded from memory comes back as a
1-element array, so a loop whose bounds are loaded (``for c in range(lo, hi, STEP)``, the
selection backward's segment loop) or a branch on a loaded value misbehaves. ``probe()`` runs one
small kernel built from the same patterns the project's kernels use — loaded scalars as loop
bounds and branch conditions, 64-bit offsets, pipelined ``tl.range`` loops, ``tl.dot`` in fp32
and fp16, masks from loaded values, ``argmax`` and ``cumsum`` — and checks its output against
the same computation in plain torch. The answer is cached per process.

Run as ``python -m kernels.interpreter`` (with ``TRITON_INTERPRET=1``) it prints one JSON line:
``{"ok": bool, "error": str | null, "triton": version}`` — how ``nsa-validate env`` asks.
"""
from __future__ import annotations

import functools
import json
import os
import sys

import torch


def interpreting() -> bool:
    """Triton's own switch: kernels defined from now on run on CPU tensors through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_kernel(X, LO, HI, A, B, OUT, OUT_DOT, OUT_IDX,
                      STEP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr):
        pid = tl.program_id(0)
        lo = tl.load(LO + pid)
        hi = tl.load(HI + pid)
        offs = tl.arange(0, BN)
        acc = tl.zeros([BN], tl.float32)
        if hi >= 0:                                        # a branch on a loaded scalar
            for c in range(lo, hi, STEP):                  # loop bounds loaded from memory
                acc += tl.load(X + c + offs, mask=(c + offs) < hi, other=0.0)
            first = lo.to(tl.int64)
            last = hi.to(tl.int64)
            for i in range(first, last):                   # 64-bit loaded bounds, scalar body
                acc += tl.where(offs == 0, tl.load(X + i), 0.0)
        for ti in tl.range(3, num_stages=STAGES):          # a pipelined constexpr loop
            acc += tl.where(offs == ti, 1.0, 0.0)
        valid = (offs < BN) & (offs <= hi - lo)            # a mask from loaded scalars
        acc = tl.where(valid, acc, -1.0)
        tl.store(OUT + pid * BN + offs, acc)
        rows = tl.arange(0, BD)
        a = tl.load(A + rows[:, None] * BD + rows[None, :])
        b = tl.load(B + rows[:, None] * BD + rows[None, :])
        d = tl.dot(a, b, input_precision="ieee" if A.dtype.element_ty == tl.float32 else "tf32")
        tl.store(OUT_DOT + pid * BD * BD + rows[:, None] * BD + rows[None, :], d)
        best = tl.argmax(tl.sum(d, 1), 0, tie_break_left=True)
        rank = tl.cumsum(tl.where(rows <= best, 1, 0), 0)
        tl.store(OUT_IDX + pid * BD + rows, rank)

    return _probe_kernel


def _expected(x, lo, hi, a, b, BN):
    out = torch.zeros(len(lo), BN)
    for p, (l0, h0) in enumerate(zip(lo.tolist(), hi.tolist())):
        acc = torch.zeros(BN)
        if h0 >= 0:
            for c in range(l0, h0, 8):
                n = min(BN, h0 - c)
                acc[:n] += x[c:c + n]
            acc[0] += x[l0:h0].sum()
        acc[:3] += 1.0
        acc[torch.arange(BN) > h0 - l0] = -1.0
        out[p] = acc
    d = (a.double() @ b.double()).float()
    best = int(torch.argmax(d.double().sum(1)))
    rank = torch.cumsum((torch.arange(a.shape[0]) <= best).int(), 0).int()
    return out, d, rank


@functools.cache
def probe() -> str | None:
    """None when the interpreter ran the probe kernel correctly, else the one-line reason (the
    probe's own error or the first wrong value). Must be called with TRITON_INTERPRET set."""
    if not interpreting():
        return "TRITON_INTERPRET is not set: the probe runs only under the interpreter"
    try:
        kernel = _kernel()
        BN, BD = 16, 16
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, generator=g)
        lo = torch.tensor([0, 5, 40, 7], dtype=torch.int32)
        hi = torch.tensor([21, 37, 40, -1], dtype=torch.int32)
        for dtype in (torch.float32, torch.float16):
            a = torch.randn(BD, BD, generator=g).to(dtype)
            b = torch.randn(BD, BD, generator=g).to(dtype)
            out = torch.full((len(lo), BN), float("nan"))
            out_dot = torch.full((len(lo), BD, BD), float("nan"))
            out_idx = torch.full((len(lo), BD), -7, dtype=torch.int32)
            kernel[(len(lo),)](x, lo, hi, a, b, out, out_dot, out_idx, STEP=8, BN=BN, BD=BD, STAGES=2)
            want, want_dot, want_idx = _expected(x, lo, hi, a, b, BN)
            if not torch.allclose(out, want, atol=1e-5, rtol=1e-5):
                bad = (out - want).abs().nan_to_num(float("inf")).argmax().item()
                return (f"the probe kernel's loop over loaded bounds gave {out.flatten()[bad].item():.6g} "
                        f"where {want.flatten()[bad].item():.6g} was expected ({dtype} case)")
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            if not torch.allclose(out_dot[0], want_dot, atol=tol * BD, rtol=tol):
                return f"tl.dot in {dtype} gave wrong values under the interpreter"
            if not torch.equal(out_idx[0], want_idx):
                return "tl.argmax/tl.cumsum gave wrong values under the interpreter"
    except Exception as e:          # the interpreter's own failure is the finding
        msg = " ".join(str(e).split())[:300]
        return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return None


def _descriptor_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _descriptor_probe(D, OUT, BC: tl.constexpr, BD: tl.constexpr):
        x = D.load([tl.program_id(0) * BC, 1, 0]).reshape(BC, BD)
        rows = tl.program_id(0) * BC + tl.arange(0, BC)
        cols = tl.arange(0, BD)
        tl.store(OUT + rows[:, None] * BD + cols[None, :], x)

    return _descriptor_probe


@functools.cache
def descriptors() -> str | None:
    """None when the interpreter loads tiles through tensor descriptors (TMA on a GPU) correctly,
    zero-filled past the tensor's edges, as the kernels' descriptor paths need; else the reason.
    Kernels take their pointer paths where it fails."""
    if not interpreting():
        return "TRITON_INTERPRET is not set: the probe runs only under the interpreter"
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
        kernel = _descriptor_kernel()
        g = torch.Generator().manual_seed(1)
        for dtype in (torch.float32, torch.float16):
            a = torch.randn(40, 3, 24, generator=g).to(dtype)          # [rows, heads, d]: head 1, d padded to 32
            out = torch.full((48, 32), float("nan"), dtype=dtype)
            kernel[(3,)](TensorDescriptor(a, list(a.shape), list(a.stride()), [16, 1, 32]), out, BC=16, BD=32)
            want = torch.zeros(48, 32, dtype=dtype)
            want[:40, :24] = a[:, 1]
            if not torch.equal(out, want):
                return f"a descriptor load gave wrong values under the interpreter ({dtype} case)"
    except Exception as e:
        msg = " ".join(str(e).split())[:300]
        return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return None


if __name__ == "__main__":
    import triton
    why = probe()
    print(json.dumps({"ok": why is None, "error": why, "triton": triton.__version__}))
    sys.exit(0)


def patch_lang_once_per_launch() -> bool:
    """Make Triton's interpreter patch ``triton.language`` once per launch, not again at each nested call.

    Under the interpreter a launch patches ``triton.language`` (and ``.core``) so its builtins run as numpy
    code, and restores them when the launch ends; every nested ``@jit`` call inside it patches the same
    modules again and drops the result. Those repeats are half of a program's time in our kernels (an
    ``inspect.getmembers`` of the language a call; ``tl.sort``'s steps are nested calls), yet change
    nothing: the modules are patched already. Wrapped here, a nested call patches only the modules the
    running launch has not (a helper seeing ``triton.language.core`` where the kernel saw only
    ``triton.language``). Where this Triton's interpreter lacks the pieces (``_patch_lang``,
    ``_LangPatchScope``, ``GridExecutor``), nothing is changed and False is returned; were their meaning to
    change, an unpatched builtin fails loudly (outside the interpreter it refuses to run), never silently."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    patch, scope, executor = (getattr(ti, n, None) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor"))
    if patch is None or scope is None or executor is None or "__call__" not in vars(executor):
        return False
    if getattr(patch, "__nsa_once__", False):
        return True
    import inspect
    langs = (ti.tl, ti.tl.core)
    done: set[frozenset[int]] = set()        # the module sets the running launch has patched
    # a function's module set by its globals dict (held here, so that no other dict takes its id), found again
    # when the dict has changed size: scanning the globals at every nested call was ~4% of a kernel's time
    seen: dict[int, tuple[dict, int, frozenset[int]]] = {}

    @functools.wraps(patch)
    def once(fn):
        g = fn.__globals__
        hit = seen.get(id(g))
        if hit is None or hit[1] != len(g):
            hit = seen[id(g)] = (g, len(g), frozenset(id(v) for v in g.values() if inspect.ismodule(v) and v in langs))
        key = hit[2]
        if key in done:
            return scope()                    # an empty scope: nothing to restore
        done.add(key)
        return patch(fn)

    launch = executor.__call__

    @functools.wraps(launch)
    def launch_once(self, *args, **kwargs):
        done.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            done.clear()                      # the launch restored the modules: the next patches them again
    once.__nsa_once__ = True
    ti._patch_lang = once
    executor.__call__ = launch_once
    return True


def reduce_xor_in_numpy() -> bool:
    """Make Triton's interpreter reduce with ``^`` (``tl.xor_sum``) in one numpy call.

    The interpreter reduces sum, min, max, argmin and argmax with numpy, but any other combine function
    element by element in Python (``ReduceOps.generic_reduce``: a tensor built and the combine function
    run for each element). ``tl.sort`` and ``tl.topk`` swap pairs through ``xor_sum`` at every step of
    their bitonic network, so under the interpreter our scorer and top-n spent most of their time there
    (a CPU profile of the layer's forward at S=128: 14 of its 26 s). XOR over integers is associative
    and commutative, so ``np.bitwise_xor.reduce`` gives exactly what the element loop gives. Where this
    Triton's interpreter lacks ``ReduceOps.apply_impl`` or ``tl.standard._xor_combine``, nothing is
    changed and False is returned."""
    try:
        import numpy as np
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    ops, xor = getattr(ti, "ReduceOps", None), getattr(ti.tl.standard, "_xor_combine", None)
    if ops is None or xor is None or "apply_impl" not in vars(ops):
        return False
    if getattr(ops.apply_impl, "__nsa_xor__", False):
        return True
    apply_impl = ops.apply_impl

    @functools.wraps(apply_impl)
    def with_xor(self, input):
        if self.combine_fn is not xor:
            return apply_impl(self, input)
        x = input[0] if isinstance(input, tuple) else input
        data = np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(data, x.dtype)
    with_xor.__nsa_xor__ = True
    ops.apply_impl = with_xor
    return True


def no_dead_overflow_checks() -> bool:
    """Make Triton's interpreter skip the integer overflow checks whose assertion it then drops.

    Every int32 ``+``, ``-`` and ``*`` in a kernel asks for an overflow check (``sanitize_overflow``, on by
    default): the semantic layer redoes the operation in int64, compares it with the type's bounds and hands
    the result to ``device_assert``, which returns without asserting unless the options' ``debug`` is on
    (``semantic.device_assert``), as on a GPU, where the unused check is compiled away. Under the
    interpreter nothing compiles it away: those casts and comparisons were a third of an index-heavy
    kernel's time (a CPU profile of the decode step's test). With ``debug`` off the check can never fire, so
    turning ``sanitize_overflow`` off changes no result; with ``debug`` on nothing is changed. Where this
    Triton's interpreter has no such options, nothing is changed and False is returned."""
    try:
        import dataclasses

        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    builder = getattr(ti, "interpreter_builder", None)
    opts = getattr(builder, "options", None)
    if opts is None or not dataclasses.is_dataclass(opts) or not hasattr(opts, "sanitize_overflow") \
            or getattr(opts, "debug", True):
        return False
    builder.options = dataclasses.replace(opts, sanitize_overflow=False)
    return True


def block_types_once() -> bool:
    """Make Triton's interpreter build each block type's shape once, and skip the broadcast of equal shapes.

    Every operation of an interpreted program makes a ``tl.tensor`` of a new ``block_type``, and each
    ``block_type(element, shape)`` unwraps its shape, checks every dimension is a power of two, builds a
    ``triton.language.tuple`` for it (with a type of its own) and its name; each tensor then builds a tuple
    of ``constexpr`` of it. And every binary operation's ``broadcast_impl_value`` compares its operands'
    shapes as those tuples, element by element. Together that was a third of a kernel's time under the
    interpreter (CPU profiles of a decode top-n case and the layer's forward + backward on the kernels),
    for values that depend on the shape alone. Here the first ``block_type`` of a shape is built by
    Triton's own ``__init__`` (its checks, its errors) and what it made is kept: a later block type of
    the same dimensions takes the same shape object, numel and name text, and a tensor of it the same
    constexpr shape; a scalar tensor (a loaded value, a loop index) takes one shared empty shape and numel 1,
    which Triton's ``__init__`` builds anew for each. Operands whose block types hold the same shape object, and
    two scalars, are returned as they are, which is what Triton's broadcast returns for them (any other pair
    goes through Triton's). The shared objects are never changed in place by the interpreter. Where this Triton lacks the pieces
    (``block_type.__init__``, ``tensor.__init__``, ``TritonSemantic.broadcast_impl_value``), nothing is
    changed and False is returned."""
    import builtins

    try:
        import triton.language.core as core
        from triton.language import semantic
    except ImportError:
        return False
    bt, tensor, sem = core.block_type, core.tensor, getattr(semantic, "TritonSemantic", None)
    if sem is None or not all("__init__" in vars(c) for c in (bt, tensor)) \
            or "broadcast_impl_value" not in vars(sem) or getattr(core, "tuple", None) is None:
        return False
    if getattr(bt.__init__, "__nsa_once__", False):
        return True
    constexpr, shape_tuple = core.constexpr, core.tuple
    block_init, tensor_init, broadcast = bt.__init__, tensor.__init__, sem.broadcast_impl_value
    # dims -> (shape object, numel, name text, a tensor's constexpr numel, a tensor's constexpr shape), and the
    # same by id(shape object): the objects live in these entries, so their ids stay theirs
    by_dims: dict[builtins.tuple, builtins.tuple] = {}
    by_shape: dict[int, builtins.tuple] = {}

    @functools.wraps(block_init)
    def init_once(self, element_ty, shape):
        hit = by_shape.get(id(shape))                   # a shape taken from another block type of it
        if hit is None:
            if not isinstance(shape, (list, shape_tuple)):
                return block_init(self, element_ty, shape)      # Triton's assertion
            dims = builtins.tuple(s.value if isinstance(s, constexpr) else s for s in shape)
            if not all(d.__class__ is int for d in dims):   # a float, a tensor: Triton's check says what
                return block_init(self, element_ty, shape)
            hit = by_dims.get(dims)
            if hit is None:
                block_init(self, element_ty, shape)     # Triton's checks; raises on a bad shape
                by_dims[dims] = by_shape[id(self.shape)] = (self.shape, self.numel, str(self.shape),
                                                            constexpr(self.numel),
                                                            shape_tuple([constexpr(s) for s in self.shape]))
                return
        self.element_ty = element_ty
        self.shape, self.numel, text, _, _ = hit
        self.name = f"<{text}, {element_ty}>"

    scalars = (core.dtype, core.pointer_type)
    no_shape = (constexpr(1), shape_tuple([]))     # a scalar tensor's numel and shape

    @functools.wraps(tensor_init)
    def tensor_once(self, handle, type):
        cls = type.__class__
        if cls is bt:
            kept = by_shape.get(id(type.shape))
            if kept is not None:
                self.handle, self.type, self.dtype = handle, type, type.element_ty
                _, _, _, self.numel, self.shape = kept
                return
        elif cls in scalars:
            self.handle, self.type, self.dtype = handle, type, type.scalar
            self.numel, self.shape = no_shape
            return
        tensor_init(self, handle, type)

    @functools.wraps(broadcast)
    def broadcast_unless_equal(self, lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if lt.__class__ is bt and rt.__class__ is bt and lt.shape is rt.shape:
            return lhs, rhs
        if not (lt.is_block() or rt.is_block()):
            return lhs, rhs                 # two scalars: Triton's returns them as they are
        return broadcast(self, lhs, rhs)
    init_once.__nsa_once__ = True
    bt.__init__, tensor.__init__, sem.broadcast_impl_value = init_once, tensor_once, broadcast_unless_equal
    return True


def numpy_dtypes_once() -> bool:
    """Make Triton's interpreter look a numpy dtype up in a table it builds once, not at every call.

    ``_get_np_dtype`` (the numpy type of a Triton type: every load, store, cast, splat and constant) builds
    its table of eighteen types each time it is called: ~7% of a kernel's time under the interpreter. Here
    the answer for a scalar type, or a block of one, is Triton's own, kept by the type's name (Triton's
    types are equal when their names are); pointers and any other type go to Triton's function. Where this
    Triton lacks ``_get_np_dtype``, nothing is changed and False is returned."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    find = getattr(ti, "_get_np_dtype", None)
    if find is None:
        return False
    if getattr(find, "__nsa_once__", False):
        return True
    bt, scalar = ti.tl.block_type, ti.tl.dtype
    kept: dict[str, object] = {}

    @functools.wraps(find)
    def find_once(tt_dtype):
        el = tt_dtype.element_ty if tt_dtype.__class__ is bt else tt_dtype
        if el.__class__ is not scalar:
            return find(tt_dtype)
        np_dtype = kept.get(el.name)
        if np_dtype is None:
            np_dtype = kept[el.name] = find(el)
        return np_dtype
    find_once.__nsa_once__ = True
    ti._get_np_dtype = find_once
    return True


def operand_types_once() -> bool:
    """Make Triton's interpreter decide a binary operation's operand types once per pair of types.

    Every ``+``, ``*``, comparison and ``tl.where`` of a kernel goes through ``binary_op_type_checking_impl``,
    which checks pointers, finds the computation type (``computation_type_impl``), builds a constant for a
    Python number (on triton 3.8 twice: its own type's, then the computation type's), casts and broadcasts. The
    type decisions depend on the operands' types, which operand is a number, and the call's flags alone, yet
    were made again at every operation: with the rest of that function, a third of an index-heavy kernel's
    time under the interpreter (the decode step's parity case at S=128: 10.8 of 28 s). Here they are kept per
    key; a number becomes one constant of the computation type, with Triton's range checks, and a tensor is
    cast only where its type differs (Triton's ``cast`` returns it as it is then). Only operands that are
    Triton tensors or plain ``int``/``float`` take this path; any other call (bools, numpy numbers, two
    numbers) is Triton's. At a process's first binary operation the path is compared with Triton's own
    function over every pair of the kernels' operand kinds (``_same_as_triton``: results' types and values,
    errors' messages; ~0.1 s): where one differs, Triton's is kept for the process, and
    ``operand_types_once.why`` says why. Where this Triton lacks the pieces (``interpreter_semantic``,
    ``computation_type_impl``, ``to_tensor_type``, ``check_ptr_type_impl``, ...), nothing is changed and False
    is returned."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    sem = getattr(ti, "interpreter_semantic", None)
    names = ("binary_op_type_checking_impl", "computation_type_impl", "to_tensor_type", "check_ptr_type_impl",
             "scalar_constant", "to_tensor", "cast", "broadcast_impl_value")
    if sem is None or not all(hasattr(sem, n) for n in names):
        return False
    own = sem.binary_op_type_checking_impl
    if getattr(own, "__nsa_once__", False):
        return True
    tensor = ti.tl.tensor
    decided: dict[tuple, object] = {}         # key -> the computation type, or None where no cast applies
    none = object()

    def checked(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        lc, rc = lhs.__class__, rhs.__class__
        l_num, r_num = lc is int or lc is float, rc is int or rc is float
        if (l_num and r_num) or not (l_num or lc is tensor) or not (r_num or rc is tensor):
            return own(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        lt = sem.to_tensor_type(lhs) if l_num else lhs.type.scalar
        rt = sem.to_tensor_type(rhs) if r_num else rhs.type.scalar
        # a pointer type's name leaves out its address space, which Triton's pointer comparison reads
        key = ((lt.name, lt.address_space) if lt.is_ptr() else lt.name, l_num,
               (rt.name, rt.address_space) if rt.is_ptr() else rt.name, r_num,
               allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        ret = decided.get(key, none)
        if ret is none:                      # Triton's checks; an error is raised again at every call
            sem.check_ptr_type_impl(lt, rt, allow_lhs_ptr)
            sem.check_ptr_type_impl(rt, lt, allow_rhs_ptr)
            ret = None
            if arithmetic_check and not lt.is_ptr() and not rt.is_ptr():
                ret = sem.computation_type_impl(lt, l_num, rt, r_num, div_or_mod)
            decided[key] = ret
        if ret is None:                      # no implicit cast: a number is a constant of its own type
            lhs, rhs = sem.to_tensor(lhs), sem.to_tensor(rhs)
        else:
            lhs = _constant(sem, lhs, ret) if l_num else lhs if lt.name == ret.name else sem.cast(lhs, ret)
            rhs = _constant(sem, rhs, ret) if r_num else rhs if rt.name == ret.name else sem.cast(rhs, ret)
        return sem.broadcast_impl_value(lhs, rhs)

    @functools.wraps(own)
    def first(*args, **kwargs):        # the first binary operation: compare, then keep one path or the other
        sem.binary_op_type_checking_impl = own      # (what the comparison itself calls goes to Triton's)
        try:
            why = _same_as_triton(ti, own, checked)
        except Exception as e:          # the comparison itself failed on this Triton: leave it as it ships
            why = f"{type(e).__name__}: {e}"
        sem.binary_op_type_checking_impl = checked if why is None else own
        operand_types_once.why = why
        return sem.binary_op_type_checking_impl(*args, **kwargs)
    checked.__nsa_once__ = first.__nsa_once__ = True
    checked.__wrapped__ = own
    operand_types_once.why = "not compared yet: no binary operation has run"
    sem.binary_op_type_checking_impl = first
    return True


def _constant(sem, value, dtype):
    """A Python number as a constant of ``dtype``, with Triton's errors for a negative unsigned or out of range."""
    if value < 0 and dtype.is_int_unsigned():
        raise ValueError("Cannot perform a binary operation between an unsigned tensor and a negative scalar. "
                         "Perform a explicit cast on one of them.")
    if dtype.is_int() and not (dtype.get_int_min_value() <= value <= dtype.get_int_max_value()):
        raise ValueError(f"Scalar {value} is out of range for type {dtype}")
    return sem.scalar_constant(value, dtype=dtype)


def _operands(ti, blocks: bool) -> list:
    """Operands of every kind the kernels combine: Python numbers (in and out of int32's range, negative, 0, a
    float beyond fp16's), and a scalar tensor of each type the kernels use and of pointers; with ``blocks``, a
    [2, 4] block of each too, and a [1, 4] one to broadcast."""
    import numpy as np
    tl = ti.tl
    types = [tl.int1, tl.int8, tl.int32, tl.uint32, tl.int64, tl.float16, tl.bfloat16, tl.float32, tl.float64,
             tl.pointer_type(tl.float32), tl.pointer_type(tl.float16), tl.pointer_type(tl.float32, address_space=3)]
    out: list = [0, 3, -5, 2**31 + 5, 2**40, 0.5, 1e300]
    for t in types:
        el = ti._get_np_dtype(t)
        data = (np.arange(8) * 64 if t.is_ptr() else np.arange(8) % 2 if t == tl.int1 else np.arange(-3, 5)).astype(el)
        out.append(tl.tensor(ti.TensorHandle(data[5:6], t), t))
        if blocks:
            out.append(tl.tensor(ti.TensorHandle(data.reshape(2, 4), t), tl.block_type(t, [2, 4])))
    if blocks:
        out.append(tl.tensor(ti.TensorHandle(np.arange(4, dtype=np.int32).reshape(1, 4), tl.int32),
                             tl.block_type(tl.int32, [1, 4])))
    return out


def _same_as_triton(ti, own, fast, blocks: bool = False) -> str | None:
    """None when ``fast`` gives what Triton's ``own`` gives (result types, values, and errors) for every pair of
    ``_operands(ti, blocks)`` but two numbers, under every flag combination the semantic layer passes; else the
    first difference. Without blocks (~0.1 s, each process that installs the patch): the type decisions do not
    depend on an operand's shape, and the broadcast is Triton's either way."""
    import itertools
    import warnings

    import numpy as np
    flags = [(False, False, True, False), (True, True, True, False), (False, False, True, True),
             (True, False, True, False), (False, False, False, False)]

    def run(f, a, b, fl):
        try:
            return f(a, b, *fl)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    ops = _operands(ti, blocks)
    with warnings.catch_warnings(), np.errstate(all="ignore"):     # 1e300 cast to fp16 overflows, in both
        warnings.simplefilter("ignore")
        for a, b in itertools.product(ops, ops):
            if not isinstance(a, ti.tl.tensor) and not isinstance(b, ti.tl.tensor):
                continue                        # two numbers: Triton's own function, on both paths
            for fl in flags:
                want, got = run(own, a, b, fl), run(fast, a, b, fl)
                if isinstance(want, str) or isinstance(got, str):
                    same = want == got
                else:
                    same = all(str(w.type) == str(g.type) and w.handle.data.dtype == g.handle.data.dtype
                               and np.array_equal(w.handle.data, g.handle.data, equal_nan=True)
                               for w, g in zip(want, got))
                if not same:
                    return f"{a!r} {b!r} {fl}: {want!r} vs {got!r}"
    return None


def speed_up() -> None:
    """The patches above, where this Triton's interpreter has what they wrap (``kernels/__init__.py``
    installs them before any launch when the kernels run under the interpreter)."""
    patch_lang_once_per_launch()
    reduce_xor_in_numpy()
    no_dead_overflow_checks()
    block_types_once()
    numpy_dtypes_once()
    operand_types_once()
