"""A prompt's prefill two ways: normbook.attention (causal, over the prompt's own keys)
against normbook.decode_attention (the prompt as S_q new tokens of an empty cache).

The serving chapter's miniature server prefills with the first: decode_attention keeps
fp32 partial states for every chunk of the cache's capacity and every query row, which
the second test checks byte for byte against the formula the chapter uses. Past one
chunk of KV_CHUNK keys the two kernels sum the keys in different orders, so they agree
to fp32 rounding, not necessarily bit for bit.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from normbook import DEVICE, attention, decode_attention
from normbook import reference as ref
from normbook.decode_attention import KV_CHUNK, _forward


def partials_bytes(prompt, capacity, H_kv, group, D):
    """decode_attention's fp32 partial states (acc, m, l) for one prefill, one layer
    (the serving chapter's formula)."""
    chunks = -(-capacity // KV_CHUNK)
    return H_kv * chunks * group * prompt * (D + 2) * 4


def prompt_qkv(S, H, H_kv, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, h, S, D, generator=gen).to(DEVICE) for h in (H, H_kv, H_kv)
    )
    return q, k, v


def test_prefill_attention_matches_decode_attention():
    S, H, H_kv, D = 150, 4, 2, 16  # 150 keys: two chunks of KV_CHUNK = 128
    q, k, v = prompt_qkv(S, H, H_kv, D)
    lengths = torch.tensor([S], dtype=torch.int32, device=DEVICE)
    via_attention = attention(q, k, v, causal=True)
    via_decode = decode_attention(q, k, v, lengths)
    exact = ref.decode_attention(q, k, v, lengths)  # float64, causal over the new rows
    u = torch.finfo(torch.float32).eps / 2
    for out in (via_attention, via_decode):
        assert (out.double() - exact.double()).abs().max() < 64 * u
    gap = (via_attention - via_decode).abs().max()
    assert gap < 64 * u  # fp32 rounding apart, not more


class Allocations(TorchDispatchMode):
    """Bytes of fp32 tensors created (empty, empty_like) inside the mode."""

    MADE = {torch.ops.aten.empty, torch.ops.aten.empty_like}

    def __init__(self):
        super().__init__()
        self.fp32_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.MADE and out.dtype == torch.float32:
            self.fp32_bytes += out.numel() * out.element_size()
        return out


def test_prefill_partials_bytes():
    S, H, H_kv, D, capacity = 40, 4, 2, 16, 300  # 3 chunks of capacity
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, H, S, D, generator=gen, dtype=torch.bfloat16).to(DEVICE)
    k, v = (
        torch.randn(1, H_kv, capacity, D, generator=gen, dtype=torch.bfloat16).to(
            DEVICE
        )
        for _ in range(2)
    )
    lengths = torch.tensor([S], dtype=torch.int32, device=DEVICE)
    scale = D**-0.5
    with Allocations() as made:  # bf16 in: the only fp32 tensors are the partials
        out = _forward(q, k, v, lengths, None, scale, None, capacity)
    assert torch.equal(out, decode_attention(q, k, v, lengths))  # the op's launch
    assert made.fp32_bytes == partials_bytes(S, capacity, H_kv, H // H_kv, D)
