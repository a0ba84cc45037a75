"""Which CUDA kernels the GPU actually ran: the evidence a parity or bench case rests on.

The dispatch log (``nsa_core.routing.note``) records what our own code says it ran; a wrapper that
silently called another implementation but noted the intended one would pass every parity case
(both are correct) and every dispatch check. So on a GPU each case also watches the kernels the
device executed (``torch.profiler``, i.e. CUPTI) and asserts the expected ones by name: our Triton
kernels, flash-attn's own kernels (namespace ``flash::``, not PyTorch's bundled
``pytorch_flash::`` copy), a fused SDPA kernel rather than the math path, PyTorch's varlen kernel.
Kernels are attributed to the module's branches through the ``nsa:<phase>/<branch>`` ranges that
``NSAAttention`` opens around each branch (``record_function``). On a CPU there are no CUDA
kernels: the dispatch log remains the evidence, and the report says so.
"""
from __future__ import annotations

import functools
import re
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

# expected kernel families: name -> regex on the CUDA kernel's (demangled) name
EXPECT = {
    # the selection branch's forward: per token from n·l' on, its dense prefix before (kernels/branches.py)
    "triton:sel_fwd": r"^_(sel|prefix)_fwd_kernel\b",
    "triton:prefix_fwd": r"^_prefix_fwd_kernel\b",
    "triton:sel_bwd": r"^_sel_(dq|dkdv|dkdv_reduce)_kernel\b",
    # the decode step's launches (kernels/decode.py: LAUNCHES), the append fused into the first
    "triton:decode": r"^_(cmp_partial|scores|topn|winsel_partial|merge)_kernel\b",
    "triton:cmp_fwd": r"^_cmp_fwd_kernel\b",
    "triton:cmp_bwd": r"^_cmp_(dq|dkdv)_kernel\b",
    "triton:select": r"^_score_topn_kernel\b",
    # the window branch runs the compressed-attention kernels with their WINDOW bound set
    "triton:win_fwd": r"^_cmp_fwd(_mix)?_kernel\b",
    "triton:win_bwd": r"^_cmp_(dq|dkdv)_kernel\b",
    # the layer's one op (kernels/branches.py) runs the mix's forward inside the window kernel
    "triton:mix": r"^_mix_(fwd|bwd)_kernel\b|^_cmp_fwd_mix_kernel\b",
    "triton:win_mix": r"^_cmp_fwd_mix_kernel\b",
    # flash-attn's own build: flash::flash_fwd_kernel / flash_fwd_splitkv_kernel / flash_bwd_*;
    # PyTorch's bundled copy is pytorch_flash::..., which must not count as flash-attn
    "flash_attn": r"(?<![A-Za-z0-9_])flash::flash_(fwd|bwd)",
    "varlen": r"pytorch_flash::flash_(fwd|bwd)|fmha|cudnn.*(sdpa|fmha|flash)",
    "sdpa_fused": r"pytorch_flash::flash_|fmha_cutlass|PyTorchMemEffAttention|cudnn.*(sdpa|fmha|flash)|"
                  r"(?<![A-Za-z0-9_])flash::flash_",
}
from nsa_core.routing import RANGE_PREFIX


def family(phase: str, branch: str, backend: str) -> str | None:
    """The kernel family a dispatch-log entry promises (None: the torch path, no one kernel)."""
    if backend == "triton":
        if phase == "decode":
            return "triton:decode"
        return {"sel_bwd": "triton:sel_bwd", "cmp": "triton:cmp_fwd", "cmp_fwd": "triton:cmp_fwd",
                "cmp_bwd": "triton:cmp_bwd", "select": "triton:select",
                "win": "triton:win_fwd", "win_fwd": "triton:win_fwd", "win_bwd": "triton:win_bwd",
                "win_fwd+mix": "triton:win_mix", "prefix_fwd": "triton:prefix_fwd", "prefix_bwd": "triton:cmp_bwd",
                "mix": "triton:mix", "mix_fwd": "triton:mix", "mix_bwd": "triton:mix"}.get(branch, "triton:sel_fwd")
    if backend.startswith("fa2:"):
        name = backend.split(":", 1)[1]
        if name == "auto":
            from kernels import fa2
            name = fa2.resolve("auto") or "auto"
        return name if name in EXPECT else None
    return None


class KernelLog:
    """Kernel names observed in a block: ``names`` (all), ``by_range`` ({"prefill/sel": names})."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.names: Counter = Counter()
        self.by_range: dict[str, Counter] = {}

    def collect(self, prof) -> None:
        from torch.autograd import DeviceType
        events = prof.events()
        for e in events:
            if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset", RANGE_PREFIX)):
                self.names[e.name] += 1

        def kernels_under(e) -> Counter:
            c = Counter(k.name for k in getattr(e, "kernels", []) if not k.name.startswith(("Memcpy", "Memset")))
            for child in getattr(e, "cpu_children", []):
                c += kernels_under(child)
            return c
        for e in events:
            if e.device_type == DeviceType.CPU and e.name.startswith(RANGE_PREFIX):
                key = e.name[len(RANGE_PREFIX):]
                self.by_range[key] = self.by_range.get(key, Counter()) + kernels_under(e)

    def matching(self, expect: str, key: str | None = None) -> list[str]:
        names = self.names if key is None else self.by_range.get(key, Counter())
        return sorted(n for n in names if re.search(EXPECT[expect], n))


def short(name: str, width: int = 90) -> str:
    """A kernel name without its template arguments, for tables."""
    base = re.sub(r"<.*>", "<…>", name)
    return base if len(base) <= width else base[:width - 1] + "…"


@contextmanager
def observe(device: str) -> Iterator[KernelLog]:
    """Watch the CUDA kernels launched inside the block (inactive on a CPU)."""
    log = KernelLog(active=device == "cuda")
    if not log.active:
        yield log
        return
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield log
        torch.cuda.synchronize()
    log.collect(prof)


@functools.cache
def ready(device: str) -> None:
    """Start the kernel watcher once in this process (``observe`` with nothing inside): its first start
    sets up the profiler's CUDA tracing, ~2 s on an H200, which a timed case's body should not pay
    while it holds the GPU alone (the suite plugin calls this in such a case's setup)."""
    with observe(device):
        pass
