"""The formulas the kernels are compared with and timed against: PyTorch's, as Hugging
Face writes them, and Liger-Kernel's counterparts (factories that raise :class:`Skip`
where Liger is absent). Imported by :mod:`normbook.lab.specs`; like it, the module
imports only the standard library at its top."""

from __future__ import annotations

from .kernel_spec import Skip

# ---------------------------------------------------------------- formulas (HF's)


def torch_rms_norm(x, weight, eps=1e-6):
    import torch

    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def torch_layer_norm(x, weight, bias, eps=1e-5):
    import torch

    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def torch_fused_add_rms_norm(x, residual, weight, eps=1e-6):
    h = x + residual
    return torch_rms_norm(h, weight, eps), h


def _rotate_half(x):
    import torch

    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def torch_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6):
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    qn, kn = torch_rms_norm(q, q_weight, eps), torch_rms_norm(k, k_weight, eps)
    return qn * c + _rotate_half(qn) * s, kn * c + _rotate_half(kn) * s


def torch_softmax(x):
    import torch

    return torch.softmax(x, dim=-1)


def torch_cross_entropy(logits, target):
    import torch

    return torch.nn.functional.cross_entropy(logits.float(), target)


def torch_swiglu(gate, up):
    """The MLP's gate as Hugging Face writes it:
    ``act_fn(gate_proj(x)) * up_proj(x)``."""
    import torch

    return torch.nn.functional.silu(gate) * up


def torch_attention(q, k, v, causal=True):
    import torch

    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=bool(causal), enable_gqa=True
    )


def torch_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True, **_):
    """SDPA per packed sequence (its top-left causal = bottom-right: len_k = len_q)."""
    import torch

    cq, ck = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
    parts = zip(q.split(cq), k.split(ck), v.split(ck))  # (length, heads, head_dim) each
    o = [torch_attention(*(t.transpose(0, 1)[None] for t in p), causal) for p in parts]
    return torch.cat([x[0].transpose(0, 1) for x in o])


def torch_linear_cross_entropy(hidden, weight, target):
    """As transformers: logits, upcast, cross-entropy."""
    import torch

    logits = torch.nn.functional.linear(hidden, weight).float()
    return torch.nn.functional.cross_entropy(logits, target)


def torch_linear(x, weight, bias=None):
    """A projection as Hugging Face's ``nn.Linear`` runs it (cuBLAS on a GPU)."""
    import torch

    return torch.nn.functional.linear(x, weight, bias)


def torch_matmul(a, b):
    import torch

    return torch.matmul(a, b)


# ---------------------------------------------------------------- Liger-Kernel


def _liger_op(module: str, attr: str):
    import importlib
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        raise Skip("liger-kernel is not installed")
    try:
        return getattr(importlib.import_module(f"liger_kernel.ops.{module}"), attr)
    except Exception as exc:  # an old Liger without the op, or one that fails here
        raise Skip(f"liger_kernel.ops.{module}.{attr} unavailable ({exc!r})") from exc


def _liger_rms_norm(backward):
    import inspect

    fn = _liger_op("rms_norm", "LigerRMSNormFunction")
    if "in_place" in inspect.signature(fn.forward).parameters:
        # in_place=False: the default overwrites dy with dx, changing the timed data
        return lambda x, weight: fn.apply(x, weight, 1e-6, 0.0, "llama", False)
    return lambda x, weight: fn.apply(x, weight, 1e-6)


def _liger_layer_norm(backward):
    fn = _liger_op("layer_norm", "LigerLayerNormFunction")
    return lambda x, weight, bias: fn.apply(x, weight, bias, 1e-5)


def _liger_fused_add_rms_norm(backward):
    fn = _liger_op("fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
    return lambda x, residual, weight: fn.apply(x, residual, weight, 1e-6)


def _liger_softmax(backward):
    fn = _liger_op("softmax", "LigerSoftmaxFunction")
    return lambda x: fn.apply(x)


def _liger_swiglu(backward):
    if backward:
        raise Skip(
            "not compared: Liger's SiLU-mul backward overwrites its saved inputs"
        )
    fn = _liger_op("swiglu", "LigerSiLUMulFunction")
    return lambda gate, up: fn.apply(gate, up)


def _liger_linear_cross_entropy(backward):
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:
        raise Skip(f"liger-kernel unavailable ({type(exc).__name__})") from exc
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda hidden, weight, target: loss(weight, hidden, target)


# ---------------------------------------------------------------- fp8, block scales


def _fp8_spread(s, block):
    """Per-block scales spread over their blocks' elements."""
    return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)


def torch_quantize_fp8(x, block=(1, 128), fmt="e4m3"):
    """Per-block amax scaling in PyTorch, as DeepSeek-V3's reference code writes it
    (``act_quant``: scale = amax / 448, then the cast), with normbook's floor of the
    scale at 2^-126 (an all-zero block gives zeros, never 0/0)."""
    import torch

    dtype, fmax = {
        "e4m3": (torch.float8_e4m3fn, 448.0),
        "e5m2": (torch.float8_e5m2, 57344.0),
    }[fmt]
    (M, K), (bm, bk) = x.shape, block
    blocks = x.float().view(M // bm, bm, K // bk, bk)
    s = (blocks.abs().amax(dim=(1, 3), keepdim=True) / fmax).clamp_min(2.0**-126)
    return (blocks / s).to(dtype).view(M, K), s.view(M // bm, K // bk)


def torch_dequantize_fp8(q, scale, out_dtype=None, block=(1, 128)):
    import torch

    y = q.float() * _fp8_spread(scale, block)
    return y.to(out_dtype or torch.float32)


def torch_linear_fp8(x_q, x_scale, w_q, w_scale, out_dtype=None):
    """Dequantize both operands to fp32, one fp32 product, one rounding. (On a GPU with
    fp8 tensor cores ``torch._scaled_mm`` takes the fp8 operands and block scales
    directly: the GPU day's comparison where this PyTorch has it.)"""
    import torch

    x = torch_dequantize_fp8(x_q, x_scale, torch.float32, (1, 128))
    w = torch_dequantize_fp8(w_q, w_scale, torch.float32, (128, 128))
    return (x @ w.T).to(out_dtype or torch.bfloat16)
