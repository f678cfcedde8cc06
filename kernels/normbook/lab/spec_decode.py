"""The inputs, bytes and benchmark shapes of the specs of what runs at decode time (one
new token per request): decode attention over a (paged, or fp8) KV cache and the
sampler. Builders in the form :class:`normbook.lab.kernel_spec.KernelSpec` takes, for
:mod:`normbook.lab.specs`; like it, the module imports only the standard library at its
top."""

from __future__ import annotations

#: Qwen3's head_dim.
HEAD_DIM = 128
#: Decode: a few rows (tokens) of a model's hidden size, where a GPU must be filled from
#: few rows.
DECODE_M = (1, 8, 64)
#: Decode attention: Qwen3-8B's (query, key/value) heads, and the cache lengths swept.
DECODE_HEADS = (32, 8)
DECODE_LENGTHS = (1024, 4096, 16384, 32768)
DECODE_PAGE = 16  # a paged cache's block size (vLLM's default)


def _bytes(*tensors) -> int:
    from .measure import bytes_moved

    return bytes_moved(*tensors)


def _sample_inputs(M, N, make):
    # The sampler's tile loads are not held to 128 bits (checked=False); it refuses NaN
    # logits before it samples, so even the inspector's are values (read=True).
    return {"logits": make(M, N, checked=False, read=True)}


def _sample_bytes(a, backward):
    # read the logits; write one index per row
    return _bytes(a["logits"]) + 8 * a["logits"].shape[0]


def _decode_attention_inputs(M, N, make, paged=False, cache_dtype=None):
    """M requests, one new token each, over a full cache of N tokens (Qwen3-8B's heads;
    a small model's at N <= 256); the cache in q's dtype or ``cache_dtype``."""
    hq, hk = DECODE_HEADS if N > 256 else (8, 2)
    d = HEAD_DIM
    out = {"q": make(M, hq, 1, d), "cache_seqlens": make.lengths(M, N)}
    shape = (M * (N // DECODE_PAGE), hk, DECODE_PAGE, d) if paged else (M, hk, N, d)
    out["k_cache"] = make(*shape, dtype=cache_dtype)
    out["v_cache"] = make(*shape, dtype=cache_dtype)
    if paged:
        out["block_table"] = make.table(M, N // DECODE_PAGE)
    return out


def _decode_attention_fp8_inputs(M, N, make):
    """An e4m3 cache (vLLM's fp8) with one scale per k/v head, beside q's dtype. The
    scales are read before the launch: real values, also for the inspector."""
    import torch

    a = _decode_attention_inputs(M, N, make, cache_dtype=torch.float8_e4m3fn)
    hk = a["k_cache"].shape[1]
    scales = [torch.full((hk,), 2.0**-6, device=make.device) for _ in "kv"]
    return {**a, "k_scale": scales[0], "v_scale": scales[1]}


def _decode_attention_bytes(a, backward):
    # read q and the whole cache; write the output
    return _bytes(a["q"], a["k_cache"], a["v_cache"], a["q"])


def _decode_attention_formula(q, k_cache, v_cache, cache_seqlens):
    """Every query sees every cached key (full caches): SDPA without a mask."""
    from .formulas import torch_attention

    return torch_attention(q, k_cache, v_cache, causal=False)


def _decode_attention_shapes(smoke):
    if smoke:
        return [(1, 256, "decode")]
    return [(m, n, "decode") for n in DECODE_LENGTHS for m in DECODE_M]


def _penalize_inputs(M, N, make, seen=2048):
    """M rows of N logits, each row having seen ``seen`` tokens (at most N; the
    inspector's ids are zeros: valid), the three penalties a server sets."""
    T = min(seen, N)
    ids = make.index(M * T, N).view(M, T)
    return {
        "logits": make(M, N, checked=False),
        "token_ids": ids,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }


def _penalize_bytes(a, backward):
    x, ids = a["logits"], a["token_ids"]
    # read the logits and the ids, write y; the int32 counts: zeroed, added at each id,
    # read back
    return _bytes(x, x, ids) + 4 * (2 * x.numel() + ids.numel())


def _penalize_formula(
    logits, token_ids, repetition_penalty, presence_penalty, frequency_penalty
):
    """transformers' repetition penalty over the distinct ids, then vLLM's frequency
    and presence penalties, in the logits' dtype."""
    import torch

    B, V = logits.shape
    ids = token_ids.clamp(min=0)
    counts = torch.zeros(B, V, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, ids, (token_ids >= 0).to(logits.dtype))
    seen = counts > 0
    rho = repetition_penalty
    r = torch.where(logits < 0, logits * rho, logits / rho)
    y = torch.where(seen, r, logits) - frequency_penalty * counts
    return y - presence_penalty * seen.to(logits.dtype)


def _reshape_and_cache_inputs(M, N, make):
    """M new tokens (a decode batch, or a prefill chunk) written into a paged cache of
    at least N slots (Qwen3-8B's 8 key/value heads of 128; a small
    model's 2 heads of 64 at N <= 256), each to a slot of its own, scattered."""
    hk, d = (DECODE_HEADS[1], HEAD_DIM) if N > 256 else (2, 64)
    blocks = -(-max(N, M) // DECODE_PAGE)
    cache = (blocks, hk, DECODE_PAGE, d)
    return {
        "key": make(M, hk, d),
        "value": make(M, hk, d),
        "key_cache": make(*cache, checked=False),
        "value_cache": make(*cache, checked=False),
        "slot_mapping": make.slots(M, blocks * DECODE_PAGE),
    }


def _reshape_and_cache_returning(key, value, key_cache, value_cache, slot_mapping):
    """normbook.reshape_and_cache, returning the caches it wrote (the spec's call)."""
    import normbook

    normbook.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return key_cache, value_cache


def _reshape_and_cache_formula(key, value, key_cache, value_cache, slot_mapping):
    """vLLM's reference in PyTorch: each kept token's keys and values put at block
    slot // page, offset slot % page (an indexed write, in place)."""
    page = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache[slots // page, :, slots % page] = key[keep]
    value_cache[slots // page, :, slots % page] = value[keep]
    return key_cache, value_cache


def _reshape_and_cache_bytes(a, backward):
    # read the new keys, values and slots; write as many bytes into the caches
    k, v = a["key"], a["value"]
    return _bytes(k, v, k, v, a["slot_mapping"])


def _reshape_and_cache_shapes(smoke):
    """A decode batch (1, 8 or 64 tokens) and a 2,048-token prefill chunk, into a
    32,768-slot cache."""
    if smoke:
        return [(16, 256, "decode")]
    return [(m, 32768, "decode") for m in (*DECODE_M, 2048)]
