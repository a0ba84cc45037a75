"""What every Triton kernel of the package shares: the log2(e) constant of the exp2-based softmax,
padded tile sizes, the ``tl.dot`` precision per input dtype, the top-n's keys and a top-k over keys
held as sorted runs, tensor descriptors (TMA tile loads) where the hardware has them, and launching
with the first settings the GPU at hand can load (``launch_fitting``)."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from nsa_core import dispatch

LOG2E = 1.4426950408889634                  # softmax runs on exp2: scores are scaled by log2(e)
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)   # the same constant, usable inside kernels


def pow2(x: int, lo: int = 16) -> int:
    """A tile size for x: the next power of two, at least ``lo`` (tl.dot needs 16)."""
    return max(lo, triton.next_power_of_2(x))


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: fp32 inputs must not be rounded to tf32 (the fp32 cases are
    compared at the fp32 floor); fp16/bf16 inputs are exact in either."""
    return "ieee" if dtype == torch.float32 else "tf32"


def fp32_compiled(itemsize: int) -> bool:
    """Whether a launch is fp32 and compiled: its dots are then fp32 FMAs (``precision``), not tensor-core products,
    and at the tiles measured for 16-bit caches they spill and take several times as long to compile, so such
    launches take their smallest tiles. Under the interpreter (nothing compiled, one program at a time) the larger
    tiles run faster (docs/decisions.md, "fp32 at the smallest tiles where compiled")."""
    from kernels.interpreter import interpreting
    return itemsize == 4 and not interpreting()


def cu_or_one(cu_seqlens: torch.Tensor | None, T: int, device) -> tuple[torch.Tensor, int | None]:
    """(cu_seqlens, None); for None, the boundaries [0, T] of one sequence of T tokens (int32) and
    its length T, which a launcher can take as max_seqlen without a device sync."""
    if cu_seqlens is None:
        return torch.tensor([0, T], dtype=torch.int32, device=device), T
    return cu_seqlens, None


def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (8 off a GPU: the interpreter's grids stay small)."""
    dev = torch.device(device)
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8


# -- head dimensions as two power-of-two parts ----------------------------------------------------
# d_k = 192 padded to one 256-wide tile wastes a quarter of every product over it and of the
# registers holding it; as 128 + 64 it wastes nothing.
def head_dim_parts(d: int) -> tuple[int, int]:
    """d as (a, b): a the largest power of two <= d (at least 16), b the rest rounded up to a power
    of two (0 when a covers d): 192 -> (128, 64), 128 -> (128, 0), 20 -> (16, 16)."""
    a = max(16, 1 << (d.bit_length() - 1))
    return a, (0 if d <= a else max(16, triton.next_power_of_2(d - a)))


@triton.jit
def ranks_before(va, ja, vb, jb):
    """Selection order of (score va, block ja) against (vb, jb): True where a comes first, i.e. a
    higher score, or the same score and the lower block (ties to the lower index, the oracle's rule;
    the prefill and decode top-n both use it)."""
    return (va > vb) | ((va == vb) & (ja < jb))


@triton.jit
def block_key(bits, j):
    """(score bits, block j) as one int64 key: the bits (int32, ordered as the scores are) above
    2^31 − 1 − j, so that keys order by score, then by the lower block (``ranks_before``'s order).
    The prefill and decode top-n sort and rank these; the low word unpacks to j as 2^31 − 1 − it."""
    return (bits.to(tl.int64) << 32) | (0x7FFFFFFF - j).to(tl.int64)


# -- the best k of keys held as sorted runs ------------------------------------------------------------
# Triton's own ``tl.topk`` (a bitonic top-k: sort runs of k, then halve the keys by pairs of runs) written over
# keys whose runs are already sorted, so that the steps that sort them are skipped. The steps are Triton's (its
# ``standard.py``, MIT licence): the keys as a hypercube [2] * LOG_N, bit i of a key's index its axis
# LOG_N − 1 − i, a compare-and-swap along one axis through ``xor_sum`` over it.
@triton.jit
def _hyper_bit(N_DIMS: tl.constexpr, I: tl.constexpr):
    """Bit I of the index of each entry of a hypercube [2] * N_DIMS (0 or 1, shaped to broadcast)."""
    return tl.reshape(tl.arange(0, 2), [1] * (N_DIMS - I - 1) + [2] + [1] * I)


@triton.jit
def _hyper_swap(h, flip, N_DIMS: tl.constexpr, I: tl.constexpr):
    """Compare-and-swap of integer keys h [2] * N_DIMS along bit I: each pair ascending where ``flip`` is 0."""
    other = h ^ tl.xor_sum(h, N_DIMS - 1 - I, True)
    return tl.where((h > other) != (flip ^ _hyper_bit(N_DIMS, I)), other, h)


@triton.jit
def _hyper_merge(h, N_DIMS: tl.constexpr, STAGE: tl.constexpr, ORDER: tl.constexpr):
    """Bitonic merge of runs of 2^STAGE: ascending (ORDER 0), descending (1), or alternating by bit STAGE (2)."""
    if ORDER == 2:
        flip = _hyper_bit(N_DIMS, STAGE)
    else:
        flip = ORDER
    for i in tl.static_range(STAGE):
        h = _hyper_swap(h, flip, N_DIMS, STAGE - 1 - i)
    return h


@triton.constexpr_function
def ilog2(n):
    """log2 of a power of two, as a kernel's constexpr."""
    return n.bit_length() - 1


@triton.jit
def topk_of_runs(x, LOG_N: tl.constexpr, LOG_K: tl.constexpr, LOG_R: tl.constexpr):
    """The 2^LOG_K largest of integer keys x [2^LOG_N], largest first, where x is held as runs of 2^LOG_R keys
    each sorted, the even runs ascending and the odd ones descending (LOG_R <= LOG_K < LOG_N): ``tl.topk(x,
    2^LOG_K)`` without its first LOG_R stages. Equal keys are interchangeable, so the result is tl.topk's."""
    h = tl.reshape(x, [2] * LOG_N)
    for i in tl.static_range(LOG_R + 1, LOG_K + 1):        # the runs sorted on to runs of 2^LOG_K
        h = _hyper_merge(h, LOG_N, i, 2)
    for i in tl.static_range(LOG_K + 1, LOG_N + 1):
        # pairs of runs (one ascending, one descending), along the axis of bit LOG_K of the LOG_N + LOG_K + 1 − i
        # left: their larger halves, as one bitonic run each, merged
        h = tl.max(h, axis=LOG_N - i)
        h = _hyper_merge(h, LOG_N + LOG_K - i, LOG_K, 2 if i < LOG_N else 1)
    return tl.reshape(h, [2 ** LOG_K])


@triton.jit
def load_dk(rows, ok, DK: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr):
    """Rows [R] of pointers, each to a d_k vector, loaded as two power-of-two parts: ([R, BDA],
    [R, BDB]), zero where not ``ok`` [R] or past d_k. BDB = 0: one part, returned twice (the
    second is then unused)."""
    offs_a = tl.arange(0, BDA)
    a = tl.load(rows[:, None] + offs_a[None, :], mask=ok[:, None] & (offs_a[None, :] < DK), other=0.0)
    b = a
    if BDB > 0:
        offs_b = BDA + tl.arange(0, BDB)
        b = tl.load(rows[:, None] + offs_b[None, :], mask=ok[:, None] & (offs_b[None, :] < DK), other=0.0)
    return a, b


@triton.jit
def dot_dk(xa, xb, ya, yb, BDB: tl.constexpr, PREC: tl.constexpr):
    """x·yᵀ over both d_k parts (``load_dk``), e.g. q·kᵀ or k·qᵀ: [rows of x, rows of y] fp32."""
    s = tl.dot(xa, tl.trans(ya), input_precision=PREC)
    if BDB > 0:
        s = tl.dot(xb, tl.trans(yb), s, input_precision=PREC)
    return s


@triton.jit
def load_2d(P, base, ok, D: tl.constexpr, BD: tl.constexpr):
    """Row r of the result is P[base[r] : base[r] + D], zero past D and where ``ok`` is False: [rows, BD]."""
    offs = tl.arange(0, BD)
    return tl.load(P + base[:, None] + offs[None, :], mask=ok[:, None] & (offs[None, :] < D), other=0.0)


@triton.jit
def store_2d(P, base, x, ok, D: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr = False):
    """P[base[r] : base[r] + D] = x[r] (cast to P's dtype) where ``ok``. ACC: x is added to what P
    holds (x fp32; the sum rounded once)."""
    if ACC:
        x += load_2d(P, base, ok, D, BD).to(tl.float32)
    offs = tl.arange(0, BD)
    tl.store(P + base[:, None] + offs[None, :], x.to(P.dtype.element_ty), mask=ok[:, None] & (offs[None, :] < D))


@triton.jit
def store_dk(P, base, xa, xb, ok, DK: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, ACC: tl.constexpr = False):
    """``store_2d`` of d_k-wide rows held as two parts (``load_dk``): P[base[r] : base[r] + DK] =
    [xa[r], xb[r]] where ``ok``; BDB = 0: xa alone. ACC: added to what P holds."""
    store_2d(P, base, xa, ok, DK, BDA, ACC)
    if BDB > 0:
        store_2d(P + BDA, base, xb, ok, DK - BDA, BDB, ACC)


# -- attention backward, shared by the selection and compressed/window kernels -----------------
# Both take scores s (or sᵀ) already scaled to log2 units and masked to -inf where a key is out of
# sight (a score the forward never saw must not overflow exp2), and the rows' lse2 = lse·log2(e)
# and delta = rowsum(dO ∘ O).
#
# A branch whose output enters the layer as g·O (the gated mix) and gets the mix's dO: its own
# dO is g·dO, so dS = P ∘ (g·dO·Vᵀ − g·delta) = (g·P) ∘ (dO·Vᵀ − delta) and dV = (g·P)ᵀ·dO, with
# delta = rowsum(dO ∘ O) (which is also the gate's gradient). g·P = exp2(s − (lse2 − log2 g)):
# the gate folds into each row's lse, and the loops run unchanged (``gated_lse``).
@triton.jit
def gated_lse(lse, GATE, gbase, ok):
    """The rows' lse (natural log, [rows] fp32) less ln g, g the branch's gate of each row at GATE
    + gbase [rows] (g = 0: +inf, so P = 0)."""
    return lse - tl.log(tl.load(GATE + gbase, mask=ok, other=1.0).to(tl.float32))


@triton.jit
def dq_update(dqa, dqb, s, ka, kb, v, do, lse2, delta, BDB: tl.constexpr, PREC: tl.constexpr):
    """dq += dS·K for one tile of keys, query-major: s [rows, keys]; ka/kb [keys, BDA|BDB]; v
    [keys, BDV]; do [rows, BDV]; lse2, delta [rows]. dS = P ∘ (dO·Vᵀ − delta), P = exp2(s − lse2)."""
    p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = (p * (dp - delta[:, None])).to(ka.dtype)
    dqa += tl.dot(ds, ka, input_precision=PREC)
    if BDB > 0:
        dqb += tl.dot(ds, kb, input_precision=PREC)
    return dqa, dqb


@triton.jit
def dkdv_update(dka, dkb, dv, st, v, qa, qb, do, lse2, delta, BDB: tl.constexpr, PREC: tl.constexpr):
    """dk += dSᵀ·Q, dv += Pᵀ·dO for one tile of keys against a tile of query rows, key-major: st
    [keys, rows] = (k·qᵀ) scores, so Pᵀ and dSᵀ come out in the layout the products take and no
    computed tile is transposed in registers (only the loaded dO is read transposed); v [keys,
    BDV]; qa/qb [rows, BDA|BDB]; do [rows, BDV]; lse2, delta [rows]."""
    pt = tl.exp2(st - lse2[None, :])
    dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
    dst = (pt * (dpt - delta[None, :])).to(qa.dtype)
    dka += tl.dot(dst, qa, input_precision=PREC)
    if BDB > 0:
        dkb += tl.dot(dst, qb, input_precision=PREC)
    return dka, dkb, dv


# -- tensor descriptors (TMA) -----------------------------------------------------------------
# Hopper's copy engine loads a whole tile per instruction and zero-fills past the tensor's edges;
# a kernel's descriptor path reads the same bytes as its pointer path (the tests compare them on
# every setting, ``forced_config``). Descriptor loads made the compressed forward faster than pointer
# loads (docs/decisions.md).
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:                    # a triton without host-side descriptors: pointer paths only
    TensorDescriptor = None


def descriptors_usable(*tensors: torch.Tensor) -> bool:
    """Can kernels load these tensors through tensor descriptors here? On a GPU: sm90 or newer
    (TMA is Hopper's); on the CPU: when the interpreter's descriptor loads ran right (probed,
    ``kernels.interpreter.descriptors``). Every tensor needs a 16-byte aligned base and strides
    and a contiguous last dimension (TMA's rules), and none may be empty."""
    if TensorDescriptor is None or not tensors:
        return False
    dev = tensors[0].device
    if dev.type == "cuda":
        if torch.cuda.get_device_capability(dev) < (9, 0):
            return False
    else:
        from kernels.interpreter import descriptors
        if descriptors() is not None:
            return False
    for x in tensors:
        size = x.element_size()
        if not x.numel() or x.data_ptr() % 16 or x.stride(-1) != 1 or any(st * size % 16 for st in x.stride()[:-1]):
            return False
    return True


def descriptor(x: torch.Tensor, block: list[int]):
    """A descriptor of all of ``x`` loading ``block``-shaped tiles (zero past x's edges)."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block)


def descriptors_dk(x: torch.Tensor, rows: int, BDA: int, BDB: int):
    """Descriptors of x [rows, heads, d_k] (queries or keys) loading [rows, 1, BDA] and
    [rows, 1, BDB] tiles: its two d_k parts (``head_dim_parts``; the second loads from column BDA).
    BDB = 0: the first, twice."""
    a = descriptor(x, [rows, 1, BDA])
    return a, (descriptor(x, [rows, 1, BDB]) if BDB else a)


def gate_args(gate, dgate, lse: torch.Tensor):
    """What a backward launcher hands its dq kernel for a gated branch (``gated_lse``): (GATE, DG,
    LSEG, gate strides (t, h)) with LSEG a fresh [T, H] buffer the dq kernel fills with lse − ln g
    for the dk/dv kernel to read as its lse; ungated (gate None): placeholders and LSEG = lse.
    gate and dgate [T, H] must share strides (the kernel indexes both with one pair)."""
    if gate is None:
        return lse, lse, lse, 0, 0
    if dgate is None or gate.shape != lse.shape or dgate.stride() != gate.stride():
        raise ValueError(f"gate and dgate must both be [T, H] = {list(lse.shape)} with the same strides")
    return gate, dgate, torch.empty_like(lse), gate.stride(0), gate.stride(1)


def usable(configs: list[dict], tma: bool) -> list[dict]:
    """The launch settings this call can run: those marked ``"tma": True`` only when descriptors
    are usable."""
    return [c for c in configs if tma or not c.get("tma")]


# -- launch settings that fit the GPU at hand --------------------------------------------------
# A kernel's launch settings were measured on one GPU (its ``launch_configs`` docstring says
# which); a GPU with less shared memory per block (sm80: 163 KiB, sm86/sm89: 99 KiB; sm90: 227 KiB)
# cannot load the same tiles. Each launcher therefore lists the measured settings first and smaller
# ones after, and runs the first that this GPU can load. Triton raises OutOfResources when it loads
# the compiled kernel, before anything runs, so moving on is safe.
try:
    from triton.runtime import OutOfResources
except ImportError:                    # a triton without it never raises it
    class OutOfResources(Exception):   # type: ignore[no-redef]
        pass

_FITS: dict[tuple, int] = {}           # (kernel, device, specialisation) -> the index that loaded
_FORCED: list[int] = []                # tests: start from this index (``forced_config``)


def launch_fitting(kernel: str, spec: tuple, configs: list[dict], launch):
    """``launch(config)`` with the first of ``configs`` (a copy) that this GPU loads, remembered
    per (kernel, spec: device and specialisation); the last one's OutOfResources propagates. A
    launch that needed smaller settings than the measured ones shows in the dispatch log
    (``kernel/<kernel>@settings<i>``), and so in routing.json. Returns what ``launch`` returned."""
    key = (kernel, *spec)
    start = min(_FORCED[-1] if _FORCED else _FITS.get(key, 0), len(configs) - 1)
    for i in range(start, len(configs)):
        try:
            out = launch(dict(configs[i]))
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _FITS[key] = i
        if i:
            dispatch.note("kernel", f"{kernel}@settings{i}", "triton")
        return out


@contextmanager
def forced_config(index: int):
    """``with forced_config(i):`` launches start from settings i (so a test on any machine runs
    the smaller settings a smaller GPU would)."""
    _FORCED.append(index)
    try:
        yield
    finally:
        _FORCED.pop()
