"""Triton kernels (selection fwd/bwd, decode) and FA-2 varlen wrappers for NSA.

Importing this package registers each available implementation with ``nsa_core.routing``.
(The import name ``kernels`` is shared with an unrelated PyPI distribution; ``nsa-validate env``
checks that it resolves to this repo.)
"""
