"""The Triton kernels a suite process compiled, written down so that another process can compile
them again before they are needed (``nsa_validate.run.prewarm``).

A JIT function compiles at the first launch of each specialization it meets (the argument dtypes,
the 16-byte alignment of pointers, the integers' divisibility, the constexprs and launch options).
``record`` wraps ``JITFunction.run``: a launch (or a compile without one, ``JITFunction.warmup``) during
which ``triton.compiler.compile`` was called appends one JSON line to the run's ``kernels.jsonl`` — the
function (``module:qualname``), its positional and keyword arguments with every tensor replaced by its
dtype and alignment, every tensor descriptor by its dtype, shape, strides and block, and every scalar
kept as it was (its value is what Triton specialises on). ``warm`` replays one line through
``JITFunction.warmup``, Triton's public compile-without-launch: the same specialization, so the same cache
entry; then it builds the kernel's launcher, which a first launch would build next.
A line this code cannot replay any more (a kernel renamed, its arguments changed) fails there,
alone: the suites then compile that kernel themselves, as they would without the list.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import threading
import time

_state = threading.local()


class _Unrecordable(Exception):
    pass


def _encode(x):
    import torch
    if isinstance(x, torch.Tensor):
        return {"tensor": str(x.dtype).removeprefix("torch."), "aligned": x.data_ptr() % 16 == 0}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.dtype):
        return {"torch_dtype": str(x).removeprefix("torch.")}
    if (isinstance(x, _Pointer) or type(x).__name__ == "MockTensor") and isinstance(x.dtype, torch.dtype):
        # a tensor as ``JITFunction.warmup`` passes it (a compile without a launch: a kernel asking how it compiles,
        # ``kernels.decode._fits_per_sm``), or as ``warm`` does: the same specialization as a tensor's
        return {"tensor": str(x.dtype).removeprefix("torch."), "aligned": x.data_ptr() % 16 == 0}
    if isinstance(x, tuple):
        return {"tuple": [_encode(v) for v in x]}
    import dataclasses
    if type(x).__name__ == "TensorDescriptor" and dataclasses.is_dataclass(x):
        fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.name != "base"}
        fields = {k: list(v) if isinstance(v, (list, tuple, torch.Size)) else v for k, v in fields.items()}
        return {"descriptor": str(x.base.dtype).removeprefix("torch."), **fields}
    import triton.language as tl
    if isinstance(x, tl.dtype):
        return {"tl_dtype": str(x)}
    if isinstance(x, tl.constexpr):
        return _encode(x.value)
    raise _Unrecordable(type(x).__name__)


class _Pointer:
    """A tensor as Triton's specialization sees it: a dtype and an address (0: 16-byte aligned)."""

    def __init__(self, dtype, aligned: bool):
        self.dtype, self._ptr = dtype, 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr


def _decode(x):
    import torch
    if not isinstance(x, dict):
        return x
    if "tensor" in x:
        return _Pointer(getattr(torch, x["tensor"]), x["aligned"])
    if "torch_dtype" in x:
        return getattr(torch, x["torch_dtype"])
    if "tuple" in x:
        return tuple(_decode(v) for v in x["tuple"])
    if "descriptor" in x:
        import dataclasses
        from triton.tools.tensor_descriptor import TensorDescriptor
        known = {f.name for f in dataclasses.fields(TensorDescriptor)}
        fields = {k: v for k, v in x.items() if k != "descriptor" and k in known}
        return TensorDescriptor(_Pointer(getattr(torch, x["descriptor"]), True), **fields)
    if "tl_dtype" in x:
        import triton.language as tl
        return tl.dtype(x["tl_dtype"])
    raise ValueError(f"unknown argument encoding {x!r}")


def record(path: str, suite: str) -> bool:
    """Append every launch of this process that compiled to ``path`` (JSON lines, each written in
    one ``write`` so the run's processes can share the file). Call it before the first launch.
    False when this Triton has no ``JITFunction.run`` or ``triton.compiler.compile`` to wrap."""
    try:
        import triton.compiler as tc
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    if not hasattr(tc, "compile") or not hasattr(JITFunction, "run"):
        return False
    if getattr(JITFunction.run, "__nsa_launches__", False):
        return True
    compile_, run = tc.compile, JITFunction.run
    seen: set[str] = set()
    t0 = time.monotonic()

    @functools.wraps(compile_)
    def compile_noted(*args, **kwargs):
        stack = getattr(_state, "stack", None)
        t = time.perf_counter()
        try:
            return compile_(*args, **kwargs)
        finally:
            if stack:
                stack[-1] += time.perf_counter() - t

    @functools.wraps(run)
    def run_noted(self, *args, **kwargs):
        stack = _state.__dict__.setdefault("stack", [])
        stack.append(0.0)
        try:
            return run(self, *args, **kwargs)
        finally:
            took = stack.pop()
            if took:        # a compile without a launch (``warmup``) too: the launch that follows finds it compiled
                _note(path, seen, suite, self, args, kwargs, round(time.monotonic() - t0, 2), took)
    run_noted.__nsa_launches__ = True
    tc.compile = compile_noted
    JITFunction.run = run_noted
    return True


def _note(path: str, seen: set[str], suite: str, fn, args, kwargs, at: float, took: float) -> None:
    kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    try:
        entry = {"fn": f"{fn.fn.__module__}:{fn.fn.__qualname__}", "args": [_encode(a) for a in args],
                 "kwargs": {k: _encode(v) for k, v in kwargs.items()}}
    except _Unrecordable:
        return
    k = key(entry)
    if k in seen:
        return
    seen.add(k)
    line = json.dumps({**entry, "suite": suite, "at_s": at, "compile_s": round(took, 3)}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:            # a full disk: the list is a later run's head start, never this launch's failure
        pass


def key(entry: dict) -> str:
    """What identifies a launch's specialization in a line (not who recorded it, or when)."""
    return json.dumps({k: entry[k] for k in ("fn", "args", "kwargs")}, sort_keys=True)


def compile_key(entry: dict) -> str:
    """What a line compiles to: ``key`` with each integer argument of a plain (not constexpr) parameter
    replaced by what Triton specialises it on (its type, 32- or 64-bit by its value, and 1, a multiple of 16 or
    any other; the type alone where the parameter is ``do_not_specialize``), each such float by its type, and a
    tensor descriptor by its dtype and block shape, not its shape or strides: as Triton 3.6, 3.8 and 3.9
    specialise them (``tests/harness/test_prewarm.py`` asks Triton), so that two lines of one compile_key share a compile.
    ``key`` itself where the kernel does not import."""
    try:
        order, const, plain = _parameters(entry["fn"])
    except Exception:                  # noqa: BLE001  a line the code has outgrown
        return key(entry)

    def spec(name: str | None, v):
        if name is None or name in const or isinstance(v, bool):
            return v
        if isinstance(v, int):
            return int_class(v, name not in plain)
        if isinstance(v, dict) and "descriptor" in v:
            return {f: x for f, x in v.items() if f not in ("shape", "strides")}
        return "float" if isinstance(v, float) else v
    args = [spec(order[i] if i < len(order) else None, v) for i, v in enumerate(entry["args"])]
    kwargs = {k: spec(k, v) for k, v in entry["kwargs"].items()}
    return json.dumps({"fn": entry["fn"], "args": args, "kwargs": kwargs}, sort_keys=True)


def int_class(v: int, specialised: bool = True) -> str:
    """What Triton compiles an integer argument as: 1 (a constant), else its type (i32 from −2³¹ to 2³¹ − 1, i64
    above, u64 from 2⁶³) and, where ``specialised``, whether it is a multiple of 16."""
    if specialised and v == 1:
        return "1"
    kind = "i32" if -2 ** 31 <= v < 2 ** 31 else "u64" if v >= 2 ** 63 else "i64"
    return kind + ("%16" if specialised and v % 16 == 0 else "")


@functools.lru_cache(maxsize=None)
def _parameters(name: str) -> tuple[list[str], set[str], set[str]]:
    """A JIT function's parameters in order, its constexprs and its ``do_not_specialize`` ones (from the
    Python function: the interpreter's functions have no ``params``); once a function, not once a line."""
    import inspect
    fn = _function(name)
    sig = inspect.signature(fn.fn).parameters
    order = list(sig)
    const = {n for n, q in sig.items() if "constexpr" in str(q.annotation)}
    plain = {order[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", None) or ()}
    return order, const, plain


def _function(name: str):
    """``module:qualname`` -> the JIT function."""
    module, _, qual = name.partition(":")
    fn = importlib.import_module(module)
    for part in qual.split("."):
        fn = getattr(fn, part)
    return fn


def read(path) -> list[dict]:
    """The distinct launches of a ``kernels.jsonl``, earliest first (a line cut short by a killed
    writer is skipped)."""
    out: dict[str, dict] = {}
    try:
        text = open(path, encoding="utf-8").read()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            e = json.loads(line)
            k = key(e)
        except (ValueError, KeyError, TypeError):
            continue
        if k not in out or e.get("at_s", 0) < out[k].get("at_s", 0):
            out[k] = e
    return sorted(out.values(), key=lambda e: e.get("at_s", 0))


def compiled(entry: dict):
    """``entry``'s launch compiled (into Triton's cache) for the active driver's target, not loaded: Triton's
    compiled kernel (its ``asm``, ``metadata``). Raises what Triton or the import raises when the line no
    longer fits the code."""
    fn = _function(entry["fn"])
    return fn.warmup(*[_decode(a) for a in entry["args"]], grid=(1,),
                     **{k: _decode(v) for k, v in entry["kwargs"].items()})


def compile_only() -> None:
    """For a process that compiles launches and runs none (a warming process), torch imported first (Triton's
    driver then asks torch for the device; without torch, Triton 3.8's own asks CUDA, with a context): Triton's
    warm-up still asks torch for the current stream, which starts a CUDA context; the stream is never used,
    so 0 instead. Contexts are made one at a time by the driver, and the suites' processes make theirs
    meanwhile."""
    with contextlib.suppress(Exception):       # a Triton without the attribute: its own stream, as before
        from triton.runtime import driver
        driver.active.get_current_stream = lambda *device: 0


def warm(entry: dict) -> None:
    """Compile ``entry``'s launch (into Triton's cache) without running it (``compiled``), and build the
    launcher its first launch would (Triton 3.6: a C stub per signature, gcc's seconds; later Tritons build
    none), without loading the kernel onto the GPU: that would give each warming process a CUDA context
    (the suites' processes load their own kernels anyway)."""
    kernel = compiled(entry)
    from triton.runtime import driver
    launcher = getattr(driver.active, "launcher_cls", None)
    if launcher is not None and hasattr(kernel, "src") and hasattr(kernel, "metadata"):
        launcher(kernel.src, kernel.metadata)
        return
    init = getattr(kernel, "_init_handles", None)      # a Triton without them: what its first launch does
    if callable(init):
        init()
