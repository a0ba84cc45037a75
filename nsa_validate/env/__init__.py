"""What this machine is and can do: the torch / triton / flash-attn / CUDA pairing check
(``envcheck``) and whether Triton kernels run compiled or under the interpreter (``interpret``)."""
