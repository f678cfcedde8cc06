"""The inputs, bytes and benchmark shapes of the specs of Part III (the matrix products
and fp8): builders in the form :class:`normbook.lab.kernel_spec.KernelSpec` takes
(``inputs(M, N, make)``, ``nbytes(inputs, backward)``, ``shapes(smoke)``), for
:mod:`normbook.lab.specs`. Like it, the module imports only the standard library at its
top."""

from __future__ import annotations

#: Qwen3-8B's hidden size: the K of its projections (all but down_proj's 12,288).
HIDDEN = 4096


def _bytes(*tensors) -> int:
    from .measure import bytes_moved

    return bytes_moved(*tensors)


def _fp8(make, *shape):
    """e4m3 values: the case's random values cast, or uninitialized; an input whose
    loads the inspector checks. Scales: positive fp32, one per block of 128."""
    import torch

    t = torch.empty(shape, dtype=torch.float8_e4m3fn, device=make.device)
    if not make.empty:
        t = make(*shape, checked=False).to(torch.float8_e4m3fn)
    if make.on_input is not None:
        make.on_input(t)
    return t, make(shape[0], shape[1] // 128, checked=False).float().abs() + 0.01


def _quantize_fp8_inputs(M, N, make, rows=1):
    """M tokens of a hidden size N (a weight in 128 × 128 tiles: rows=128, M rounded
    up to a tile)."""
    return {"x": make(-(-M // rows) * rows, N, scale=4.0)}


def _quantize_fp8_bytes(a, backward):
    x = a["x"]
    # read x; write q (a byte a value) and a 4-byte scale per block of 128
    return _bytes(x) + x.numel() + 4 * (x.numel() // 128)


def _dequantize_fp8_inputs(M, N, make):
    """M tokens of N channels in e4m3 and their scales; the case's dtype out."""
    q, scale = _fp8(make, M, N)
    return {"q": q, "scale": scale, "out_dtype": make.dtype}


def _linear_fp8_inputs(M, N, make, features=3):
    """M tokens of width K = N through an up projection to 3N features (Qwen3-8B's
    MLP: 4096 -> 12288); e4m3 operands, per-token and 128 × 128 weight scales; the
    case's dtype out."""
    (x_q, x_scale), (w_q, w_scale) = _fp8(make, M, N), _fp8(make, features * N, N)
    w_scale = w_scale[::128].contiguous()  # a scale per 128 × 128 tile
    return dict(
        x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=w_scale, out_dtype=make.dtype
    )


def _linear_fp8_shapes(smoke):
    """Prefill and decode at Qwen3-8B's width (smoke: two small ones), not the sweep:
    the weight grows with N² (3N × N)."""
    if smoke:
        return [(16, 256, "sweep"), (1, 256, "decode")]
    return [(8192, 4096, "prefill"), (1, 4096, "decode"), (64, 4096, "decode")]


def _linear_fp8_bytes(a, backward):
    import torch

    # read both operands and their scales, write y (M, 3N)
    y = a["x_q"].shape[0] * a["w_q"].shape[0]
    out = torch.empty((), dtype=a["out_dtype"]).element_size()
    return _bytes(a["x_q"], a["x_scale"], a["w_q"], a["w_scale"]) + y * out


def _width(N):
    """K of a projection to N features: Qwen3-8B's hidden size; a small model's 64 on
    the CPU's dry runs (N <= 256), where the interpreter would take K in 128 steps."""
    return HIDDEN if N > 256 else 64


def _linear_inputs(M, N, make):
    """M tokens of width K (:func:`_width`) through a projection to N features, no
    bias (Qwen3's projections have none); weights scaled so y stays O(1)."""
    K = _width(N)
    return {"x": make(M, K), "weight": make(N, K, scale=K**-0.5)}


def _linear_tiny(make):
    """The tests' call: every argument present, the bias too."""
    return {"x": make(3, 24), "weight": make(8, 24), "bias": make(8)}


def _linear_bytes(a, backward):
    x, w = a["x"], a["weight"]
    y = x.new_empty(1).expand(x.shape[0], w.shape[0])  # (M, N): its size, no memory
    # forward: read x, W; write y. backward: read x, W, dy; write dx, dW
    return _bytes(x, w, y) if not backward else _bytes(x, w, y, x, w)


#: Qwen3-8B's projections on the GPU day: decode and a batch of 64 through q_proj
#: (4,096 → 4,096), a prefill of 8,192 tokens through q_proj and gate_proj (→ 12,288).
LINEAR_SHAPES = ((1, 4096), (64, 4096), (8192, 4096), (8192, 12288))


def _linear_shapes(smoke):
    """The benchmark's (M, N, regime): the plan's shapes, not the row sweep (a GEMM's
    work grows with M·N·K)."""
    if smoke:
        return [(16, 256, "prefill"), (1, 256, "decode")]
    return [(m, n, "decode" if m <= 64 else "prefill") for m, n in LINEAR_SHAPES]


def _matmul_inputs(M, N, make):
    K = _width(N)
    return {"a": make(M, K), "b": make(K, N, scale=K**-0.5)}
