"""Triton kernels (selection fwd/bwd, decode) and FA-2 varlen wrappers for NSA.

Importing this package registers each implementation with ``nsa_core.routing`` (see
``kernels/routes.py``); one that cannot run here is registered with the reason, so the routing
decision says why it fell back. (The import name ``kernels`` is shared with an unrelated PyPI
distribution; ``nsa-validate env`` checks that it resolves to this repo.)
"""
from kernels import interpreter

if interpreter.interpreting():       # before any launch: the interpreter's repeated patching and element loops
    interpreter.speed_up()

from kernels import routes  # noqa: E402,F401  (registers the implementations)
