"""normbook.reshape_and_cache against an indexing reference: the cache after the call
equals the cache before with each token's key and value at its slot, bit for bit (a
copy has no rounding), and every other slot untouched.

Sizes: T = 11 tokens over 3 blocks of 4 slots with 2 k/v heads and D = 24 (not a power
of two: the head dimension's mask), slots in a random order with some -1: a wrong block
or slot index, a missed head, a write of a skipped token, or a write past D each changes
an element the reference compares.
"""

import pytest
import torch
from conftest import assert_rejected_before_launch, randn

from normbook import DEVICE, reshape_and_cache

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def case(T=11, H_kv=2, D=24, blocks=3, page=4, dtype=torch.float32, skip=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = randn(T, H_kv, D, dtype=dtype, generator=g)
    value = randn(T, H_kv, D, dtype=dtype, generator=g)
    kc = randn(blocks, H_kv, page, D, dtype=dtype, generator=g)
    vc = randn(blocks, H_kv, page, D, dtype=dtype, generator=g)
    slots = torch.randperm(blocks * page, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[:skip]] = -1
    return key, value, kc, vc, slots.to(DEVICE)


def expected(key, value, kc, vc, slots):
    kc, vc = kc.clone(), vc.clone()
    page = kc.shape[2]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kc[s // page, :, s % page] = key[t]
            vc[s // page, :, s % page] = value[t]
    return kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
def test_writes_each_token_at_its_slot_and_nothing_else(dtype):
    key, value, kc, vc, slots = case(dtype=dtype)
    want_k, want_v = expected(key, value, kc, vc, slots)
    reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize(
    "H_kv, D, dtype",
    [(5, 64, torch.float16), (3, 128, torch.bfloat16), (3, 256, torch.float32)],
)
def test_head_groups_that_do_not_divide_the_heads(H_kv, D, dtype):
    """A program copies a group of heads (four of 64 fp16 values, two of 128 bf16):
    five and three heads leave a last group cut short by the mask, and D = 256 fp32 is
    one head on two warps."""
    key, value, kc, vc, slots = case(T=5, H_kv=H_kv, D=D, dtype=dtype, skip=1)
    want_k, want_v = expected(key, value, kc, vc, slots)
    reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_strided_inputs_and_caches_and_int32_slots():
    """Keys as a view of a (T, 2·H_kv, D) tensor (q, k packed), caches as a slice of a
    larger pool along the blocks, int32 slots."""
    key, value, kc, vc, slots = case(seed=1)
    packed = torch.cat([key, value], dim=1)
    k_view, v_view = packed[:, :2], packed[:, 2:]
    pool_k = torch.cat([kc, kc.clone()], dim=1)  # (blocks, 2·H_kv, page, D)
    pool_v = torch.cat([vc, vc.clone()], dim=1)
    kc_view, vc_view = pool_k[:, 2:], pool_v[:, 2:]
    want_k, want_v = expected(key, value, kc, vc, slots)
    reshape_and_cache(k_view, v_view, kc_view, vc_view, slots.to(torch.int32))
    assert torch.equal(kc_view, want_k) and torch.equal(vc_view, want_v)
    assert torch.equal(pool_k[:, :2], kc) and torch.equal(pool_v[:, :2], vc)


def test_no_tokens_and_all_skipped():
    key, value, kc, vc, slots = case(T=0, skip=0)
    before = kc.clone()
    reshape_and_cache(key, value, kc, vc, slots)
    key, value, _, vc2, slots = case(skip=11)
    reshape_and_cache(key, value, kc, vc2, slots)
    assert torch.equal(kc, before)


def test_nan_and_inf_are_copied_as_bits():
    key, value, kc, vc, slots = case(skip=0, seed=2)
    key[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    reshape_and_cache(key, value, kc, vc, slots)
    s = int(slots[0])
    got = kc[s // 4, 0, s % 4, :3]
    assert got.isnan()[0] and got[1] == float("inf") and got[2] == -float("inf")


def _bad(**change):
    key, value, kc, vc, slots = case()
    args = dict(key=key, value=value, key_cache=kc, value_cache=vc, slot_mapping=slots)
    for name, f in change.items():
        args[name] = f(args[name])
    return args


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (dict(key=lambda t: t.tolist()), TypeError, "key must be a torch.Tensor"),
        (dict(key=lambda t: t.int()), TypeError, "key must be float32"),
        (dict(value=lambda t: t[:, :1]), ValueError, "value must match"),
        (dict(key_cache=lambda t: t.half()), TypeError, "key_cache must have key's"),
        (dict(value_cache=lambda t: t[:, :1]), ValueError, "value_cache must have"),
        (dict(slot_mapping=lambda t: t.float()), TypeError, "slot_mapping must be int"),
        (dict(slot_mapping=lambda t: t[:-1]), ValueError, "one slot per token"),
        (dict(slot_mapping=lambda t: t.clamp(min=0) * 0 + 12), ValueError, "[0, 12)"),
        (dict(slot_mapping=lambda t: t * 0 - 2), ValueError, "[0, 12)"),
        (dict(slot_mapping=lambda t: t.abs() * 0 + 5), ValueError, "twice"),
    ],
)
def test_bad_arguments_are_refused_before_launch(monkeypatch, change, exc, words):
    args = _bad(**change)
    assert_rejected_before_launch(
        monkeypatch, "reshape_and_cache", lambda: reshape_and_cache(**args), exc, words
    )
