"""The argument checks of :func:`normbook.decode_attention`, before any launch.

``check`` runs in the public function: types, shapes, dtypes, devices and the Python
numbers, none of which reads a tensor's values (so it also runs, unchanged, before a
``torch.compile``\\ d call). ``check_values`` runs inside the operator, before its
launch: the lengths, the block-table entries a row uses and the fp8 cache's scales are
values, read from the device in one host synchronization.
"""

import numbers

import torch

from . import _validate
from ._config import LOG2E
from .attention import DTYPES, MAX_HEAD_DIM

#: The fp8 formats a cache may be stored in (vLLM's "fp8" / "fp8_e4m3" and "fp8_e5m2").
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_CACHE_NAMES = "float32, float16, bfloat16, float8_e4m3fn or float8_e5m2"


def _check_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _validate.check_device(t, name)


def _check_softcap(softcap, scale):
    """The cap c as a float, or None for none (None or 0)."""
    if isinstance(softcap, bool) or not (
        softcap is None or isinstance(softcap, numbers.Real)
    ):
        raise TypeError(
            f"softcap must be a real number or None, got {type(softcap).__name__}"
        )
    if softcap is None or softcap == 0:
        return None
    softcap = float(softcap)
    if not 0.0 < softcap < float("inf"):
        raise ValueError(
            f"softcap must be a finite number > 0 (None or 0: no cap), got {softcap}"
        )
    # The kernel multiplies by scale/c and c·log2(e), which must be normal fp32
    # numbers: c in about [1e-38, 1e36] at scale 1/√128, where models use tens.
    fp32 = torch.finfo(torch.float32)
    if not all(
        fp32.tiny <= x <= fp32.max
        for x in (softcap * LOG2E, abs(scale) / softcap or 1.0)
    ):
        raise ValueError(
            f"softcap = {softcap} with scale = {scale} leaves fp32's range: "
            "scale/softcap and softcap·log2(e) must be normal fp32 numbers"
        )
    return softcap


def _check_kv_scale(s, name, H_kv, q):
    """An fp8 cache's dequantization scale as an fp32 tensor of shape (H_kv,): a Python
    number or a 0-d / (1,) tensor (per tensor, vLLM's ``_k_scale``) is broadcast
    without a copy (stride 0); an (H_kv,) tensor is one scale per k/v head. A number is
    checked here; a tensor's values are read in :func:`check_values`."""
    if s is None:
        raise ValueError(
            f"{name} is required with an fp8 cache: the cache holds x / {name} "
            "rounded to fp8 (a float, a 0-d tensor or one per k/v head)"
        )
    if isinstance(s, numbers.Real) and not isinstance(s, bool):
        s = float(s)
        # fp32's range: the kernel multiplies by it in fp32
        if not torch.finfo(torch.float32).tiny <= s <= 2.0**100:
            raise ValueError(
                f"{name} must be a finite number > 0 (a normal fp32 number up to "
                f"2**100), got {s}"
            )
        return torch.full((1,), s, dtype=torch.float32, device=q.device).expand(H_kv)
    if not isinstance(s, torch.Tensor):
        raise TypeError(
            f"{name} must be a float or a torch.Tensor, got {type(s).__name__}"
        )
    _validate.check_device(s, name)
    _validate.check_same_device(name, s, "q", q)
    if s.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {s.dtype}")
    if tuple(s.shape) not in ((), (1,), (H_kv,)):
        raise ValueError(
            f"{name} must have shape () or (1,) (per tensor) or ({H_kv},) (one per "
            f"k/v head), got {tuple(s.shape)}"
        )
    return s.reshape(-1).expand(H_kv)


def _check_dtypes(q, k_cache, v_cache, k_scale, v_scale):
    """q in fp32/fp16/bf16; the caches in q's dtype, or both in one fp8 format with
    their scales. Returns the scales as (H_kv,) fp32 tensors, or (None, None)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(t, name)
        allowed = DTYPES if name == "q" else DTYPES + FP8
        if t.dtype not in allowed:
            names = "float32, float16 or bfloat16" if name == "q" else _CACHE_NAMES
            raise TypeError(f"{name} must be {names}, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions, got shape {tuple(t.shape)}"
            )
    if k_cache.dtype not in FP8 and k_cache.dtype != q.dtype:
        raise TypeError(
            f"k_cache must have q's dtype, {q.dtype}, or be an fp8 cache "
            f"(float8_e4m3fn, float8_e5m2), got {k_cache.dtype}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"v_cache must have k_cache's dtype, {k_cache.dtype}, got {v_cache.dtype}"
        )
    if k_cache.dtype not in FP8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(
                    f"{name} is only for an fp8 cache, but k_cache is "
                    f"{k_cache.dtype} (pass None)"
                )
        return None, None
    H_kv = k_cache.shape[1]
    return (
        _check_kv_scale(k_scale, "k_scale", H_kv, q),
        _check_kv_scale(v_scale, "v_scale", H_kv, q),
    )


def check(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    block_table,
    scale,
    window,
    softcap=None,
    k_scale=None,
    v_scale=None,
):
    """Every structural check, before any launch. Returns (scale, window, capacity,
    softcap, k_scale, v_scale): softcap None when off, the scales None or (H_kv,)
    fp32 tensors."""
    k_scale, v_scale = _check_dtypes(q, k_cache, v_cache, k_scale, v_scale)
    B, H, Sq, D = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _validate.check_same_device(name, t, "q", q)
        if t.shape[3] != D:
            raise ValueError(f"{name} must have q's head_dim, {D}, got {t.shape[3]}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"v_cache must have k_cache's shape, {tuple(k_cache.shape)}, "
            f"got {tuple(v_cache.shape)}"
        )
    H_kv = k_cache.shape[1]
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(
            f"k_cache's heads ({H_kv}) must divide q's heads ({H}): "
            "grouped-query attention shares each k/v head among a "
            "group of q heads"
        )
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {D}")
    if Sq < 1:
        raise ValueError(
            f"q must hold at least one new token per row (dimension 2), got {Sq}"
        )
    _check_tensor(cache_seqlens, "cache_seqlens")
    _validate.check_index_vector(
        cache_seqlens, "cache_seqlens", B, "one length per row of q", "q", q
    )
    capacity = _check_table(block_table, k_cache, q, B)
    if scale is None:
        scale = D**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale must be a real number or None, got {type(scale).__name__}"
        )
    scale = float(scale)
    if not abs(scale) < float("inf"):
        raise ValueError(f"scale must be finite, got {scale}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(
                f"window must be an int or None, got {type(window).__name__}"
            )
        if window < 1:
            raise ValueError(
                f"window must be >= 1 (keys each query sees), got {window}"
            )
        window = int(window)
    softcap = _check_softcap(softcap, scale)
    inputs = (q, k_cache, v_cache, k_scale, v_scale)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in inputs
    ):
        raise NotImplementedError(
            "normbook.decode_attention has no backward: q, k_cache, v_cache, "
            "k_scale or v_scale requires grad (decoding needs none; detach them)"
        )
    return scale, window, capacity, softcap, k_scale, v_scale


def _check_table(block_table, k_cache, q, B):
    """The cache's capacity in keys per row: S_max, or max_blocks · block_size."""
    if block_table is None:
        if k_cache.shape[0] != B:
            raise ValueError(
                f"a contiguous k_cache must have q's batch size, {B}, "
                f"got {k_cache.shape[0]} (pass block_table for a paged "
                "cache)"
            )
        return k_cache.shape[2]
    _check_tensor(block_table, "block_table")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(
            f"block_table must have shape ({B}, max_blocks), got "
            f"{tuple(block_table.shape)}"
        )
    _validate.check_same_device("block_table", block_table, "q", q)
    page = k_cache.shape[2]
    if page < 1:
        raise ValueError(f"block_size (k_cache.shape[2]) must be >= 1, got {page}")
    return block_table.shape[1] * page


def check_values(
    cache_seqlens, block_table, capacity, num_blocks, k_scale=None, v_scale=None
):
    """The lengths (and the block-table entries a row uses) are in range: reading past
    them would touch memory that is not the row's; an fp8 cache's scales are finite
    and > 0 (normal fp32 numbers up to 2**100, as a Python number's). One host
    synchronization."""
    n = cache_seqlens.to(torch.int64)
    bad = [(n < 0).any(), (n > capacity).any()]
    for s in (k_scale, v_scale):
        if s is not None:
            ok = (s >= torch.finfo(torch.float32).tiny) & (s <= 2.0**100)
            bad.append(~ok.all())
    if block_table is not None and block_table.numel():
        page = capacity // block_table.shape[1]
        used = (
            torch.arange(block_table.shape[1], device=n.device)[None, :]
            < ((n + page - 1) // page)[:, None]
        )
        bad.append((used & ((block_table < 0) | (block_table >= num_blocks))).any())
    flags = torch.stack(bad).tolist()  # the one synchronization
    if flags[0]:
        raise ValueError(f"cache_seqlens must be >= 0, got {n.tolist()}")
    if flags[1]:
        where = (
            "max_blocks · block_size" if block_table is not None else "k_cache.shape[2]"
        )
        raise ValueError(
            f"cache_seqlens must be <= the cache's capacity, {where} = "
            f"{capacity}, got a length of {int(n.max())}"
        )
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and flags.pop(2):
            raise ValueError(
                f"{name} must be finite and > 0 (a normal fp32 number up to 2**100), "
                f"got {s.tolist()}"
            )
    if len(flags) > 2 and flags[2]:
        raise ValueError(
            f"block_table entries a row uses must be in [0, {num_blocks}) "
            "(k_cache.shape[0] blocks)"
        )
