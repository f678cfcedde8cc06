"""normbook.speculative_sample: exact (chi-square against p), the acceptance rate Σ min(p, q),
q = p accepts everything, reproducible, and bad arguments refused."""

import re

import pytest
import torch
from conftest import on_cpu

from normbook import DEVICE, speculative_sample
from normbook import reference as ref

V = 6


def dists(*shape, generator, sharp=1.0):
    """Random distributions over V tokens (last dimension), some tokens with probability 0."""
    logits = torch.randn(*shape, V, generator=generator, dtype=torch.float64) * sharp
    logits[..., 0] = float("-inf")  # token 0 impossible under this distribution
    return torch.softmax(logits, -1)


def draw(probs, generator):
    return torch.multinomial(
        probs.reshape(-1, probs.shape[-1]), 1, generator=generator
    ).view(probs.shape[:-1])


def chi_square_p_value(counts, expected):
    """Pearson's test; every expected count must be >= 5 for the χ² approximation to hold.
    The p-value is the χ² survival function, Q(df/2, X²/2) (the regularized upper
    incomplete gamma function; torch has it, so no scipy is needed)."""
    keep = expected > 0
    assert bool((counts[~keep] == 0).all()), "a token of probability 0 was emitted"
    assert float(expected[keep].min()) >= 5, (
        "too few draws for the chi-square approximation"
    )
    o, e = counts[keep].double(), expected[keep].double()
    assert abs(float(o.sum() - e.sum())) < 1e-6 * float(e.sum())
    x2 = ((o - e) ** 2 / e).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, x2 / 2))


@pytest.mark.parametrize("K", [1, 3])
def test_first_emitted_token_is_distributed_as_p(K):
    """One (p, q) pair replicated over many rows: the first emitted token (the accepted draft,
    or the replacement drawn from norm(max(0, p − q))) must follow p_1 exactly. p_1 and
    q_1 differ a lot (different random logits), so a wrong residual (e.g. drawing from p
    instead of (p − q)₊, or from q) is off by far more than the χ² test's resolution at
    40,000 draws."""
    g = torch.Generator().manual_seed(K)
    q1 = dists(1, K, generator=g, sharp=2.0)
    p1 = dists(1, K + 1, generator=g, sharp=2.0)
    p1[..., 0] = 0.0
    q1[..., 0] = 0.0
    q1[0, 0, 1] += 0.2  # token 1 more likely under the draft: rejected often
    q1 = q1 / q1.sum(-1, keepdim=True)
    n = 40_000
    q = q1.expand(n, K, V).contiguous()
    p = p1.expand(n, K + 1, V).contiguous()
    tokens = draw(q, g)
    out, accepted = speculative_sample(
        tokens.to(DEVICE), q.float().to(DEVICE), p.float().to(DEVICE), generator=1234
    )
    out, accepted = on_cpu(out, accepted)
    counts = torch.bincount(out[:, 0], minlength=V).double()
    assert chi_square_p_value(counts, n * p1[0, 0]) > 1e-3
    # The acceptance rate of the first draft: α = Σ min(p, q), binomial within 5σ.
    alpha = float(ref.speculative_acceptance(p1[0, 0], q1[0, 0]))
    rate = float((accepted > 0).double().mean())
    assert abs(rate - alpha) < 5 * (alpha * (1 - alpha) / n) ** 0.5


def test_every_emitted_position_follows_p_given_the_prefix():
    """With K = 2 and the same p at every position (p_i independent of the prefix), the token
    emitted at each position, among rows that reach it, follows p: the bonus token too."""
    g = torch.Generator().manual_seed(7)
    K, n = 2, 60_000
    q1 = dists(1, 1, generator=g, sharp=1.5)[0, 0]
    p1 = dists(1, 1, generator=g, sharp=1.5)[0, 0]
    q = q1.expand(n, K, V).contiguous()
    p = p1.expand(n, K + 1, V).contiguous()
    out, accepted = speculative_sample(
        draw(q, g).to(DEVICE), q.to(DEVICE), p.to(DEVICE), generator=99
    )
    out, accepted = on_cpu(out, accepted)
    for pos in range(K + 1):
        reached = accepted >= pos
        counts = torch.bincount(out[reached, pos], minlength=V).double()
        assert chi_square_p_value(counts, reached.sum() * p1) > 1e-3, pos
    # Acceptance count: geometric-truncated with α = Σ min(p, q) per position (i.i.d.
    # here).
    alpha = float(ref.speculative_acceptance(p1, q1))
    expected = torch.tensor(
        [(1 - alpha), alpha * (1 - alpha), alpha**2], dtype=torch.float64
    )
    observed = torch.bincount(accepted, minlength=K + 1).double()
    assert chi_square_p_value(observed, n * expected) > 1e-3


def test_q_equal_p_accepts_everything_and_emits_a_bonus():
    g = torch.Generator().manual_seed(3)
    B, K = 500, 4
    p = dists(B, K + 1, generator=g)
    q = p[:, :K].clone()
    tokens = draw(q, g)
    out, accepted = speculative_sample(
        tokens.to(DEVICE), q.to(DEVICE), p.to(DEVICE), generator=5
    )
    out, accepted = on_cpu(out, accepted)
    assert bool((accepted == K).all())
    assert torch.equal(out[:, :K], tokens)
    # the bonus, from p_{K+1}: never token 0 (p = 0)
    assert bool((out[:, K] >= 1).all())


def test_layout_of_tokens():
    """Accepted drafts, then the emitted token, then -1; num_accepted in [0, K]."""
    g = torch.Generator().manual_seed(4)
    B, K = 300, 3
    q, p = dists(B, K, generator=g, sharp=3), dists(B, K + 1, generator=g, sharp=3)
    tokens = draw(q, g)
    out, accepted = on_cpu(
        *speculative_sample(tokens.to(DEVICE), q.to(DEVICE), p.to(DEVICE), generator=0)
    )
    assert out.dtype == torch.int64 and accepted.dtype == torch.int64
    assert out.shape == (B, K + 1) and accepted.shape == (B,)
    assert bool((accepted >= 0).all() & (accepted <= K).all())
    assert len(set(accepted.tolist())) > 1  # the sizes here do give both outcomes
    for b in range(B):
        a = int(accepted[b])
        assert torch.equal(out[b, :a], tokens[b, :a])
        assert out[b, a] >= 1 and p[b, a, out[b, a]] > 0
        assert bool((out[b, a + 1 :] == -1).all())
        if a < K:  # the replacement comes from (p − q)₊: a token where p > q
            assert p[b, a, out[b, a]] > q[b, a, out[b, a]]


def test_reproducible_from_a_seed_or_a_generator():
    g = torch.Generator().manual_seed(8)
    q, p = dists(64, 2, generator=g), dists(64, 3, generator=g)
    args = (draw(q, g).to(DEVICE), q.to(DEVICE), p.to(DEVICE))
    a = speculative_sample(*args, generator=17)
    b = speculative_sample(*args, generator=17)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = speculative_sample(*args, generator=18)
    assert not torch.equal(a[0], c[0])
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    first = speculative_sample(*args, generator=g1)
    assert torch.equal(first[0], speculative_sample(*args, generator=g2)[0])
    # advanced
    assert not torch.equal(speculative_sample(*args, generator=g1)[0], first[0])


def test_empty_batch_and_k_zero():
    q = torch.rand(0, 2, V, device=DEVICE)
    out, acc = speculative_sample(
        torch.zeros(0, 2, dtype=torch.int64, device=DEVICE),
        q,
        torch.rand(0, 3, V, device=DEVICE),
        generator=0,
    )
    assert out.shape == (0, 3) and acc.shape == (0,)
    # K = 0: no draft, the bonus token alone, from p_1.
    p = torch.zeros(4, 1, V, device=DEVICE)
    p[..., 2] = 1.0
    out, acc = speculative_sample(
        torch.zeros(4, 0, dtype=torch.int64, device=DEVICE),
        torch.zeros(4, 0, V, device=DEVICE),
        p,
        generator=0,
    )
    assert bool((out[:, 0] == 2).all()) and bool((acc == 0).all())


def _good():
    q = torch.full((2, 3, V), 1.0 / V, device=DEVICE)
    p = torch.full((2, 4, V), 1.0 / V, device=DEVICE)
    return torch.zeros(2, 3, dtype=torch.int64, device=DEVICE), q, p


BAD = [
    (lambda t, q, p: (t.float(), q, p), {}, TypeError, "draft_tokens must be int64"),
    (
        lambda t, q, p: (t, q.long(), p),
        {},
        TypeError,
        "draft_probs must be floating-point",
    ),
    (
        lambda t, q, p: (t, q, (p * 6).int()),
        {},
        TypeError,
        "target_probs must be floating-point",
    ),
    (
        lambda t, q, p: (t.tolist(), q, p),
        {},
        TypeError,
        "draft_tokens must be a torch.Tensor",
    ),
    (
        lambda t, q, p: (t, q[:, :2], p),
        {},
        ValueError,
        "draft_probs must have shape (2, 3, V)",
    ),
    (
        lambda t, q, p: (t, q[:1], p),
        {},
        ValueError,
        "draft_probs must have shape (2, 3, V)",
    ),
    (
        lambda t, q, p: (t, q, p[:, :3]),
        {},
        ValueError,
        "target_probs must have shape (2, 4, 6)",
    ),
    (
        lambda t, q, p: (t, q, p[..., :5]),
        {},
        ValueError,
        "target_probs must have shape (2, 4, 6)",
    ),
    (
        lambda t, q, p: (t, q, p[:1]),
        {},
        ValueError,
        "target_probs must have shape (2, 4, 6)",
    ),
    (
        lambda t, q, p: (t[0], q, p),
        {},
        ValueError,
        "draft_tokens must have shape (B, K)",
    ),
    (
        lambda t, q, p: (t, q[0], p),
        {},
        ValueError,
        "draft_probs must have 3 dimensions",
    ),
    (lambda t, q, p: (t, q, p), {"generator": 1.5}, TypeError, "generator must be"),
    (
        lambda t, q, p: (t, q, p),
        {"generator": -1},
        ValueError,
        "generator as an int seed",
    ),
    (lambda t, q, p: (t + 6, q, p), {}, ValueError, "draft_tokens must be in [0, 6)"),
    (lambda t, q, p: (t - 1, q, p), {}, ValueError, "draft_tokens must be in [0, 6)"),
    (lambda t, q, p: (t, q * float("nan"), p), {}, ValueError, "must be finite"),
    (lambda t, q, p: (t, q, -p), {}, ValueError, "must be >= 0"),
    (lambda t, q, p: (t, q, p * 0), {}, ValueError, "needs positive mass"),
    (
        lambda t, q, p: (t, torch.cat([q[..., :1] * 0, q[..., 1:]], -1), p),
        {},
        ValueError,
        "draft probability 0",
    ),
]


@pytest.mark.parametrize("make, kwargs, exc, words", BAD, ids=[b[3] for b in BAD])
def test_bad_arguments(make, kwargs, exc, words):
    with pytest.raises(exc) as info:
        speculative_sample(*make(*_good()), **kwargs)
    assert words in str(info.value)


# ---------------------------------------------------------------- ragged drafts, seeds


def ragged_case(B=5, K=4, seed=11):
    """B rows with n_b in {0, …, K} drafts each; the positions past n_b poisoned (ids
    -1, probabilities NaN): a row reading past its drafts fails the value checks or
    the comparison."""
    g = torch.Generator().manual_seed(seed)
    q = dists(B, K, generator=g, sharp=1.5)
    p = dists(B, K + 1, generator=g, sharp=1.5)
    tokens = draw(q, g)
    n = torch.tensor([0, K, 1, K - 1, 2][:B])
    for b, n_b in enumerate(n.tolist()):
        tokens[b, n_b:] = -1
        q[b, n_b:] = float("nan")
        p[b, n_b + 1 :] = float("nan")
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    return tokens, q, p, n, seeds


def test_ragged_rows_equal_separate_calls_on_each_row():
    """Each row with its own count and seed equals a call on that row alone with
    K = n_b and its seed, bit for bit; over 40 seeds, so that both acceptances and
    rejections occur at several places."""
    for trial in range(40):
        tokens, q, p, n, seeds = ragged_case(seed=trial)
        out, acc = speculative_sample(
            tokens.to(DEVICE), q.to(DEVICE), p.to(DEVICE),
            num_draft_tokens=n.to(DEVICE), generator=seeds,
        )  # fmt: skip
        out, acc = on_cpu(out, acc)
        for b, n_b in enumerate(n.tolist()):
            one, acc_one = speculative_sample(
                tokens[b : b + 1, :n_b].to(DEVICE), q[b : b + 1, :n_b].to(DEVICE),
                p[b : b + 1, : n_b + 1].to(DEVICE), generator=int(seeds[b]),
            )  # fmt: skip
            one, acc_one = on_cpu(one, acc_one)
            assert int(acc[b]) == int(acc_one[0]) <= n_b
            assert out[b, : n_b + 1].tolist() == one[0].tolist()
            assert bool((out[b, n_b + 1 :] == -1).all())


def test_per_row_seeds_do_not_depend_on_position_or_padding():
    """The batch reversed, and padded to a larger K: every row's tokens move with it."""
    tokens, q, p, n, seeds = ragged_case(seed=3)
    args = lambda t, qq, pp: (t.to(DEVICE), qq.to(DEVICE), pp.to(DEVICE))  # noqa: E731
    a, _ = speculative_sample(*args(tokens, q, p), num_draft_tokens=n.to(DEVICE),
                              generator=seeds)  # fmt: skip
    r = torch.arange(4, -1, -1)
    b_, _ = speculative_sample(*args(tokens[r], q[r], p[r]),
                               num_draft_tokens=n[r].to(DEVICE), generator=seeds[r])  # fmt: skip
    pad_t = torch.cat([tokens, torch.full((5, 2), -1)], 1)
    pad_q = torch.cat([q, torch.full((5, 2, V), float("nan"))], 1)
    pad_p = torch.cat([p, torch.full((5, 2, V), float("nan"))], 1)
    c, _ = speculative_sample(*args(pad_t, pad_q, pad_p),
                              num_draft_tokens=n.to(DEVICE), generator=seeds)  # fmt: skip
    a, b_, c = on_cpu(a, b_, c)
    assert torch.equal(b_, a[r])
    assert torch.equal(c[:, :5], a) and bool((c[:, 5:] == -1).all())


def test_zero_drafts_draw_from_the_first_target_distribution():
    """n_b = 0 for every row, p one-hot: the emitted token is p's token."""
    B, K = 3, 2
    p = torch.zeros(B, K + 1, V, dtype=torch.float64)
    p[torch.arange(B), 0, torch.tensor([1, 4, 2])] = 1.0
    p[:, 1:] = float("nan")  # never read
    q = torch.full((B, K, V), float("nan"), dtype=torch.float64)
    out, acc = speculative_sample(
        torch.full((B, K), -1).to(DEVICE), q.to(DEVICE), p.to(DEVICE),
        num_draft_tokens=torch.zeros(B, dtype=torch.int64).to(DEVICE), generator=5,
    )  # fmt: skip
    out, acc = on_cpu(out, acc)
    assert out[:, 0].tolist() == [1, 4, 2] and acc.tolist() == [0, 0, 0]
    assert bool((out[:, 1:] == -1).all())


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(num_draft_tokens=torch.tensor([0, 1, 9, 0, 0])), ValueError, "[0, 4]"),
        (dict(num_draft_tokens=torch.tensor([0, 1, -1, 0, 0])), ValueError, "[0, 4]"),
        (dict(num_draft_tokens=torch.zeros(4, dtype=torch.int64)), ValueError, "(5,)"),
        (dict(num_draft_tokens=torch.zeros(5)), TypeError, "int32 or int64"),
        (dict(num_draft_tokens=[0, 1, 2, 3, 4]), TypeError, "num_draft_tokens"),
        (dict(generator=torch.zeros(4, dtype=torch.int64)), ValueError, "(5,)"),
        (dict(generator=torch.full((5,), -3)), ValueError, "[0, 2**63)"),
    ],
)
def test_bad_counts_and_seeds(kwargs, exc, words):
    tokens, q, p, n, seeds = ragged_case()
    kwargs = {"num_draft_tokens": n, "generator": seeds, **kwargs}
    if isinstance(kwargs["num_draft_tokens"], torch.Tensor):
        kwargs["num_draft_tokens"] = kwargs["num_draft_tokens"].to(DEVICE)
    with pytest.raises(exc, match=re.escape(words)):
        speculative_sample(tokens.to(DEVICE), q.to(DEVICE), p.to(DEVICE), **kwargs)
