"""What an fp8 KV cache costs the attention output: the figures of the decode chapter.

The quantization's own error, apart from the kernel's arithmetic: the float64 reference
(:func:`normbook.reference.decode_attention`) over the cache as stored (fp8 values
times their scales, or a bf16 cache for comparison) against the same over the exact
fp32 keys and values. The kernel's own error over the stored cache is orders of
magnitude below (``tests/kernels/test_decode_attention_fp8.py`` holds it to its bound).
"""

from __future__ import annotations

#: what a cache may be stored as here: (name, quantize_kv's fmt or None, per head)
STORAGE = (
    ("bf16", None, False),
    ("e4m3 per tensor", "e4m3", False),
    ("e4m3 per head", "e4m3", True),
    ("e5m2 per tensor", "e5m2", False),
    ("e5m2 per head", "e5m2", True),
)


def decode_inputs(B=2, H=8, H_kv=2, S=256, D=128, outlier=None, seed=0):
    """q ``(B, H, 1, D)``, k, v ``(B, H_kv, S, D)`` fp32 N(0, 1), every row full;
    ``outlier``: channel 0 of k/v head 0's keys multiplied by it (one outlier channel
    in one head, as LLM keys have)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g)
    k = torch.randn(B, H_kv, S, D, generator=g)
    v = torch.randn(B, H_kv, S, D, generator=g)
    if outlier is not None:
        k[:, 0, :, 0] *= outlier
    return q, k, v


def stored(x, fmt, per_head):
    """x as the cache holds it, in float64: bf16 (fmt None) or fp8 times its scale."""
    import normbook
    from normbook import reference as ref

    if fmt is None:
        return x.bfloat16().double()
    x8, scale = normbook.quantize_kv(x, fmt=fmt, per_head=per_head)
    return ref.dequantize_kv(x8, scale)


def output_error(q, k, v, fmt, per_head) -> tuple[float, float]:
    """(max |O(stored cache) − O(exact cache)| over every head, the same over the query
    heads of k/v heads 1, 2, … only: those an outlier in head 0 leaves alone), both
    outputs in float64 over full rows."""
    import torch

    from normbook import reference as ref

    n = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32)
    exact = ref.decode_attention(q, k, v, n)
    quantized = ref.decode_attention(
        q, stored(k, fmt, per_head), stored(v, fmt, per_head), n
    )
    err = (quantized - exact).abs()
    group = q.shape[1] // k.shape[1]
    return err.max().item(), err[:, group:].max().item()


def fp8_kv_errors(outliers=(None, 20.0), **shape) -> dict:
    """{(data, storage): (max abs output error, the same outside head 0's group)} for
    N(0, 1) keys and values (``data = "N(0,1)"``) and with one outlier channel in k/v
    head 0 (``"outlier ×20"``), each storage of :data:`STORAGE`; ``shape``:
    :func:`decode_inputs`'s sizes.

    fp8 rounds relatively, like any floating-point format: the scale only places the
    values in its range, so one scale per head pays only where one for the tensor
    pushes a head's values below the normal range (``2^-6`` of e4m3's 448 after the
    scale: an outlier hundreds of times the head's values)."""
    out = {}
    for outlier in outliers:
        data = "N(0,1)" if outlier is None else f"outlier ×{outlier:g}"
        q, k, v = decode_inputs(outlier=outlier, **shape)
        for name, fmt, per_head in STORAGE:
            out[data, name] = output_error(q, k, v, fmt, per_head)
    return out
