r"""Speculative sampling: verify K draft tokens against the target model, exactly.

Leviathan, Kalman & Matias (2023) and Chen et al. (2023). A cheap draft model proposed
tokens :math:`x_1 … x_K`, :math:`x_i \sim q_i`; the target model scored all of them in
one pass and gave :math:`p_1 … p_{K+1}`. For each row, in order:

* accept :math:`x_i` with probability :math:`\min(1, p_i(x_i)/q_i(x_i))`;
* at the first rejection, emit one token drawn from
  :math:`\mathrm{norm}(\max(0, p_i - q_i))` and stop;
* if all K are accepted, emit a bonus token drawn from :math:`p_{K+1}`.

Every emitted token is then distributed exactly as :math:`p_i` (the chapter
"Speculative decoding" proves it with sympy): speculation changes the speed, never the
distribution.

This implementation is PyTorch (vectorized over rows; only per-row seeds draw their
uniforms in a Python loop over the rows, on the CPU), not a Triton kernel: its work is
K gathers and one inverse-CDF draw over the vocabulary per row, a few passes over
``(B, K+1, V)`` probabilities the target's forward pass already wrote. Random numbers:
one float64 uniform per (row, position) for the acceptance tests and one per row for
the emitted token, from a CPU ``torch.Generator`` seeded with
:func:`normbook.sampling.philox_seed`'s 64-bit key, so that results depend only on the
seed, never on the device.
"""

import torch

from . import _validate
from .sampling import _check_args, philox_seed

PROB_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check(draft_tokens, draft_probs, target_probs, generator):
    for name, t in (
        ("draft_tokens", draft_tokens),
        ("draft_probs", draft_probs),
        ("target_probs", target_probs),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _validate.check_device(t, name)
    if draft_tokens.dtype != torch.int64:
        raise TypeError(
            f"draft_tokens must be int64 token ids, got {draft_tokens.dtype}"
        )
    for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if t.dtype not in PROB_DTYPES:
            raise TypeError(
                f"{name} must be floating-point probabilities "
                f"(float32/float16/bfloat16/float64), got {t.dtype}"
            )
        if t.dim() != 3:
            raise ValueError(
                f"{name} must have 3 dimensions (batch, position, "
                f"vocabulary), got shape {tuple(t.shape)}"
            )
    if draft_tokens.dim() != 2:
        raise ValueError(
            f"draft_tokens must have shape (B, K), got {tuple(draft_tokens.shape)}"
        )
    B, K = draft_tokens.shape
    if draft_probs.shape[:2] != (B, K):
        raise ValueError(
            f"draft_probs must have shape ({B}, {K}, V) to match "
            f"draft_tokens (B, K), got {tuple(draft_probs.shape)}"
        )
    V = draft_probs.shape[2]
    if tuple(target_probs.shape) != (B, K + 1, V):
        raise ValueError(
            f"target_probs must have shape ({B}, {K + 1}, {V}): "
            "(B, K + 1, V) with draft_probs' B, K and V, got "
            f"{tuple(target_probs.shape)}"
        )
    if V == 0:
        raise ValueError("the vocabulary (last dimension) must not be empty")
    for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        _validate.check_same_device(name, t, "draft_tokens", draft_tokens)
    # the generator's checks, as normbook.sample (a tensor of seeds: _check_rows)
    if not isinstance(generator, torch.Tensor):
        _check_args(1.0, None, None, None, generator)


def _check_rows(draft_tokens, num_draft_tokens, generator):
    """num_draft_tokens and per-row seeds: their metadata (shape, dtype, device)."""
    B = draft_tokens.shape[0]
    if num_draft_tokens is not None and not isinstance(num_draft_tokens, torch.Tensor):
        raise TypeError(
            "num_draft_tokens must be None or a (B,) integer tensor, got "
            f"{type(num_draft_tokens).__name__}"
        )
    if num_draft_tokens is not None:
        _validate.check_index_vector(
            num_draft_tokens,
            "num_draft_tokens",
            B,
            "one per row",
            "draft_tokens",
            draft_tokens,
        )
    if isinstance(generator, torch.Tensor):  # seeds: any device, read on the host
        _validate.check_index_vector(generator, "generator", B, "one seed per row")


def _check_values(draft_tokens, q, p, n):
    """Token ids in range, probabilities finite and >= 0, each distribution with
    positive mass and each draft token possible under its draft distribution; only
    the positions a row uses (its ``n`` drafts, ``n + 1`` target distributions).
    One host synchronization."""
    K, V = q.shape[1], q.shape[-1]
    used_q = torch.arange(K, device=q.device)[None, :] < n[:, None]
    used_p = torch.arange(K + 1, device=q.device)[None, :] <= n[:, None]
    in_range = (draft_tokens >= 0) & (draft_tokens < V)
    q_x = q.gather(-1, draft_tokens.clamp(0, V - 1)[..., None])[..., 0]
    q_used, p_used = q[used_q], p[used_p]
    flags = torch.stack(
        [
            ~(in_range | ~used_q).all(),
            ~(torch.isfinite(q_used).all() & torch.isfinite(p_used).all()),
            (q_used < 0).any() | (p_used < 0).any(),
            ~((q_used.sum(-1) > 0).all() & (p_used.sum(-1) > 0).all()),
            (in_range & used_q & (q_x <= 0)).any(),
            (n < 0).any() | (n > K).any(),
        ]
    ).tolist()
    if flags[5]:
        raise ValueError(
            f"num_draft_tokens must lie in [0, {K}] (K = draft_tokens.shape[1]), got "
            f"values in [{int(n.min())}, {int(n.max())}]"
        )
    if flags[0]:
        bad = draft_tokens[used_q]
        raise ValueError(
            f"draft_tokens must be in [0, {V}) (the vocabulary), got "
            f"values in [{int(bad.min())}, {int(bad.max())}]"
        )
    if flags[1]:
        raise ValueError("draft_probs and target_probs must be finite (no NaN or inf)")
    if flags[2]:
        raise ValueError("draft_probs and target_probs must be >= 0")
    if flags[3]:
        raise ValueError(
            "every distribution in draft_probs and target_probs needs positive mass"
        )
    if flags[4]:
        raise ValueError(
            "a draft token has draft probability 0: it cannot have been "
            "drawn from draft_probs"
        )


def _draw(weights, u):
    """Inverse CDF: for each row of ``weights`` (>= 0, positive sum), the first index
    whose cumulative weight exceeds u · total, u in [0, 1). A zero-weight token is never
    drawn (its cumulative weight equals its predecessor's)."""
    cdf = weights.cumsum(-1)
    target = u[..., None] * cdf[..., -1:]
    idx = torch.searchsorted(cdf, target, right=True)[..., 0]
    return idx.clamp(max=weights.shape[-1] - 1)


def speculative_sample(
    draft_tokens, draft_probs, target_probs, *, num_draft_tokens=None, generator=None
):
    r"""Verify draft tokens against the target's probabilities.

    Args:
        draft_tokens: ``(B, K)`` int64, ``draft_tokens[b, i] ~ draft_probs[b, i]``.
        draft_probs: ``(B, K, V)`` probabilities ``q_i`` of the draft model (float).
        target_probs: ``(B, K + 1, V)`` probabilities ``p_i`` of the target model at
            the same positions, plus one past the last draft (the bonus token's).
        num_draft_tokens: None (every row has K drafts) or a ``(B,)`` int32/int64
            tensor ``n_b`` in ``[0, K]``: row b's drafts are its first ``n_b``, its
            bonus distribution ``target_probs[b, n_b]``; the positions past them are
            never read (nor checked: they may hold padding). ``n_b = 0``: the row
            just draws one token from ``target_probs[b, 0]``.
        generator: None (a seed from torch's global CPU generator), a
            ``torch.Generator`` (one seed drawn from it) or an int seed in
            [0, 2**63): see :func:`normbook.sampling.philox_seed`. Or a ``(B,)``
            int64 tensor of seeds, one per row: row b is then drawn exactly as a call
            on that row alone (with ``K = n_b`` and ``generator=seed_b``), whatever
            the other rows, its place in the batch, or the padding K.

    Returns:
        ``tokens`` ``(B, K + 1)`` int64: the accepted drafts, then the emitted token
        (the replacement of the first rejected draft, or the bonus token if all of the
        row's drafts were accepted), then -1; ``num_accepted`` ``(B,)`` int64 in
        ``[0, n_b]``. Each row emits ``num_accepted + 1`` tokens.

    Probabilities need not be normalized exactly: the acceptance test uses the ratio
    ``p_i(x)/q_i(x)`` as given and the draws normalize ``max(0, p_i − q_i)`` or
    ``p_{n+1}``. If a rejection leaves no residual mass (``p_i <= q_i`` everywhere,
    which happens with probability 0 when both sum to 1, but rounding can make it
    happen), the token is drawn from ``p_i``.

    Raises:
        TypeError / ValueError naming the argument: shapes (B, K, V mismatches), dtypes
        (integer probabilities, float token ids), devices, the generator; and, after one
        host synchronization, counts outside ``[0, K]``, token ids out of range,
        non-finite or negative probabilities, empty distributions, and draft tokens of
        draft probability 0 (at the positions a row uses).
    """
    _check(draft_tokens, draft_probs, target_probs, generator)
    _check_rows(draft_tokens, num_draft_tokens, generator)
    B, K = draft_tokens.shape
    device = draft_tokens.device
    if B == 0:
        empty = torch.empty((0, K + 1), dtype=torch.int64, device=device)
        return empty, torch.empty((0,), dtype=torch.int64, device=device)
    seeds = None
    if isinstance(generator, torch.Tensor):
        seeds = generator.to("cpu", torch.int64)
        if bool((seeds < 0).any()):
            raise ValueError("generator seeds must lie in [0, 2**63)")
        seed = 0
    else:  # a torch.Generator cannot cross an operator's schema: its one draw, here
        seed = philox_seed(generator)
    if num_draft_tokens is not None:
        num_draft_tokens = num_draft_tokens.to(torch.int64)
    return torch.ops.normbook.speculative_sample(
        draft_tokens, draft_probs.detach(), target_probs.detach(), seed,
        num_draft_tokens, seeds,
    )  # fmt: skip


def _uniforms(B, K, n, seed, seeds, device):
    """The acceptance tests' and the emitted token's uniforms: (B, K) and (B,). One
    generator for the batch, or with per-row ``seeds`` row b's own, drawing n_b then
    1, as a call on that row alone would."""
    if seeds is None:
        rng = torch.Generator(device="cpu").manual_seed(seed)
        u_accept = torch.rand((B, K), generator=rng, dtype=torch.float64)
        u_emit = torch.rand((B,), generator=rng, dtype=torch.float64)
        return u_accept.to(device), u_emit.to(device)
    u_accept = torch.zeros((B, K), dtype=torch.float64)
    u_emit = torch.zeros((B,), dtype=torch.float64)
    for b, (n_b, seed_b) in enumerate(zip(n.tolist(), seeds.tolist())):
        rng = torch.Generator(device="cpu").manual_seed(seed_b)
        u_accept[b, :n_b] = torch.rand((1, n_b), generator=rng, dtype=torch.float64)
        u_emit[b] = torch.rand((1,), generator=rng, dtype=torch.float64)[0]
    return u_accept.to(device), u_emit.to(device)


@torch.library.custom_op("normbook::speculative_sample", mutates_args=())
def _op(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    seed: int,
    num_draft_tokens: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.speculative_sample``: checked arguments and an int seed (or
    per-row seeds on the CPU). The values are checked here, before any draw: one host
    read."""
    B, K = draft_tokens.shape
    device = draft_tokens.device
    q = draft_probs.to(torch.float64)
    p = target_probs.to(torch.float64)
    n = num_draft_tokens
    if n is None:
        n = torch.full((B,), K, dtype=torch.int64, device=device)
    _check_values(draft_tokens, q, p, n)
    u_accept, u_emit = _uniforms(B, K, n.cpu(), seed, seeds, device)

    # Accept x_i iff u_i < p_i(x_i)/q_i(x_i), written u_i · q < p (no division; q > 0),
    # among the row's own n drafts.
    positions = torch.arange(K + 1, device=device)[None, :]
    used = positions[:, :K] < n[:, None]
    x = torch.where(used, draft_tokens, 0)
    p_x = p[:, :K].gather(-1, x[..., None])[..., 0]
    q_x = q.gather(-1, x[..., None])[..., 0]
    accepted = (u_accept * q_x < p_x) & used
    # drafts before the first "no"
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)

    # The emitted token's distribution: the residual at the first rejection, else the
    # bonus p_{n+1}.
    j = num_accepted
    rows = torch.arange(B, device=device)
    p_j = p[rows, j]
    q_pad = torch.cat([q, q.new_zeros(B, 1, q.shape[2])], dim=1)
    q_j = torch.where((j < n)[:, None], q_pad[rows, j], 0.0)  # past n: residual p
    residual = (p_j - q_j).clamp(min=0.0)
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_j, residual)
    emitted = _draw(residual, u_emit)

    drafts = torch.cat([x, x.new_zeros(B, 1)], dim=1)
    tokens = torch.where(positions < j[:, None], drafts, -1)
    tokens = torch.where(positions == j[:, None], emitted[:, None], tokens)
    return tokens, num_accepted


@_op.register_fake
def _(draft_tokens, draft_probs, target_probs, seed, num_draft_tokens=None, seeds=None):
    B, K = draft_tokens.shape
    tokens = draft_tokens.new_empty((B, K + 1))
    return tokens, draft_tokens.new_empty((B,))
