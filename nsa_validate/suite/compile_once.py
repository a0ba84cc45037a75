"""Each Triton kernel compiled once per run, not once per process that needs it.

A cold run compiles in every suite process at once; the same kernel, specialised the same way
(the layer, decode, counters and triton suites all run the bf16 forward kernels), would be compiled
by each of them. Wrapped here, ``triton.compiler.compile`` takes a lock named by what it compiles
(the source's hash, the target and the options: the parts of Triton's own cache key) in a folder
of the run: the first process compiles and fills Triton's cache; the others wait on the lock and
then find the kernel in the cache. A process that dies releases its lock (``flock``).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
from pathlib import Path


def _key(src, target, options) -> str | None:
    """What Triton's cache key is made of, hashed; None when this Triton's source has no ``hash``."""
    try:
        parts = [src.hash(), repr(target), repr(sorted((options or {}).items()))]
    except (AttributeError, TypeError):
        return None
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def install(lock_dir: str) -> bool:
    """Wrap ``triton.compiler.compile`` (before any kernel's first launch: each JIT function looks it
    up when it first compiles). False when this Triton has no such function."""
    try:
        import triton.compiler as tc
    except ImportError:
        return False
    compile_ = getattr(tc, "compile", None)
    if compile_ is None:
        return False
    if getattr(compile_, "__nsa_once__", False):     # installed already
        return True
    Path(lock_dir).mkdir(parents=True, exist_ok=True)

    @functools.wraps(compile_)
    def once(src, target=None, options=None, *args, **kwargs):
        key = _key(src, target, options)
        if key is None:
            return compile_(src, target, options, *args, **kwargs)
        fd = os.open(os.path.join(lock_dir, f"{key}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)        # another process compiling it: wait, then hit the cache
            return compile_(src, target, options, *args, **kwargs)
        finally:
            os.close(fd)
    once.__nsa_once__ = True
    tc.compile = once
    return True
