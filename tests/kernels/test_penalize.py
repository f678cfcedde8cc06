"""normbook.penalize against its float64 formula (normbook.reference.penalize) and
transformers' RepetitionPenaltyLogitsProcessor.

Tolerances. The repetition penalty alone is one fp32 operation (a product, or a correctly
rounded division) then one rounding to the output: transformers computes the same in
fp32 (PyTorch's opmath for fp16/bf16) and rounds once, so it is compared bit for bit.
With the frequency and presence penalties the two fp32 subtractions round twice more:
the output is within ``u_out·|y| + 3·u32·(|r| + |φ c| + |π|)`` of the exact y (the last
rounding, and two fp32 roundings of partial results at most that large; 3 for slack). A
count off by one moves y by φ ≥ 0.25, a penalty applied to an unseen token by at least
|x|(1 − 1/ρ) or π: orders of magnitude above that bound.
"""

import pytest
import torch
from conftest import assert_rejected_before_launch, on_cpu, randn

from normbook import DEVICE, penalize
from normbook import reference as ref

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    RepetitionPenaltyLogitsProcessor,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def token_ids(B, T, V, seed, pad=0):
    """(B, T) ids with repeats (drawn from a third of the vocabulary), the last ``pad``
    of each row -1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(V // 3, 1), (B, T), generator=g)
    if pad:
        ids[:, T - pad :] = -1
    return ids.to(DEVICE)


def assert_within(y, x, ids, dtype, rho, pres, freq):
    exact = ref.penalize(on_cpu(x), on_cpu(ids), rho, pres, freq)
    x64 = on_cpu(x).double()
    c = torch.zeros_like(x64).scatter_add_(
        -1, on_cpu(ids).clamp(min=0), (on_cpu(ids) >= 0).double()
    )
    scale = x64.abs() * max(torch.as_tensor(rho).max().item(), 1.0)
    scale = scale + torch.as_tensor(freq).abs().max() * c
    scale = scale + torch.as_tensor(pres).abs().max()
    bound = U[dtype] * exact.abs() + 3 * 2.0**-24 * scale
    err = (on_cpu(y).double() - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_repetition_alone_is_transformers_bit_for_bit(dtype, poison_empty):
    """ρ = 1.3 over (B, T) ids with repeats: transformers' processor's bits, every
    dtype; the output poisoned first, so every element is written."""
    x = randn(4, 1500, dtype=dtype, scale=3.0)  # two vocabulary tiles
    ids = token_ids(4, 37, 1500, seed=1)
    y = penalize(x, ids, repetition_penalty=1.3)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(on_cpu(ids), on_cpu(x).clone())
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(on_cpu(y), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_three_penalties_against_float64(dtype, poison_empty):
    x = randn(3, 1100, dtype=dtype, scale=2.0)
    ids = token_ids(3, 1300, 1100, seed=2, pad=5)  # two tiles of ids, padded
    kw = dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25)
    y = penalize(x, ids, **kw)
    assert_within(y, x, ids, dtype, 1.2, 0.5, 0.25)
    assert not torch.equal(on_cpu(y), on_cpu(x))


def test_per_row_penalties_equal_separate_calls():
    """(B,) tensors: row b penalized with its own values, as a call on it alone."""
    x = randn(3, 300, scale=2.0)
    ids = token_ids(3, 50, 300, seed=3)
    rho = torch.tensor([1.0, 1.5, 0.8], device=DEVICE)
    pres = torch.tensor([0.0, 0.3, -0.2], device=DEVICE)
    freq = torch.tensor([0.1, 0.0, 0.4], device=DEVICE)
    y = penalize(
        x, ids, repetition_penalty=rho, presence_penalty=pres, frequency_penalty=freq
    )
    for b in range(3):
        one = penalize(
            x[b : b + 1],
            ids[b : b + 1],
            repetition_penalty=float(rho[b]),
            presence_penalty=float(pres[b]),
            frequency_penalty=float(freq[b]),
        )
        assert torch.equal(y[b : b + 1], one), b
    assert_within(y, x, ids, torch.float32, on_cpu(rho), on_cpu(pres), on_cpu(freq))


def test_counts_count_every_occurrence():
    """One id seen 2000 times (in two tiles of ids, many times per program: the
    atomic adds of one program collide) and one seen once: y = x − φ·count − π."""
    x = torch.zeros(1, 10, device=DEVICE)
    ids = torch.full((1, 2001), 7, device=DEVICE)
    ids[0, 1000] = 2
    y = on_cpu(penalize(x, ids, presence_penalty=1.0, frequency_penalty=0.5))[0]
    assert y[7] == -1001.0 and y[2] == -1.5 and bool((y[[0, 1, 3, 9]] == 0).all())


def test_neutral_penalties_and_empty_inputs():
    x = randn(2, 64)
    ids = token_ids(2, 9, 64, seed=4)
    assert torch.equal(penalize(x, ids), x)  # ρ = 1, π = φ = 0: unchanged
    assert torch.equal(penalize(x, ids[:, :0], repetition_penalty=2.0), x)
    assert torch.equal(penalize(x, torch.full_like(ids, -1), presence_penalty=1.0), x)
    assert penalize(randn(0, 64), ids[:0]).shape == (0, 64)


def test_strided_rows_and_non_finite_logits():
    """Rows of a wider buffer are read in place; -inf stays -inf (a masked token),
    NaN propagates as in any elementwise operation."""
    wide = randn(3, 200, scale=2.0)
    x = wide[:, :150]
    ids = token_ids(3, 20, 150, seed=5)
    kw = dict(repetition_penalty=1.4, frequency_penalty=0.2)
    assert torch.equal(penalize(x, ids, **kw), penalize(x.contiguous(), ids, **kw))
    x = x.contiguous()
    x[0, ids[0, 0]] = float("-inf")
    x[1, 5] = float("nan")
    y = on_cpu(penalize(x, ids, **kw))
    assert y[0, ids[0, 0]] == float("-inf") and y[1, 5].isnan()


BAD = [
    (
        lambda: (randn(2, 8).numpy(), token_ids(2, 3, 8, 0)),
        {},
        TypeError,
        "logits must",
    ),
    (lambda: (randn(2, 8).double(), token_ids(2, 3, 8, 0)), {}, TypeError, "float32"),
    (lambda: (randn(8), token_ids(1, 3, 8, 0)), {}, ValueError, "shape (B, V)"),
    (lambda: (randn(2, 8), token_ids(2, 3, 8, 0).int()), {}, TypeError, "int64"),
    (lambda: (randn(2, 8), token_ids(3, 3, 8, 0)), {}, ValueError, "token_ids must"),
    (
        lambda: (randn(2, 8), torch.tensor([[1, 8], [0, 0]], device=DEVICE)),
        {},
        ValueError,
        "[0, 8)",
    ),
    (
        lambda: (randn(2, 8), torch.tensor([[1, -2], [0, 0]], device=DEVICE)),
        {},
        ValueError,
        "got -2",
    ),
    (
        lambda: (randn(2, 8), token_ids(2, 3, 8, 0)),
        {"repetition_penalty": 0.0},
        ValueError,
        "repetition_penalty must be > 0",
    ),
    (
        lambda: (randn(2, 8), token_ids(2, 3, 8, 0)),
        {"repetition_penalty": torch.tensor([1.0, -1.0], device=DEVICE)},
        ValueError,
        "repetition_penalty must be > 0",
    ),
    (
        lambda: (randn(2, 8), token_ids(2, 3, 8, 0)),
        {"presence_penalty": float("nan")},
        ValueError,
        "presence_penalty must be finite",
    ),
    (
        lambda: (randn(2, 8), token_ids(2, 3, 8, 0)),
        {"frequency_penalty": torch.ones(3, device=DEVICE)},
        ValueError,
        "frequency_penalty as a tensor must have shape (2,)",
    ),
    (
        lambda: (randn(2, 8), token_ids(2, 3, 8, 0)),
        {"frequency_penalty": "0.5"},
        TypeError,
        "frequency_penalty must be a real number",
    ),
    (
        lambda: (randn(2, 8).requires_grad_(), token_ids(2, 3, 8, 0)),
        {},
        NotImplementedError,
        "no backward",
    ),
]


@pytest.mark.parametrize("make, kw, exc, words", BAD)
def test_bad_arguments_are_refused_before_launch(monkeypatch, make, kw, exc, words):
    assert_rejected_before_launch(
        monkeypatch, "penalize", lambda: penalize(*make(), **kw), exc, words
    )
