"""One spec per public call: what a kernel needs in order to be benchmarked, inspected
and checked for gradients, said once.

A :class:`KernelSpec` names the public function (``normbook.<name>``) and gives:

* ``inputs(M, N, make)``: its keyword arguments at one shape, every tensor made by
  ``make`` (random values for the benchmark and the tests, uninitialized memory for the
  compiler inspector, which never runs them), so that all three build the same call;
* ``grad``: the arguments differentiated in the backward phase;
* ``formula``: the PyTorch formula as Hugging Face writes it, called like the kernel;
* ``liger``: Liger-Kernel's counterpart (a factory), or why there is none;
* ``nbytes``: the bytes the kernel must move, for GB/s against the copy bandwidth;
* ``plan``: its shapes on the GPU day, in :data:`SPECS`'s order of value;
* the inspector's launches: which shape labels, dtypes and extra variants.

Everything that lists kernels is derived from :data:`SPECS`: the benchmark's cases
(:mod:`normbook.lab.bench.cases`), the GPU day's plan (:func:`gpu_day_plan`), the
inspector's launches and the inspector tests' list (:func:`inspector_calls`), the
autograd coverage test, and ``tools/gpu_check.py``'s lists. Adding a kernel: its op
module, its export in ``normbook/__init__.py``, its float64 formula in
``normbook/reference.py``, its test file, and its spec here (CONTRIBUTING.md).

The module imports only the standard library at its top (torch and normbook inside the
builders): ``tools/gpu_check.py`` reads the plan without importing the package.
"""

from __future__ import annotations

from . import spec_decode as _cache  # reshape_and_cache's builders
from .formulas import (  # noqa: F401  (re-exported: the benchmark imports them here)
    _liger_fused_add_rms_norm,
    _liger_layer_norm,
    _liger_linear_cross_entropy,
    _liger_rms_norm,
    _liger_softmax,
    _liger_swiglu,
    torch_attention,
    torch_attention_varlen,
    torch_cross_entropy,
    torch_dequantize_fp8,
    torch_fused_add_rms_norm,
    torch_layer_norm,
    torch_linear,
    torch_linear_cross_entropy,
    torch_linear_fp8,
    torch_matmul,
    torch_qk_norm_rope,
    torch_quantize_fp8,
    torch_rms_norm,
    torch_softmax,
    torch_swiglu,
)
from .kernel_spec import (
    DTYPES,
    Entry,
    KernelSpec,
    Launch,
    Make,
    Plan,
    Skip,
    Variant,
    tiny_inputs,
    torch_kwargs,
)
from .spec_decode import (  # noqa: F401  (DECODE_*: the benchmark reads them here)
    DECODE_HEADS,
    DECODE_LENGTHS,
    DECODE_M,
    DECODE_PAGE,
    HEAD_DIM,
    _decode_attention_bytes,
    _decode_attention_formula,
    _decode_attention_fp8_inputs,
    _decode_attention_inputs,
    _decode_attention_shapes,
    _penalize_bytes,
    _penalize_formula,
    _penalize_inputs,
    _sample_bytes,
    _sample_inputs,
)
from .spec_inputs import (
    LINEAR_SHAPES,
    _dequantize_fp8_inputs,
    _linear_bytes,
    _linear_fp8_bytes,
    _linear_fp8_inputs,
    _linear_fp8_shapes,
    _linear_inputs,
    _linear_shapes,
    _linear_tiny,
    _matmul_inputs,
    _quantize_fp8_bytes,
    _quantize_fp8_inputs,
)

__all__ = ["SPECS", "BY_NAME", "Make", "Skip", "tiny_inputs", "torch_kwargs"]

#: The benchmark's sweep of hidden sizes: 256 … 262,144.
SWEEP = tuple(256 * 2**i for i in range(11))
#: Elements of a row-sized tensor in the sweep and on the GPU day: M = ELEMENTS // N
#: (128 MiB in bf16, larger than any GPU's L2 cache).
ELEMENTS = 2**26
SMOKE_SWEEP = (256, 1024)
SMOKE_ELEMENTS = 2**12
DECODE_N = (4096, 8192)
SMOKE_DECODE = ((1, 1024),)
#: Qwen3-8B's query heads per key head (GQA).
GQA_GROUP = 4
#: Attention's sequences: at most this many tokens each, M // SEQ of them.
SEQ = 4096
VOCAB = 151_936  # Qwen's vocabulary
#: The LM head of Qwen3-8B at a training step of 8,192 tokens: (M, V, d).
LCE_SHAPE = (8192, VOCAB, 4096)


# The GPU day's shapes, (M, N) as the spec's inputs read them.
ROWS = tuple((ELEMENTS // n, n) for n in (4096, 8192, 32768, 131072))
DECODE_ROWS = ((1, 4096), (8, 4096), (64, 4096))
SMOKE_LOGITS = ((4, 1000),)


# ---------------------------------------------------------------- inputs and bytes
# ``make(*shape, grad=False)`` makes a tensor of the case's dtype; ``make.index(n,
# high)`` n int64 indices below ``high``; ``make.lengths(n, value)`` n int32 lengths.
# ``nbytes(inputs, backward)`` counts each tensor that must be read or written once.


def _bytes(*tensors) -> int:
    from .measure import bytes_moved

    return bytes_moved(*tensors)


def _rows(vectors):
    """x (M, N) and ``vectors`` weights of N."""
    names = ("weight", "bias")[:vectors]

    def inputs(M, N, make):
        return {"x": make(M, N), **{n: make(N) for n in names}}

    return inputs


def _rms_norm_bytes(a, backward):
    x, w = a["x"], a["weight"]
    # forward: read x, w; write y. backward: read x, w, dy; write dx and dw.
    return _bytes(x, w, x) if not backward else _bytes(x, w, x, x, w)


def _layer_norm_bytes(a, backward):
    x, w, b = a["x"], a["weight"], a["bias"]
    # backward: read x, w, dy (b is not needed); write dx, dw and db.
    return _bytes(x, w, b, x) if not backward else _bytes(x, w, x, x, w, b)


def _fused_add_rms_norm_inputs(M, N, make):
    return {"x": make(M, N), "residual": make(M, N), "weight": make(N)}


def _fused_add_rms_norm_bytes(a, backward):
    x, w = a["x"], a["weight"]
    if backward:
        # read h (saved), w, dy and the residual stream's gradient dh; write the
        # gradient of x + residual (one tensor for both) and dw
        return _bytes(x, w, x, x, x, w)
    # read x, residual, w; write y and the residual stream h
    return _bytes(x, x, w, x, x)


def _heads(N):
    hq = max(1, N // HEAD_DIM)
    return hq, max(1, hq // GQA_GROUP)


def _qk_norm_rope_inputs(M, N, make):
    """M tokens; N = query heads · head_dim, a quarter as many key heads (GQA)."""
    (hq, hk), d = _heads(N), HEAD_DIM
    q, k = make(1, M, hq, d), make(1, M, hk, d)
    return {
        "q": q,
        "k": k,
        "q_weight": make(d),
        "k_weight": make(d),
        "cos": make(1, M, d),
        "sin": make(1, M, d),
    }


def _qk_norm_rope_bytes(a, backward):
    # read q, k, both weights, cos, sin; write q_out and k_out
    return _bytes(*a.values(), a["q"], a["k"])


def _softmax_bytes(a, backward):
    # forward: read x, write y; backward: read y (saved) and dy, write dx
    return _bytes(a["x"], a["x"]) if not backward else _bytes(a["x"], a["x"], a["x"])


def _cross_entropy_inputs(M, N, make):
    """M rows of logits over a vocabulary of N; the mean loss."""
    return {"logits": make(M, N), "target": make.index(M, N)}


def _cross_entropy_bytes(a, backward):
    # read the logits (and targets); backward writes their gradient
    x, t = a["logits"], a["target"]
    return _bytes(x, t) if not backward else _bytes(x, t, x)


def _attention_inputs(M, N, make):
    """M tokens in causal sequences of at most SEQ; N = query heads · head_dim, GQA."""
    (hq, hk), d = _heads(N), HEAD_DIM
    seq = min(M, SEQ)
    batch = max(1, M // seq)
    return {
        "q": make(batch, hq, seq, d),
        "k": make(batch, hk, seq, d),
        "v": make(batch, hk, seq, d),
    }


def _attention_bytes(a, backward):
    q, k, v = a["q"], a["k"], a["v"]
    # forward: read q, k, v; write the output (no score matrix). backward: read q, k,
    # v, O, dO (and L, D: one number a row); write dq, dk, dv
    return _bytes(q, k, v, q) if not backward else _bytes(q, k, v, q, q, q, k, v)


def _attention_shapes(smoke):
    """The sweep and decode shapes, but for a smoke run one prefill of 64 tokens and one
    decode token at 2 query heads and 1 key head: at the sweep's N = 1,024 (8 heads)
    the interpreter spent 20 of the smoke run's 43 s in the attention backwards."""
    return [(64, 256, "sweep"), (1, 256, "decode")] if smoke else None


def _attention_varlen_inputs(M, N, make):
    """M tokens packed as documents of ragged lengths, each half of what is left (at
    most SEQ): 2048, 1024, …, 2, 1, 1 at M = 4096; N = query heads · head_dim, GQA."""
    (hq, hk), d = _heads(N), HEAD_DIM
    cu = [0]
    while cu[-1] < M:
        cu.append(cu[-1] + min(SEQ, (M - cu[-1] + 1) // 2))
    c = make.tokens(cu).int()  # the first document is the longest: cu[1] rows
    out = dict(cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=cu[1], max_seqlen_k=cu[1])
    return {"q": make(M, hq, d), "k": make(M, hk, d), "v": make(M, hk, d), **out}


def _swiglu_inputs(M, N, make):
    """M rows of the MLP's intermediate width N: gate and up."""
    return {"gate": make(M, N, scale=3.0), "up": make(M, N)}


def _swiglu_bytes(a, backward):
    g = a["gate"]
    # forward: read gate and up, write y; backward: read gate, up, dy; write dg, du
    return _bytes(g, g, g) if not backward else _bytes(g, g, g, g, g)


def _row_variance_inputs(M, N, make):
    return {"x": make(M, N)}


def _linear_cross_entropy_inputs(M, N, make):
    """M tokens of width d = N through a head of V words (Qwen3's; 1,000 for a tiny
    head)."""
    V = LCE_SHAPE[1] if N >= 1024 else 1000
    return {
        "hidden": make(M, N),
        "weight": make(V, N, scale=N**-0.5),
        "target": make.index(M, V),
    }


def _linear_cross_entropy_bytes(a, backward):
    h, w = a["hidden"], a["weight"]
    # read h and W (forward and backward), write dh and dW
    return _bytes(h, w, h, w)


def _linear_cross_entropy_shapes(smoke):
    """The LM head of Qwen3-8B at 8,192 tokens (smoke: a tiny head)."""
    return [(64, 8, "lm head")] if smoke else [(LCE_SHAPE[0], LCE_SHAPE[2], "lm head")]


# ---------------------------------------------------------------- the specs

_FB = {"forward": "forward", "backward": "backward"}
_NO_FP64 = ("fp32", "fp16", "bf16")

#: In the GPU day's order of value: what a stop at any moment should already have
#: measured comes first.
SPECS = (
    KernelSpec(
        "rms_norm",
        _rows(1),
        ("x", "weight"),
        {"eps": 1e-6},
        torch_rms_norm,
        _liger_rms_norm,
        _rms_norm_bytes,
        _FB,
        plan=Plan(ROWS + DECODE_ROWS),
        inspect_s=15,
    ),
    KernelSpec(
        "fused_add_rms_norm",
        _fused_add_rms_norm_inputs,
        ("x", "residual", "weight"),
        {"eps": 1e-6},
        torch_fused_add_rms_norm,
        _liger_fused_add_rms_norm,
        _fused_add_rms_norm_bytes,
        {"forward": "fused add", "backward": "backward"},
        plan=Plan(ROWS + DECODE_ROWS),
        inspect_s=18,
    ),
    KernelSpec(
        "layer_norm",
        _rows(2),
        ("x", "weight", "bias"),
        {"eps": 1e-5},
        torch_layer_norm,
        _liger_layer_norm,
        _layer_norm_bytes,
        _FB,
        plan=Plan(ROWS + DECODE_ROWS),
        inspect_s=14,
    ),
    KernelSpec(
        "softmax",
        _rows(0),
        ("x",),
        {},
        torch_softmax,
        _liger_softmax,
        _softmax_bytes,
        _FB,
        plan=Plan(ROWS),
        inspect_s=11,
    ),
    KernelSpec(
        "cross_entropy",
        _cross_entropy_inputs,
        ("logits",),
        {},
        torch_cross_entropy,
        "not compared: Liger's cross-entropy writes its gradient in place",
        _cross_entropy_bytes,
        {"forward": "", "backward": ""},
        plan=Plan(((1024, VOCAB),), (0,), SMOKE_LOGITS),
        inspect_s=12,
    ),
    KernelSpec(
        "attention",
        _attention_inputs,
        ("q", "k", "v"),
        {"causal": True},
        torch_attention,
        "Liger has no attention kernel",
        _attention_bytes,
        {"forward": "", "backward": ""},
        _attention_shapes,
        plan=Plan(((1024, 4096), (2048, 4096), (4096, 4096)), (0, 2), ((64, 256),)),
        # With one token (a decode shape) dq and dk are exactly 0 and both sides return
        # rounding noise, which a check relative to the largest value cannot judge.
        min_rows={"backward": 64},
        inspect_dtypes=_NO_FP64,
        variants=(Variant("softcap", {"softcap": 50.0}, _NO_FP64),),  # Gemma 2's cap
        inspect_s=20,
    ),
    KernelSpec(
        "sample",
        _sample_inputs,
        (),
        {"temperature": 0.0},
        lambda logits: logits.argmax(-1),
        "Liger has no sampling kernel",
        _sample_bytes,
        {"forward": ""},
        plan=Plan(((1, VOCAB), (64, VOCAB)), (0, 1), SMOKE_LOGITS),
        # what a server runs: temperature, top-k and top-p, from a seed
        variants=(
            Variant(
                "top_p", {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "generator": 0}
            ),
        ),
        integer_outputs=True,
        module="sampling",
        inspect_s=64,
    ),
    KernelSpec(
        "penalize",
        _penalize_inputs,
        (),
        {},
        _penalize_formula,
        "Liger has no penalty kernel",
        _penalize_bytes,
        {"forward": ""},
        plan=Plan(((1, VOCAB), (64, VOCAB)), (0, 1), SMOKE_LOGITS),
        inspect=("decode", "odd"),
        inspect_dtypes=_NO_FP64,
        inspect_s=8,
    ),
    KernelSpec(
        "reshape_and_cache",
        _cache._reshape_and_cache_inputs,
        (),
        {},
        _cache._reshape_and_cache_formula,
        "Liger has no KV-cache kernel",
        _cache._reshape_and_cache_bytes,
        {"forward": ""},
        _cache._reshape_and_cache_shapes,
        # a decode batch of Qwen3-8B, and a prefill chunk
        plan=Plan(((1, 32768), (64, 32768), (2048, 32768)), (0, 2), ((16, 256),)),
        inspect=("decode",),
        inspect_dtypes=_NO_FP64,  # the kernel copies fp32, fp16 and bf16
        inspect_s=6,
        # in place: the caches written, returned by a wrapper for the checks
        mutates=("key_cache", "value_cache"),
        returning=_cache._reshape_and_cache_returning,
    ),
    KernelSpec(
        "qk_norm_rope",
        _qk_norm_rope_inputs,
        ("q", "k", "q_weight", "k_weight"),
        {"eps": 1e-6},
        torch_qk_norm_rope,
        "Liger has no fused QK-Norm + RoPE",
        _qk_norm_rope_bytes,
        {"forward": "forward"},
        plan=Plan(((4096, 4096), (1, 4096)), (0,)),
        inspect_s=21,
    ),
    KernelSpec(
        "swiglu",
        _swiglu_inputs,  # the call's keyword arguments at (M, N)
        ("gate", "up"),  # what the backward differentiates
        {},  # fixed keywords of the call
        torch_swiglu,  # the PyTorch formula, as Hugging Face writes it
        _liger_swiglu,  # Liger-Kernel's counterpart, or why there is none
        _swiglu_bytes,  # the bytes it must move: GB/s against the copy
        _FB,  # benchmarked forward and backward, held to the chapter's targets
        plan=Plan(((8192, 12288), (1, 12288), (64, 12288))),  # Qwen3-8B's MLP width
        inspect_s=16,
    ),
    KernelSpec(
        "linear",
        _linear_inputs,
        ("x", "weight"),
        {},
        torch_linear,
        "Liger has no GEMM: its kernels call PyTorch's matmul (cuBLAS)",
        _linear_bytes,
        {"forward": "", "backward": ""},
        _linear_shapes,
        plan=Plan(LINEAR_SHAPES),
        inspect_shapes=((1, 4096), (64, 4096), (16384, 4096), (6, 1000)),
        inspect_dtypes=_NO_FP64,
        tiny=_linear_tiny,
    ),
    KernelSpec(
        "decode_attention",
        _decode_attention_inputs,
        (),
        {},
        _decode_attention_formula,
        "Liger has no decode attention kernel",
        _decode_attention_bytes,
        {"forward": ""},
        _decode_attention_shapes,
        plan=Plan(((1, 4096), (64, 4096), (8, 32768)), (0, 2), ((1, 256),)),
        inspect=("decode",),
        inspect_shapes=((1, 4096), (8, 4096), (64, 4096)),
        inspect_dtypes=_NO_FP64,
        variants=(
            Variant(
                "paged",
                {},
                _NO_FP64,
                lambda M, N, make: _decode_attention_inputs(M, N, make, True),
            ),
            # Gemma 2's attention cap: the tanh the uncapped kernel compiles without
            Variant("softcap", {"softcap": 50.0}, _NO_FP64),
            # vLLM's fp8 KV cache: e4m3 tiles converted to q's dtype (sm_90), or
            # read as bytes and shifted into fp16 (no fp8 e4m3 before sm_89)
            Variant("fp8kv", {}, _NO_FP64, _decode_attention_fp8_inputs),
        ),
        inspect_s=14,
    ),
    KernelSpec(
        "linear_cross_entropy",
        _linear_cross_entropy_inputs,
        ("hidden", "weight"),
        {},
        torch_linear_cross_entropy,
        _liger_linear_cross_entropy,
        _linear_cross_entropy_bytes,
        {"backward": ""},
        _linear_cross_entropy_shapes,
        # no torch.compile: the budget goes to every kernel's rows first
        plan=Plan(((8192, 4096),), (), ((64, 8),)),
        inspect="its own launches are cross_entropy's kernels between cuBLAS products, "
        "which the inspector cannot lower",
    ),
    KernelSpec(
        "attention_varlen",
        _attention_varlen_inputs,
        ("q", "k", "v"),
        {"causal": True},
        torch_attention_varlen,
        "Liger has no varlen attention kernel",
        _attention_bytes,  # cu_seqlens: a few bytes more
        {"forward": "", "backward": ""},
        _attention_shapes,
        plan=Plan(((4096, 4096), (8192, 4096)), (0,), ((64, 256),)),
        min_rows={"backward": 64},  # as attention's
        inspect_dtypes=_NO_FP64,
    ),
    KernelSpec(
        "row_variance",
        _row_variance_inputs,
        (),
        base=False,
        module="row_stats",
        variants=tuple(
            Variant(f"{method}{acc}", {"method": method, **kw}, dtypes)
            for method in ("two_pass", "one_pass", "welford")
            # fp32 inputs with statistics accumulated in bf16: the variance chapter
            for acc, kw, dtypes in (
                ("", {}, DTYPES),
                (".bf16acc", {"acc_dtype": "bfloat16"}, ("fp32",)),
            )
        ),
    ),
    KernelSpec(
        "quantize_fp8",
        _quantize_fp8_inputs,
        (),
        {},
        torch_quantize_fp8,
        "Liger has no fp8 quantization",
        _quantize_fp8_bytes,
        {"forward": ""},
        # Qwen3-8B's hidden and MLP widths, DeepSeek-V3's hidden size
        plan=Plan(((8192, 4096), (8192, 12288), (1, 4096), (64, 7168)), (0, 2)),
        inspect=("bench", "decode"),  # N a multiple of 128: not the odd shapes
        inspect_dtypes=_NO_FP64,
        variants=(
            Variant("e5m2", {"fmt": "e5m2"}, _NO_FP64),
            Variant(
                "weight",
                {"block": (128, 128)},
                _NO_FP64,
                lambda M, N, make: _quantize_fp8_inputs(M, N, make, rows=128),
            ),
        ),
        tiny=lambda make: {"x": make(3, 128)},
        module="fp8",
        inspect_s=15,
    ),
    KernelSpec(
        "linear_fp8",
        _linear_fp8_inputs,
        (),
        {},
        torch_linear_fp8,
        "Liger has no fp8 GEMM",
        _linear_fp8_bytes,
        {"forward": ""},
        _linear_fp8_shapes,
        # prefill and decode through Qwen3-8B's MLP up projection (4096 -> 12288)
        plan=Plan(((8192, 4096), (1, 4096), (64, 4096)), (0, 1)),
        inspect=("bench", "decode"),
        inspect_shapes=((16384, 4096), (1, 4096), (64, 4096)),
        inspect_dtypes=_NO_FP64,
        tiny=lambda make: _linear_fp8_inputs(3, 128, make, features=1),
        module="fp8",
        inspect_s=10,
    ),
    KernelSpec(
        "dequantize_fp8",
        _dequantize_fp8_inputs,
        (),
        {},
        torch_dequantize_fp8,
        "Liger has no fp8 dequantization",
        inspect=("bench", "decode"),
        inspect_dtypes=_NO_FP64,
        tiny=lambda make: _dequantize_fp8_inputs(3, 128, make),
        module="fp8",
        inspect_s=6,
    ),
    KernelSpec(
        "quantize_kv",
        None,
        inspect="PyTorch, no Triton kernel",
        tiny=lambda make: {"x": make(3, 2, 8, 16)},
    ),
    KernelSpec(
        "matmul",
        _matmul_inputs,
        ("a", "b"),
        {},
        torch_matmul,
        "Liger has no GEMM",
        inspect="linear's kernel, b read as stored: inspected through linear",
        module="linear",
        tiny=lambda make: {"a": make(3, 24), "b": make(24, 8)},
    ),
    KernelSpec(
        "speculative_sample",
        None,
        inspect="PyTorch, no Triton kernel",
        integer_outputs=True,
        module="speculative",
        tiny=lambda make: {
            "draft_tokens": make.tokens([[1, 4]]),
            "draft_probs": make.probs(1, 2, 6),
            "target_probs": make.probs(1, 3, 6),
        },
    ),
)
BY_NAME = {s.name: s for s in SPECS}


# ---------------------------------------------------------------- derived lists


#: The inspector's shape labels that specs choose among; any other label (the GPU day's
#: measured shapes) launches every spec whose labels are not restricted.
LABELS = ("bench", "decode", "odd")


def inspector_launches(label: str, M: int, N: int, dtype: str) -> list[Launch]:
    """What the inspector launches at one (label, M, N) and dtype (:data:`SPECS`)."""
    out = []
    for s in SPECS:
        if not s.inspected or dtype not in s.inspect_dtypes:
            continue
        if label in LABELS and label not in s.inspect:
            continue
        if s.inspect_shapes and label in LABELS and (M, N) not in s.inspect_shapes:
            continue
        if s.base:
            out.append(Launch(s.name, s, s.inputs, s.kwargs, s.grad))
        out += [
            Launch(f"{s.name}.{v.suffix}", s, v.inputs or s.inputs,
                   {**s.kwargs, **v.kwargs}, ())
            for v in s.variants
            if dtype in v.dtypes
        ]  # fmt: skip
    return out


def inspector_paths() -> list[tuple[str, str]]:
    """(call, phase) of every inspector launch at any shape and dtype, in spec order."""
    seen = {}
    for label in LABELS:
        shapes = {(m, n) for s in SPECS for m, n in s.inspect_shapes} or {(1, 4096)}
        for M, N in sorted(shapes | {(1, 4096)}):
            for dtype in DTYPES:
                for launch in inspector_launches(label, M, N, dtype):
                    seen[launch.call, "forward"] = None
                    if launch.grad:
                        seen[launch.call, "backward"] = None
    order = {s.name: i for i, s in enumerate(SPECS)}
    return sorted(seen, key=lambda cp: order[cp[0].split(".")[0]])


def gpu_day_plan() -> list[Entry]:
    """Every benchmarked direction of every spec with a plan, in order of value."""
    return [
        Entry(f"{s.name}.{d}", s.plan.shapes, s.plan.compile_at, s.plan.smoke)
        for s in SPECS
        if s.plan
        for d in s.bench
    ]


def autograd_calls(device) -> dict:
    """{name: a function returning fresh tiny inputs on ``device``} for the autograd
    coverage test: every spec, its tensor arguments by name."""
    from .kernel_spec import Make

    def inputs(spec):
        import torch

        return lambda: tiny_inputs(spec, Make(torch.float32, device))

    return {s.name: inputs(s) for s in SPECS}


def test_files() -> list[str]:
    """The kernel test files in order of value: each spec's, then its backward's."""
    files = [f"test_{s.module_name}{b}.py" for s in SPECS for b in ("", "_backward")]
    return list(dict.fromkeys(files))
