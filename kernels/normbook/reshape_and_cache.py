r"""Writing the new tokens' keys and values into a paged KV cache, in one launch.

A serving step computes keys and values for ``T`` new tokens of many requests at once
(prefill chunks, decode tokens, drafts to verify), packed as ``(T, H_kv, D)``. Each
token has a **slot**, an index into the cache's ``num_blocks · block_size`` slots:

.. math:: \text{slot}_t = \text{block\_table}[r, p \mathbin{/\!/} s]\cdot s
          + (p \bmod s)

for the token at position ``p`` of request ``r``, block size ``s``: vLLM's
``slot_mapping``, and its ``reshape_and_cache`` writes ``key[t]`` to
``key_cache[slot_t // s, :, slot_t % s]`` (this package's heads-before-slots layout,
the one :func:`normbook.decode_attention` reads). A slot of -1 is a token to skip
(padding). One program per token and group of k/v heads copies their ``D`` contiguous
values of the key and of the value (two heads of 128 at 16 bits: 128-bit accesses): a
copy, no arithmetic, so the cache holds the tokens' bits.

A Python loop of per-request scatters (what the serving chapter's miniature server did
before it used this) launches two copies per request per layer; this is one launch per
layer for the whole batch.
"""

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH
from ._runtime import device_guard

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _append_kernel(
    K,
    V,
    KC,
    VC,
    Slots,
    skt,
    skh,
    svt,
    svh,  # strides of the new keys and values (last dim contiguous)
    skcb,
    skch,
    skcs,
    svcb,
    svch,
    svcs,  # strides of the caches (blocks, heads, slots; last dim contiguous)
    H,
    D,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = (tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:  # -1: a padding token, nothing to write
        block = slot // PAGE
        pos = slot % PAGE
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < H) & (dims < D)
        k = tl.load(K + t * skt + heads * skh + dims, mask=mask)
        v = tl.load(V + t * svt + heads * svh + dims, mask=mask)
        tl.store(KC + block * skcb + heads * skch + pos * skcs + dims, k, mask=mask)
        tl.store(VC + block * svcb + heads * svch + pos * svcs + dims, v, mask=mask)


def _check(key, value, key_cache, value_cache, slot_mapping):
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _validate.check_device(key, "key")
    if key.dtype not in DTYPES:
        raise TypeError(f"key must be float32, float16 or bfloat16, got {key.dtype}")
    if key.dim() != 3:
        raise ValueError(f"key must have shape (T, H_kv, D), got {tuple(key.shape)}")
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(
            f"value must match key's shape and dtype {tuple(key.shape)} {key.dtype}, "
            f"got {tuple(value.shape)} {value.dtype}"
        )
    T, H_kv, D = key.shape
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dtype != key.dtype:
            raise TypeError(
                f"{name} must have key's dtype {key.dtype}, got {c.dtype} (an fp8 "
                "cache is written by normbook.quantize_kv, not here)"
            )
        if c.dim() != 4 or c.shape[1] != H_kv or c.shape[3] != D:
            raise ValueError(
                f"{name} must have shape (num_blocks, {H_kv}, block_size, {D}), got "
                f"{tuple(c.shape)}"
            )
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache must have key_cache's shape {tuple(key_cache.shape)}, got "
            f"{tuple(value_cache.shape)}"
        )
    _validate.check_index_vector(slot_mapping, "slot_mapping", T, "one slot per token")
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache",
                    value_cache), ("slot_mapping", slot_mapping)):  # fmt: skip
        _validate.check_same_device(name, t, "key", key)
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):  # fmt: skip
        if t.requires_grad:
            raise NotImplementedError(
                f"reshape_and_cache has no backward (a cache is written in place): "
                f"{name} requires grad; detach it"
            )


def _check_slots(slot_mapping, num_slots):
    """The slots' values, read on the host (one synchronization): each in [-1,
    num_slots), and no slot written twice (two programs would race on it)."""
    if slot_mapping.numel() == 0:
        return
    lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
    if lo < -1 or hi >= num_slots:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"slot_mapping must lie in [0, {num_slots}) (num_blocks · block_size), or "
            f"be -1 (skip), got {bad}"
        )
    used = slot_mapping[slot_mapping >= 0]
    if torch.unique(used).numel() != used.numel():
        raise ValueError("slot_mapping names a slot twice: two tokens would race on it")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write ``key[t]`` and ``value[t]`` into slot ``slot_mapping[t]`` of the caches,
    in place (vLLM's ``reshape_and_cache``), in one launch.

    Args:
        key, value: ``(T, H_kv, D)``, float32, float16 or bfloat16, last dimension
            contiguous: the new tokens' keys and values.
        key_cache, value_cache: ``(num_blocks, H_kv, block_size, D)`` of key's dtype
            and device (the layout :func:`normbook.decode_attention` reads), last
            dimension contiguous. A contiguous ``(B, H_kv, S_max, D)`` cache is the
            same thing with ``block_size = S_max``.
        slot_mapping: ``(T,)`` int32 or int64: token t goes to block
            ``slot // block_size``, slot ``slot % block_size``; -1 skips the token.
            No slot twice.

    Returns ``None``; the caches are modified.

    Raises:
        TypeError / ValueError naming the argument, before the launch (the slots'
        values cost one host read).
    """
    _check(key, value, key_cache, value_cache, slot_mapping)
    torch.ops.normbook.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping
    )


@torch.library.custom_op(
    "normbook::reshape_and_cache", mutates_args=("key_cache", "value_cache")
)
def _op(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``torch.ops.normbook.reshape_and_cache``: checked arguments; the slots' values
    here, before the launch."""
    num_blocks, _, page, _ = key_cache.shape
    _check_slots(slot_mapping, num_blocks * page)
    _forward(key, value, key_cache, value_cache, slot_mapping)


def _forward(key, value, key_cache, value_cache, slot_mapping):
    """Launch on checked arguments."""
    T, H_kv, D = key.shape
    if T == 0 or H_kv == 0 or D == 0:
        return
    k = key if key.stride(-1) == 1 else key.contiguous()
    v = value if value.stride(-1) == 1 else value.contiguous()
    # A program copies BLOCK_H heads of one token: at least 512 bytes (16 per thread
    # of a warp), so that each thread moves 128 bits at a time. One head of 128 fp16
    # values is 256 bytes, 64 bits per thread: two heads per program then.
    block_d = triton.next_power_of_2(D)
    head_bytes = block_d * key.element_size()
    block_h = min(triton.next_power_of_2(H_kv), max(1, 512 // head_bytes))
    warps = max(1, min(4, block_h * head_bytes // 512))
    with device_guard(key):
        _append_kernel[(T, triton.cdiv(H_kv, block_h))](
            k,
            v,
            key_cache,
            value_cache,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            *key_cache.stride()[:3],
            *value_cache.stride()[:3],
            H_kv,
            D,
            PAGE=key_cache.shape[2],
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            num_warps=warps,
            **LAUNCH,
        )


@_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping):
    return None
