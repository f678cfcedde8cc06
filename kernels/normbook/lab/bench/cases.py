"""The benchmark's cases: shapes, the bytes each case must move, and the functions
compared.

Each case is a small function that builds its inputs and its providers (this package's
kernel, the PyTorch formula as Hugging Face writes it, Liger-Kernel when installed). A
case whose kernel does not exist yet (ImportError / AttributeError, or a kernel without
a backward) raises Skip.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from .. import timing
from ..paths import DATA

#: The recorded runs (a test points it at its fixture).
DATA_DIR = DATA / "bench"

SWEEP = [256 * 2**i for i in range(11)]  # 256 … 262,144
# elements per row-sized tensor: M = ELEMENTS // N rows
ELEMENTS = 2**26
SMOKE_SWEEP = [256, 1024]
SMOKE_ELEMENTS = 2**12
# qk_norm_rope: Qwen3's head_dim; N = heads · HEAD_DIM
HEAD_DIM = 128
GQA_GROUP = 4  # qk_norm_rope: query heads per key head
# Decode: a few rows (tokens) of a model's hidden size, where a GPU must be filled from
# few rows.
DECODE_M = (1, 8, 64)
DECODE_N = (4096, 8192)
SMOKE_DECODE = [(1, 1024)]  # the smoke run's decode shape: one row
# decode_attention in the inspector: cached tokens per row
DECODE_CACHE = 4096
DECODE_PAGE = 16  # and its paged cache's block size (vLLM's default)
PROVIDERS = ["normbook", "torch eager", "torch.compile", "liger"]
DO_BENCH = (
    "triton.testing.do_bench (warm-up, median of many runs, L2 flushed before each)"
)
WALL_CLOCK = (
    "wall clock in Triton's CPU interpreter "
    "(smoke run: exercises the code, not a GPU figure)"
)

#: The chapter's targets for bf16 and N >= 4096, as fractions of the measured copy
#: bandwidth.
TARGETS = {"forward": 0.90, "fused add": 0.85, "backward": 0.80}
TARGET_MIN_N = 4096


class Skip(Exception):
    """A case (or a provider) that cannot run here: a kernel not written yet, a missing
    package."""


# ---------------------------------------------------------------- the cases


@dataclass
class Problem:
    """One benchmark instance: inputs, the functions that compute the same thing, and
    its bytes.

    Every provider is called as ``fn(*inputs)``. For a backward case, the inputs at
    ``wrt`` get ``requires_grad`` and the timed call is the backward of ``fn(*inputs)``
    with ``grad_outputs``. ``nbytes`` counts each tensor that must be read or written
    once (timing.bytes_moved).
    """

    inputs: tuple
    nbytes: int
    ours: Callable
    formula: Callable
    liger: Callable | None = None  # None: Liger has no such kernel
    # backward cases: positions of the inputs to differentiate
    wrt: tuple[int, ...] = ()
    grad_outputs: tuple = ()
    # how the row-sized tensors are laid out, for the record
    shape: str = ""


@dataclass
class Case:
    kernel: str
    direction: str  # "forward" | "backward"
    build: Callable[[int, int, torch.dtype, torch.device], Problem]
    target: str = ""  # key of TARGETS
    # Its own (M, N, regime) shapes, given smoke: True/False, instead of the sweep and
    # the decode shapes (decode_attention: M requests, N cached tokens each). None: the
    # default.
    shapes: Callable[[bool], list] | None = None

    @property
    def name(self) -> str:
        return f"{self.kernel}.{self.direction}"


def _kernel(name: str):
    """``kernels.<name>``, or Skip when that kernel has not been written yet."""
    try:
        module = importlib.import_module("normbook")
        return getattr(module, name)
    except (ImportError, AttributeError) as exc:
        raise Skip(
            f"normbook.{name} does not exist yet ({type(exc).__name__})"
        ) from exc


def _liger(module: str, attr: str):
    """A Liger-Kernel autograd Function, or Skip when Liger is not installed (or lacks
    it)."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise Skip("liger-kernel is not installed")
    try:
        return getattr(importlib.import_module(f"liger_kernel.ops.{module}"), attr)
    # an old Liger without the op, or one that fails to import here
    except Exception as exc:
        raise Skip(
            f"liger_kernel.ops.{module}.{attr} unavailable ({type(exc).__name__})"
        ) from exc


def _rand(*shape, dtype, device, scale=1.0):
    """Random normal values: never zeros (a kernel on zeros is trivially 'right', and
    flatters)."""
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _needs_backward(fn, *inputs):
    """Raise Skip if ``fn`` is not differentiable through autograd (its backward not
    written yet)."""
    probe = [
        (t.detach()[:1] if t.dim() > 1 else t.detach())
        .clone()
        # integer inputs (targets) take no gradient
        .requires_grad_(t.is_floating_point())
        # one row is enough to ask
        if isinstance(t, torch.Tensor)
        else t
        for t in inputs
    ]
    out = fn(*probe)
    out = out if isinstance(out, tuple) else (out,)
    if not any(isinstance(o, torch.Tensor) and o.grad_fn is not None for o in out):
        raise Skip("no backward yet (the output has no grad_fn)")


# The PyTorch formulas, written as the Hugging Face modules write them.


def torch_rms_norm(x, weight, eps=1e-6):
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(
        x.dtype
    )


def torch_layer_norm(x, weight, bias, eps=1e-5):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def torch_fused_add_rms_norm(x, residual, weight, eps=1e-6):
    h = x + residual
    return torch_rms_norm(h, weight, eps), h


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def torch_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6):
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    qn, kn = torch_rms_norm(q, q_weight, eps), torch_rms_norm(k, k_weight, eps)
    return qn * c + _rotate_half(qn) * s, kn * c + _rotate_half(kn) * s


def _liger_rms_norm():
    fn = _liger("rms_norm", "LigerRMSNormFunction")
    if "in_place" in inspect.signature(fn.forward).parameters:
        # in_place=False: the default overwrites dy with dx, which would change the
        # timed data.
        return lambda x, w: fn.apply(x, w, 1e-6, 0.0, "llama", False)
    return lambda x, w: fn.apply(x, w, 1e-6)


def build_rms_norm(M, N, dtype, device, backward=False):
    ours = _kernel("rms_norm")
    x, w = _rand(M, N, dtype=dtype, device=device), _rand(N, dtype=dtype, device=device)
    try:
        liger = _liger_rms_norm()
    except Skip as exc:
        liger = exc
    if not backward:
        y = torch.empty_like(x)
        return Problem(
            (x, w),
            timing.bytes_moved(x, w, y),
            lambda x, w: ours(x, w, 1e-6),
            torch_rms_norm,
            liger,
            shape=f"x ({M}, {N})",
        )
    _needs_backward(lambda x, w: ours(x, w, 1e-6), x, w)
    dy = _rand(M, N, dtype=dtype, device=device)
    # Must move: read x, w, dy; write dx and dw.
    nbytes = timing.bytes_moved(x, w, dy, torch.empty_like(x), torch.empty_like(w))
    return Problem(
        (x, w),
        nbytes,
        lambda x, w: ours(x, w, 1e-6),
        torch_rms_norm,
        liger,
        wrt=(0, 1),
        grad_outputs=(dy,),
        shape=f"x ({M}, {N})",
    )


def build_layer_norm(M, N, dtype, device, backward=False):
    ours = _kernel("layer_norm")
    x = _rand(M, N, dtype=dtype, device=device)
    w, b = _rand(N, dtype=dtype, device=device), _rand(N, dtype=dtype, device=device)
    try:
        fn = _liger("layer_norm", "LigerLayerNormFunction")
        liger = lambda x, w, b: fn.apply(x, w, b, 1e-5)  # noqa: E731
    except Skip as exc:
        liger = exc
    call = lambda x, w, b: ours(x, w, b, 1e-5)  # noqa: E731
    if not backward:
        return Problem(
            (x, w, b),
            timing.bytes_moved(x, w, b, torch.empty_like(x)),
            call,
            torch_layer_norm,
            liger,
            shape=f"x ({M}, {N})",
        )
    _needs_backward(call, x, w, b)
    dy = _rand(M, N, dtype=dtype, device=device)
    # Must move: read x, w, dy (b is not needed); write dx, dw and db.
    nbytes = timing.bytes_moved(
        x, w, dy, torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    )
    return Problem(
        (x, w, b),
        nbytes,
        call,
        torch_layer_norm,
        liger,
        wrt=(0, 1, 2),
        grad_outputs=(dy,),
        shape=f"x ({M}, {N})",
    )


def build_fused_add_rms_norm(M, N, dtype, device, backward=False):
    ours = _kernel("fused_add_rms_norm")
    x = _rand(M, N, dtype=dtype, device=device)
    r = _rand(M, N, dtype=dtype, device=device)
    w = _rand(N, dtype=dtype, device=device)
    try:
        fn = _liger("fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
        liger = lambda x, r, w: fn.apply(x, r, w, 1e-6)  # noqa: E731
    except Skip as exc:
        liger = exc
    call = lambda x, r, w: ours(x, r, w, 1e-6)  # noqa: E731
    shape = f"x, residual ({M}, {N})"
    if backward:
        _needs_backward(call, x, r, w)
        dy = _rand(M, N, dtype=dtype, device=device)
        dh = _rand(M, N, dtype=dtype, device=device)
        # Must move: read h (saved), w, dy and the residual stream's gradient dh; write
        # the gradient of x + residual (one tensor for both) and dw.
        nbytes = timing.bytes_moved(
            x, w, dy, dh, torch.empty_like(x), torch.empty_like(w)
        )
        return Problem(
            (x, r, w),
            nbytes,
            call,
            torch_fused_add_rms_norm,
            liger,
            wrt=(0, 1, 2),
            grad_outputs=(dy, dh),
            shape=shape,
        )
    # Must move: read x, residual, w; write y and residual_out.
    nbytes = timing.bytes_moved(x, r, w, torch.empty_like(x), torch.empty_like(x))
    return Problem(
        (x, r, w), nbytes, call, torch_fused_add_rms_norm, liger, shape=shape
    )


def build_qk_norm_rope(M, N, dtype, device):
    """M tokens; N = n_heads · head_dim for the queries, a quarter as many key heads
    (GQA)."""
    ours = _kernel("qk_norm_rope")
    hq = max(1, N // HEAD_DIM)
    hk = max(1, hq // GQA_GROUP)
    q = _rand(1, M, hq, HEAD_DIM, dtype=dtype, device=device)
    k = _rand(1, M, hk, HEAD_DIM, dtype=dtype, device=device)
    qw, kw = (
        _rand(HEAD_DIM, dtype=dtype, device=device),
        _rand(HEAD_DIM, dtype=dtype, device=device),
    )
    angles = torch.arange(M, device=device, dtype=torch.float32)[:, None] * torch.rand(
        HEAD_DIM // 2, device=device
    )
    angles = torch.cat([angles, angles], dim=-1)[None]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    # Must move: read q, k, both weights, cos, sin; write q_out and k_out.
    nbytes = timing.bytes_moved(
        q, k, qw, kw, cos, sin, torch.empty_like(q), torch.empty_like(k)
    )
    return Problem(
        (q, k, qw, kw, cos, sin),
        nbytes,
        lambda q, k, qw, kw, c, s: ours(q, k, qw, kw, c, s, 1e-6),
        torch_qk_norm_rope,
        Skip("Liger has no fused QK-Norm + RoPE"),
        shape=f"q (1, {M}, {hq}, {HEAD_DIM}), k (1, {M}, {hk}, {HEAD_DIM})",
    )


def build_softmax(M, N, dtype, device, backward=False):
    ours = _kernel("softmax")
    x = _rand(M, N, dtype=dtype, device=device)
    formula = lambda x: torch.softmax(x, dim=-1)  # noqa: E731
    try:
        fn = _liger("softmax", "LigerSoftmaxFunction")
        liger = lambda x: fn.apply(x)  # noqa: E731
    except Skip as exc:
        liger = exc
    if not backward:
        return Problem(
            (x,),
            timing.bytes_moved(x, torch.empty_like(x)),
            ours,
            formula,
            liger,
            shape=f"x ({M}, {N})",
        )
    _needs_backward(ours, x)
    dy = _rand(M, N, dtype=dtype, device=device)
    # Must move: read y (saved) and dy; write dx.
    nbytes = timing.bytes_moved(x, dy, torch.empty_like(x))
    return Problem(
        (x,),
        nbytes,
        ours,
        formula,
        liger,
        wrt=(0,),
        grad_outputs=(dy,),
        shape=f"x ({M}, {N})",
    )


def build_cross_entropy(M, N, dtype, device, backward=False):
    """M rows of logits over a vocabulary of N; the mean loss."""
    ours = _kernel("cross_entropy")
    x = _rand(M, N, dtype=dtype, device=device)
    target = torch.randint(0, N, (M,), device=device)
    formula = lambda x, t: torch.nn.functional.cross_entropy(x.float(), t)  # noqa: E731
    liger = Skip("not compared: Liger's cross-entropy writes its gradient in place")
    if not backward:
        # Must move: read the logits (and the targets); the loss is one number.
        return Problem(
            (x, target),
            timing.bytes_moved(x, target),
            ours,
            formula,
            liger,
            shape=f"logits ({M}, {N})",
        )
    _needs_backward(lambda x, t: ours(x, t[: x.shape[0]]), x, target)
    # Must move: read the logits (and targets); write their gradient.
    nbytes = timing.bytes_moved(x, target, torch.empty_like(x))
    return Problem(
        (x, target),
        nbytes,
        ours,
        formula,
        liger,
        wrt=(0,),
        grad_outputs=(torch.ones((), device=device),),
        shape=f"logits ({M}, {N})",
    )


def build_attention(M, N, dtype, device):
    """M tokens in sequences of at most 4096 (causal), N = n_heads · head_dim, GQA as
    above."""
    ours = _kernel("attention")
    hq = max(1, N // HEAD_DIM)
    hk = max(1, hq // GQA_GROUP)
    seq = min(M, 4096)
    batch = max(1, M // seq)
    q = _rand(batch, hq, seq, HEAD_DIM, dtype=dtype, device=device)
    k = _rand(batch, hk, seq, HEAD_DIM, dtype=dtype, device=device)
    v = _rand(batch, hk, seq, HEAD_DIM, dtype=dtype, device=device)

    def formula(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )

    # Must move: read q, k, v; write the output (no score matrix).
    nbytes = timing.bytes_moved(q, k, v, torch.empty_like(q))
    return Problem(
        (q, k, v),
        nbytes,
        lambda q, k, v: ours(q, k, v, causal="top_left"),
        formula,
        Skip("Liger has no attention kernel"),
        shape=f"q ({batch}, {hq}, {seq}, {HEAD_DIM}), k, v ({batch}, {hk}, "
        f"{seq}, {HEAD_DIM})",
    )


def build_attention_backward(M, N, dtype, device):
    """The backward of build_attention's causal GQA attention (dq, dk, dv). The runner
    times the backward alone; its useful work is the four products of a backward that
    had P (dV, dP, dQ, dK: 4 · 2·seq²·d flops per head, halved by the causal mask),
    recorded in ``shape``: TFLOP/s = flop / time, against SDPA's backward on the same
    inputs. At least 64 tokens: with one (a decode shape) dq and dk are exactly 0 and
    both sides return rounding noise, which a check relative to the largest value cannot
    judge."""
    problem = build_attention(max(M, 64), N, dtype, device)
    q, k, v = problem.inputs
    _needs_backward(problem.ours, q, k, v)
    batch, hq, seq, d = q.shape
    flop = 4 * 2 * batch * hq * seq * seq * d // 2
    dout = _rand(*q.shape, dtype=dtype, device=device)
    # Must move: read q, k, v, O, dO (and L, D: one number a row); write dq, dk, dv.
    nbytes = timing.bytes_moved(q, k, v, dout, dout, q, k, v)
    return Problem(
        (q, k, v),
        nbytes,
        problem.ours,
        problem.formula,
        problem.liger,
        wrt=(0, 1, 2),
        grad_outputs=(dout,),
        shape=f"{problem.shape}; backward {flop:.4g} flop (4 products)",
    )


def build_sample(M, N, dtype, device):
    """Greedy sampling (temperature 0), so that the eager formula, argmax, gives the
    same tokens."""
    ours = _kernel("sample")
    x = _rand(M, N, dtype=dtype, device=device)
    # Must move: read the logits; write one index per row.
    nbytes = timing.bytes_moved(x, torch.empty(M, dtype=torch.int64, device=device))
    return Problem(
        (x,),
        nbytes,
        lambda x: ours(x, temperature=0.0),
        lambda x: x.argmax(-1),
        Skip("Liger has no sampling kernel"),
        shape=f"logits ({M}, {N})",
    )


# ---- decode attention (issue 19): M requests of N cached tokens each, Qwen3-8B's heads
# query heads, k/v heads (head_dim HEAD_DIM)
DECODE_ATTENTION_HEADS = (32, 8)
DECODE_ATTENTION_LENGTHS = (1024, 4096, 16384, 32768)


def decode_attention_shapes(smoke: bool) -> list:
    if smoke:
        return [(1, 256, "decode")]
    return [(m, n, "decode") for n in DECODE_ATTENTION_LENGTHS for m in DECODE_M]


def build_decode_attention(M, N, dtype, device):
    """One new token per request over a full contiguous cache of N tokens: SDPA over the
    same cache (one query sees every key: no mask needed) is the formula."""
    ours = _kernel("decode_attention")
    # the smoke run: a small model
    hq, hk = DECODE_ATTENTION_HEADS if N > 256 else (8, 2)
    q = _rand(M, hq, 1, HEAD_DIM, dtype=dtype, device=device)
    k = _rand(M, hk, N, HEAD_DIM, dtype=dtype, device=device)
    v = _rand(M, hk, N, HEAD_DIM, dtype=dtype, device=device)
    lens = torch.full((M,), N, dtype=torch.int32, device=device)

    def formula(q, k, v, lens):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, enable_gqa=True
        )

    # Must move: read q and the whole cache; write the output.
    nbytes = timing.bytes_moved(q, k, v, torch.empty_like(q))
    return Problem(
        (q, k, v, lens),
        nbytes,
        ours,
        formula,
        Skip("Liger has no decode attention kernel"),
        shape=f"q ({M}, {hq}, 1, {HEAD_DIM}), k, v ({M}, {hk}, {N}, {HEAD_DIM})",
    )


CASES = [
    Case(
        "rms_norm",
        "forward",
        lambda M, N, dt, dev: build_rms_norm(M, N, dt, dev),
        "forward",
    ),
    Case(
        "rms_norm",
        "backward",
        lambda M, N, dt, dev: build_rms_norm(M, N, dt, dev, True),
        "backward",
    ),
    Case(
        "layer_norm",
        "forward",
        lambda M, N, dt, dev: build_layer_norm(M, N, dt, dev),
        "forward",
    ),
    Case(
        "layer_norm",
        "backward",
        lambda M, N, dt, dev: build_layer_norm(M, N, dt, dev, True),
        "backward",
    ),
    Case("fused_add_rms_norm", "forward", build_fused_add_rms_norm, "fused add"),
    Case("qk_norm_rope", "forward", build_qk_norm_rope, "forward"),
    Case(
        "softmax",
        "forward",
        lambda M, N, dt, dev: build_softmax(M, N, dt, dev),
        "forward",
    ),
    Case(
        "softmax",
        "backward",
        lambda M, N, dt, dev: build_softmax(M, N, dt, dev, True),
        "backward",
    ),
    Case(
        "cross_entropy",
        "forward",
        lambda M, N, dt, dev: build_cross_entropy(M, N, dt, dev),
    ),
    Case(
        "cross_entropy",
        "backward",
        lambda M, N, dt, dev: build_cross_entropy(M, N, dt, dev, True),
    ),
    Case("attention", "forward", build_attention),
    Case("attention", "backward", build_attention_backward),
    Case("sample", "forward", build_sample),
    Case(
        "decode_attention",
        "forward",
        build_decode_attention,
        shapes=decode_attention_shapes,
    ),
    # the GPU day (kernels/normbook/lab/bench/plan.py)
    Case(
        "fused_add_rms_norm",
        "backward",
        lambda M, N, dt, dev: build_fused_add_rms_norm(M, N, dt, dev, True),
        "backward",
    ),
]


# ---------------------------------------------------------------- swiglu,
# linear_cross_entropy (one block: branch train)


def torch_swiglu(gate, up):
    """The MLP's gate as Hugging Face writes it: ``act_fn(gate_proj(x)) *
    up_proj(x)``."""
    return torch.nn.functional.silu(gate) * up


def build_swiglu(M, N, dtype, device, backward=False):
    """M rows of the MLP's intermediate width N: gate and up."""
    ours = _kernel("swiglu")
    g = _rand(M, N, dtype=dtype, device=device, scale=3.0)
    u = _rand(M, N, dtype=dtype, device=device)
    try:
        fn = _liger("swiglu", "LigerSiLUMulFunction")
        liger = lambda g, u: fn.apply(g, u)  # noqa: E731
    except Skip as exc:
        liger = exc
    shape = f"gate, up ({M}, {N})"
    if not backward:
        # Must move: read g and u; write y.
        nbytes = timing.bytes_moved(g, u, torch.empty_like(g))
        return Problem((g, u), nbytes, ours, torch_swiglu, liger, shape=shape)
    _needs_backward(ours, g, u)
    dy = _rand(M, N, dtype=dtype, device=device)
    # Must move: read g, u and dy; write dg and du.
    nbytes = timing.bytes_moved(g, u, dy, torch.empty_like(g), torch.empty_like(u))
    liger = Skip(
        "not compared: Liger's SiLU-mul backward overwrites its saved inputs in place"
    )
    return Problem(
        (g, u),
        nbytes,
        ours,
        torch_swiglu,
        liger,
        wrt=(0, 1),
        grad_outputs=(dy,),
        shape=shape,
    )


CASES += [
    Case(
        "swiglu",
        "forward",
        lambda M, N, dt, dev: build_swiglu(M, N, dt, dev),
        "forward",
    ),
    Case(
        "swiglu",
        "backward",
        lambda M, N, dt, dev: build_swiglu(M, N, dt, dev, True),
        "backward",
    ),
]

#: Qwen3-8B's head at a training step of 8,192 tokens: (M, V, d).
LCE_SHAPE = (8192, 151_936, 4096)


def measure_linear_cross_entropy(timer, device, dtype=torch.bfloat16, shape=LCE_SHAPE):
    """Forward + backward of the LM-head loss at ``shape`` = (M, V, d), three ways: this
    package's ``linear_cross_entropy``, the materialized ``F.linear`` +
    ``normbook.cross_entropy``, and Liger's fused linear cross-entropy when installed.
    One row each: time (``timer`` of a zero-argument callable, ms), the peak memory
    beyond inputs and gradients (on a GPU ``torch.cuda.max_memory_allocated``; on the
    CPU the largest storage an op allocated, labelled so), both against the logits'
    size, and the loss against the materialized one."""
    import normbook
    from normbook.linear_cross_entropy import largest_intermediate

    M, V, d = shape
    h = _rand(M, d, dtype=dtype, device=device).requires_grad_()
    w = _rand(V, d, dtype=dtype, device=device, scale=d**-0.5).requires_grad_()
    t = torch.randint(0, V, (M,), device=device)
    e = torch.empty((), dtype=dtype).element_size()
    logits_bytes = M * V * e
    grads_bytes = (M + V) * d * e

    def materialized(h, w, t):
        return normbook.cross_entropy(torch.nn.functional.linear(h, w), t)

    providers = {
        "normbook": normbook.linear_cross_entropy,
        "F.linear + normbook.cross_entropy": materialized,
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        providers["liger"] = lambda h, w, t: liger(w, h, t)
    except Exception as exc:  # not installed, or an API this code does not know
        providers["liger"] = Skip(f"liger-kernel unavailable ({type(exc).__name__})")
    want = None
    rows = []
    for name, fn in providers.items():
        row = {
            "kernel": "linear_cross_entropy",
            "provider": name,
            "M": M,
            "V": V,
            "d": d,
            "dtype": str(dtype).replace("torch.", ""),
            "logits_bytes": logits_bytes,
        }
        if isinstance(fn, Skip):
            rows.append({**row, "status": "skipped", "note": str(fn)})
            continue

        def step(fn=fn):
            loss = fn(h, w, t)
            torch.autograd.grad(loss, (h, w))
            return loss

        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                loss = step()
                torch.cuda.synchronize(device)
                extra = torch.cuda.max_memory_allocated(device) - base - grads_bytes
                how = "torch.cuda.max_memory_allocated - inputs - gradients"
            else:
                loss, extra = largest_intermediate(step)
                how = "CPU: largest storage one op allocated (not a peak of the sum)"
            ms = float(timer(step))
        except Exception as exc:  # e.g. out of memory for the materialized logits
            rows.append(
                {**row, "status": "error", "note": f"{type(exc).__name__}: {exc}"[:200]}
            )
            continue
        loss = float(loss.detach())
        want = loss if want is None else want
        rows.append(
            {
                **row,
                "status": "ok",
                "ms": ms,
                "extra_bytes": int(extra),
                "extra_over_logits": extra / logits_bytes,
                "memory": how,
                "loss": loss,
                "loss_diff": abs(loss - want),
            }
        )
    return rows


def linear_cross_entropy_shapes(smoke: bool) -> list:
    """(M, d, regime): the LM head of Qwen3-8B at 8,192 tokens (smoke: a tiny head)."""
    return [(64, 8, "lm head")] if smoke else [(LCE_SHAPE[0], LCE_SHAPE[2], "lm head")]


def build_linear_cross_entropy(M, N, dtype, device):
    """M tokens of width d = N through a head of V words (Qwen3's 151,936; 1,000 when
    the head is tiny): the backward of the mean loss. Peak memory:
    measure_linear_cross_entropy."""
    ours = _kernel("linear_cross_entropy")
    V = LCE_SHAPE[1] if N >= 1024 else 1000
    h = _rand(M, N, dtype=dtype, device=device)
    w = _rand(V, N, dtype=dtype, device=device, scale=N**-0.5)
    t = torch.randint(0, V, (M,), device=device)

    def formula(h, w, t):  # as transformers: logits, upcast, cross-entropy
        return torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(h, w).float(), t
        )

    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger_loss = LigerFusedLinearCrossEntropyLoss()
        liger = lambda h, w, t: liger_loss(w, h, t)  # noqa: E731
    except Exception as exc:
        liger = Skip(f"liger-kernel unavailable ({type(exc).__name__})")
    # Must move: read h and W (forward and backward), write dh and dW.
    nbytes = timing.bytes_moved(h, w, torch.empty_like(h), torch.empty_like(w))
    return Problem(
        (h, w, t),
        nbytes,
        ours,
        formula,
        liger,
        wrt=(0, 1),
        grad_outputs=(torch.ones((), device=device),),
        shape=f"hidden ({M}, {N}), weight ({V}, {N})",
    )


CASES += [
    Case(
        "linear_cross_entropy",
        "backward",
        build_linear_cross_entropy,
        shapes=linear_cross_entropy_shapes,
    )
]
