r"""The book's formulas in plain float64 PyTorch: the oracle for every test and chapter.

Each function reads like the equation it implements and does nothing clever: it upcasts
its inputs to float64, computes the formula along the last dimension, and returns
float64. Kernels are checked against these functions, never the other way round.

Notation (as in the book): a row :math:`x \in \mathbb{R}^n`, weight :math:`\gamma`, bias
:math:`\beta`, and

.. math::
    \mu = \tfrac1n \textstyle\sum_i x_i, \quad
    \sigma^2 = \tfrac1n \textstyle\sum_i (x_i-\mu)^2, \quad
    \mathrm{RMS}(x) = \sqrt{\tfrac1n \textstyle\sum_i x_i^2}.
"""

import torch

f64 = torch.float64


def _d(t):
    return None if t is None else torch.as_tensor(t).to(f64)


# ---------------------------------------------------------------- statistics of a row


def mean(x):
    r"""μ = (1/n) Σ x_i."""
    return _d(x).mean(dim=-1, keepdim=True)


def mean_square(x):
    r"""s = (1/n) Σ x_i²."""
    return (_d(x) ** 2).mean(dim=-1, keepdim=True)


def rms(x, eps=0.0):
    r"""r = sqrt((1/n) Σ x_i² + ε)."""
    return torch.sqrt(mean_square(x) + eps)


def variance(x):
    r"""Population variance by its definition, two passes: σ² = (1/n) Σ (x_i − μ)²."""
    x = _d(x)
    return ((x - mean(x)) ** 2).mean(dim=-1, keepdim=True)


def variance_one_pass(x):
    r"""The textbook identity σ² = E[x²] − E[x]²: one pass, and numerically fragile."""
    return mean_square(x) - mean(x) ** 2


def welford(x):
    r"""Welford's online update over a 1-D sequence; returns (count, mean, M2), σ² = M2
    / count.

    n ← n + 1;  δ = x − μ;  μ ← μ + δ/n;  M2 ← M2 + δ (x − μ).
    """
    n, mu, m2 = 0, 0.0, 0.0
    for v in _d(x).reshape(-1).tolist():
        n += 1
        delta = v - mu
        mu += delta / n
        m2 += delta * (v - mu)
    return n, mu, m2


def chan_merge(a, b):
    r"""Chan et al.'s merge of two (count, mean, M2) summaries into the summary of their
    union.

    n = n_a + n_b;  δ = μ_b − μ_a;  μ = μ_a + δ n_b / n;  M2 = M2_a + M2_b + δ² n_a n_b
    / n.
    """
    na, mua, m2a = a
    nb, mub, m2b = b
    n = na + nb
    if n == 0:
        return 0, 0.0, 0.0
    delta = mub - mua
    return n, mua + delta * nb / n, m2a + m2b + delta * delta * na * nb / n


# ---------------------------------------------------------------- the normalizations


def rms_norm(x, weight=None, eps=1e-6, offset=0.0):
    r"""y_i = (offset + γ_i) x_i / sqrt((1/n) Σ_k x_k² + ε)   (offset 1 for Gemma's γ
    around 0)."""
    x = _d(x)
    y = x / rms(x, eps)
    return y if weight is None else y * (offset + _d(weight))


def rms_norm_rounded(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    r"""RMSNorm with the roundings of a casting convention written out, in float64.

    Each ``ρ(·)`` rounds to x's storage dtype (``t.to(dtype).double()``); everything
    else is exact float64, so the result is what the convention computes with perfect
    statistics:

    - llama:  y = ρ(ρ(x/r) · (offset + γ))
    - gemma:  y = ρ(x/r · (offset + γ))
    - none:   s = ρ(mean(ρ(x²))); rstd = ρ(1/sqrt(ρ(s + ε))); y = ρ(ρ(x · rstd) ·
      ρ(offset + γ))
    """
    dtype = torch.as_tensor(x).dtype

    def rho(t):
        return t.to(dtype).to(f64)

    x = _d(x)
    w = None if weight is None else offset + _d(weight)
    if casting_mode == "none":
        s = rho(rho(x * x).mean(dim=-1, keepdim=True))
        y = rho(x * rho(1.0 / torch.sqrt(rho(s + eps))))
        return y if w is None else rho(y * rho(w))
    y = x / rms(x, eps)
    if casting_mode == "llama":
        return rho(y) if w is None else rho(rho(y) * w)
    if casting_mode == "gemma":
        return rho(y if w is None else y * w)
    raise ValueError(
        f"casting_mode must be 'llama', 'gemma' or 'none', got {casting_mode!r}"
    )


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    r"""y_i = γ_i (x_i − μ) / sqrt(σ² + ε) + β_i."""
    x = _d(x)
    y = (x - mean(x)) / torch.sqrt(variance(x) + eps)
    if weight is not None:
        y = y * _d(weight)
    if bias is not None:
        y = y + _d(bias)
    return y


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0):
    r"""h = x + residual;  y = rms_norm(h).  Returns (y, h)."""
    h = _d(x) + _d(residual)
    return rms_norm(h, weight, eps, offset), h


def softmax(z):
    r"""p_i = exp(z_i − max z) / Σ_k exp(z_k − max z)."""
    z = _d(z)
    e = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


# ---------------------------------------------------------------- Jacobians and their
# products (one row)


def rms_norm_jacobian(x, weight=None, eps=1e-6):
    r"""J_ij = ∂y_i/∂x_j = γ_i (δ_ij / r − x_i x_j / (n r³)) for a single row x of
    length n."""
    x = _d(x)
    n = x.shape[-1]
    r = rms(x, eps)[..., 0]
    g = torch.ones_like(x) if weight is None else _d(weight)
    return g[:, None] * (
        torch.eye(n, dtype=f64, device=x.device) / r - torch.outer(x, x) / (n * r**3)
    )


def rms_norm_vjp(x, dy, weight=None, eps=1e-6):
    r"""Row-wise vector-Jacobian product of RMSNorm, in O(n) per row.

    dx = (γ ⊙ dy)/r − x · Σ_k x_k γ_k dy_k / (n r³);   dγ = Σ_rows dy ⊙ x / r.
    Returns (dx, dweight) with dweight None when weight is None.
    """
    x, dy = _d(x), _d(dy)
    n = x.shape[-1]
    r = rms(x, eps)
    g = torch.ones(n, dtype=f64, device=x.device) if weight is None else _d(weight)
    gdy = g * dy
    dx = gdy / r - x * (x * gdy).sum(dim=-1, keepdim=True) / (n * r**3)
    dw = None if weight is None else (dy * x / r).reshape(-1, n).sum(dim=0)
    return dx, dw


def layer_norm_jacobian(x, weight=None, eps=1e-5):
    r"""J = diag(γ) · (I − 11ᵀ/n − x̂ x̂ᵀ/n) / sqrt(σ² + ε), x̂ = (x − μ)/sqrt(σ² + ε);
    one row."""
    x = _d(x)
    n = x.shape[-1]
    s = torch.sqrt(variance(x) + eps)[..., 0]
    xhat = (x - mean(x)) / s
    g = torch.ones_like(x) if weight is None else _d(weight)
    ones = torch.ones(n, n, dtype=f64, device=x.device)
    eye = torch.eye(n, dtype=f64, device=x.device)
    inner = eye - ones / n - torch.outer(xhat, xhat) / n
    return g[:, None] * inner / s


def layer_norm_vjp(x, dy, weight=None, eps=1e-5):
    r"""Row-wise VJP of LayerNorm: with x̂ = (x − μ)/s, s = sqrt(σ² + ε), g = γ ⊙ dy,

    dx = (g − mean(g) − x̂ · mean(g ⊙ x̂)) / s;   dγ = Σ_rows dy ⊙ x̂;   dβ = Σ_rows dy.
    Returns (dx, dweight, dbias); dweight is None when weight is None.
    """
    x, dy = _d(x), _d(dy)
    n = x.shape[-1]
    s = torch.sqrt(variance(x) + eps)
    xhat = (x - mean(x)) / s
    g = dy if weight is None else _d(weight) * dy
    dx = (
        g - g.mean(dim=-1, keepdim=True) - xhat * (g * xhat).mean(dim=-1, keepdim=True)
    ) / s
    dw = None if weight is None else (dy * xhat).reshape(-1, n).sum(dim=0)
    db = dy.reshape(-1, n).sum(dim=0)
    return dx, dw, db


def softmax_jacobian(z):
    r"""J = diag(p) − p pᵀ for a single row z."""
    p = softmax(z)
    return torch.diag(p) - torch.outer(p, p)


# ---------------------------------------------------------------- RoPE and Qwen3's
# QK-Norm


def rope_cos_sin(positions, head_dim, base=10000.0):
    r"""cos and sin of θ_{m,i} = m · base^(−2i/d), i < d/2, each repeated so that
    dimension i and i + d/2 share an angle (the ``rotate_half`` layout). Shapes:
    positions (..., ) → (..., d)."""
    pos = _d(positions)
    inv_freq = base ** (
        -torch.arange(0, head_dim, 2, dtype=f64, device=pos.device) / head_dim
    )
    angles = pos[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cos(angles), torch.sin(angles)


def rotate_half(x):
    r"""(x_1, x_2) ↦ (−x_2, x_1) on the two halves of the last dimension."""
    x = _d(x)
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x, cos, sin):
    r"""RoPE: x ⊙ cos + rotate_half(x) ⊙ sin, for x (batch, seq, heads, d), cos/sin
    (batch, seq, d)."""
    x = _d(x)
    cos, sin = _d(cos)[..., None, :], _d(sin)[..., None, :]
    return x * cos + rotate_half(x) * sin


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6):
    r"""Qwen3's attention input path: per-head RMSNorm over head_dim, then RoPE. Returns
    (q, k)."""
    return (
        apply_rope(rms_norm(q, q_weight, eps), cos, sin),
        apply_rope(rms_norm(k, k_weight, eps), cos, sin),
    )


# ---------------------------------------------------------------- softmax, log-sum-exp,
# cross-entropy


def logsumexp(z):
    r"""lse(z) = m + log Σ_k exp(z_k − m),  m = max z  (keepdim, along the last
    dimension)."""
    z = _d(z)
    m = z.max(dim=-1, keepdim=True).values
    return m + torch.log(torch.exp(z - m).sum(dim=-1, keepdim=True))


def log_softmax(z):
    r"""log p_i = z_i − lse(z)."""
    z = _d(z)
    return z - logsumexp(z)


def softmax_vjp(z, dy):
    r"""Row-wise VJP of softmax: dx = p ⊙ (dy − Σ_k p_k dy_k), i.e. (diag(p) − p pᵀ)
    dy."""
    p, dy = softmax(z), _d(dy)
    return p * (dy - (p * dy).sum(dim=-1, keepdim=True))


def cross_entropy(logits, target, ignore_index=-100, reduction="mean"):
    r"""ℓ_r = lse(x_r) − x_{r, t_r} for rows with t_r ≠ ignore_index (0 for the others),
    reduced by "none", "sum" or "mean" (the sum over the kept rows divided by their
    number: 0/0 = NaN when every row is ignored). logits (M, V) or (V,), target (M,) or
    ()."""
    x = _d(logits)
    x = x.reshape(-1, x.shape[-1])
    t = torch.as_tensor(target).reshape(-1).to(torch.int64)
    keep = t != ignore_index
    picked = x.gather(1, torch.where(keep, t, 0)[:, None])[:, 0]
    loss = torch.where(keep, logsumexp(x)[:, 0] - picked, torch.zeros((), dtype=f64))
    if reduction == "none":
        return loss.reshape(torch.as_tensor(target).shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / keep.sum().to(f64)


def cross_entropy_grad(logits, target, ignore_index=-100, reduction="mean"):
    r"""∂(reduced loss)/∂x = (softmax(x) − e_t) per kept row (÷ the number of kept rows
    for "mean"), 0 for ignored rows; for "none" the gradient of the sum of the per-row
    losses."""
    x = _d(logits)
    x = x.reshape(-1, x.shape[-1])
    t = torch.as_tensor(target).reshape(-1).to(torch.int64)
    keep = t != ignore_index
    onehot = torch.zeros_like(x)
    onehot[keep, t[keep]] = 1.0
    g = torch.where(keep[:, None], softmax(x) - onehot, torch.zeros((), dtype=f64))
    if reduction == "mean":
        g = g / keep.sum().to(f64)
    return g.reshape(_d(logits).shape)


# ---------------------------------------------------------------- online softmax and
# attention


def online_softmax_state(z):
    r"""The online-softmax summary of a row part: (m, ℓ) = (max z, Σ exp(z − m)).

    The empty part is (−∞, 0), the identity of :func:`online_softmax_merge`."""
    z = _d(z).reshape(-1)
    if z.numel() == 0:
        return float("-inf"), 0.0
    m = z.max().item()
    if m == float("-inf"):
        return m, 0.0
    return m, torch.exp(z - m).sum().item()


def online_softmax_merge(a, b):
    r"""Merge two (m, ℓ) summaries of disjoint parts: m = max(m_a, m_b);
    ℓ = ℓ_a e^{m_a − m} + ℓ_b e^{m_b − m}. The log-sum-exp of the union is m + log ℓ."""
    (ma, la), (mb, lb) = a, b
    m = max(ma, mb)
    if m == float("-inf"):
        return m, 0.0  # two empty parts: still empty (and no −∞ − (−∞))
    return m, la * torch.exp(torch.tensor(ma - m, dtype=f64)).item() + lb * torch.exp(
        torch.tensor(mb - m, dtype=f64)
    ).item()


def attention_mask(seq_q, seq_k, causal=False, window=None, device=None):
    r"""Boolean (seq_q, seq_k) mask, True where query i may see key j.

    causal True / "bottom_right": j ≤ i + seq_k − seq_q; "top_left": j ≤ i; window W
    (with causal): also j > i + offset − W, i.e. at most W keys, the query's own
    last."""
    i = torch.arange(seq_q, device=device)[:, None]
    j = torch.arange(seq_k, device=device)[None, :]
    keep = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if causal:
        offset = 0 if causal == "top_left" else seq_k - seq_q
        keep = j <= i + offset
        if window is not None:
            keep = keep & (j > i + offset - window)
    return keep


def attention_scores(q, k, scale=None, softcap=None):
    r"""S = scale · Q Kᵀ in float64, k's heads repeated for GQA; with a cap c (Gemma 2's
    soft-capping), S = c · tanh(scale · Q Kᵀ / c). Shape (batch, heads, seq_q,
    seq_k)."""
    q, k = _d(q), _d(k)
    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * (q @ k.transpose(-1, -2))
    return s if not softcap else softcap * torch.tanh(s / softcap)


def attention(q, k, v, causal=False, scale=None, window=None, softcap=None):
    r"""O = softmax(S + mask) V in float64, for (batch, heads, seq, head_dim) inputs,
    with S = scale · Q Kᵀ (:func:`attention_scores`).

    k and v may have fewer heads (grouped-query attention: q head h uses k/v head h //
    (heads / kv_heads)). The mask adds −∞ where a key is hidden; a row that sees no key
    (every score −∞) is defined as 0, the empty sum, instead of softmax's 0/0 = NaN.
    A soft cap c (None or 0: none) replaces each score s by c · tanh(s / c) before the
    mask (Gemma 2)."""
    q, k, v = _d(q), _d(k), _d(v)
    group = q.shape[-3] // k.shape[-3]
    v = v.repeat_interleave(group, dim=-3)
    s = attention_scores(q, k, scale, softcap)
    keep = attention_mask(q.shape[-2], k.shape[-2], causal, window, device=s.device)
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    # fully masked row: shift by 0
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)  # exp(−∞) = 0 at every hidden key
    l = e.sum(dim=-1, keepdim=True)
    return (e @ v) / torch.where(l > 0, l, torch.ones_like(l))


def attention_probs(q, k, causal=False, scale=None, window=None, softcap=None):
    r"""P = softmax(S + mask) in float64 (S: :func:`attention_scores`); a row that sees
    no key is all zeros. Shape (batch, heads, seq_q, seq_k)."""
    s = attention_scores(q, k, scale, softcap)
    keep = attention_mask(q.shape[-2], k.shape[-2], causal, window, device=s.device)
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    l = e.sum(dim=-1, keepdim=True)
    return e / torch.where(l > 0, l, torch.ones_like(l))


def attention_lse(q, k, causal=False, scale=None, window=None, softcap=None):
    r"""L_i = log Σ_j exp(s_ij) over the keys row i sees (float64; s:
    :func:`attention_scores`); +inf for a row that sees none, so that exp(s − L) = 0
    there. Shape (batch, heads, seq_q)."""
    s = attention_scores(q, k, scale, softcap)
    keep = attention_mask(q.shape[-2], k.shape[-2], causal, window, device=s.device)
    lse = torch.logsumexp(s.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.where(keep.any(dim=-1), lse, torch.full_like(lse, float("inf")))


def attention_backward(
    q, k, v, do, causal=False, scale=None, window=None, softcap=None
):
    r"""(dQ, dK, dV) of attention, written as the book derives them (float64):

    P = softmax(S), dV = Pᵀ dO, dP = dO Vᵀ, D_i = Σ_d dO_id O_id (= Σ_j P_ij dP_ij),
    dS = P ∘ (dP − D), dQ = scale · dS K, dK = scale · dSᵀ Q; with GQA, dK and dV are
    summed over the q heads that share each k/v head. With a cap c the score is
    c · tanh(S₀ / c) of the raw S₀ = scale · Q Kᵀ, whose derivative is
    1 − tanh²(S₀ / c): dS₀ = dS ∘ (1 − tanh²(S₀ / c)) replaces dS in dQ and dK."""
    q, k, v, do = _d(q), _d(k), _d(v), _d(do)
    group = q.shape[-3] // k.shape[-3]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p = attention_probs(q, k, causal, scale, window, softcap)
    kr, vr = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    o = p @ vr
    dp = do @ vr.transpose(-1, -2)
    D = (do * o).sum(dim=-1, keepdim=True)
    ds = p * (dp - D)
    if softcap:
        t = torch.tanh(attention_scores(q, k, scale) / softcap)
        ds = ds * (1 - t * t)
    dq = scale * (ds @ kr)
    dk = scale * (ds.transpose(-1, -2) @ q)
    dv = p.transpose(-1, -2) @ do

    def per_kv_head(g):  # (B, H, S, D) -> (B, H_kv, S, D): sum each group of q heads
        return g.unflatten(-3, (k.shape[-3], group)).sum(dim=-3)

    return dq, per_kv_head(dk), per_kv_head(dv)


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, window=None,
    softcap=None,
):  # fmt: skip
    r"""Packed sequences in float64: q is (total_q, heads, head_dim), k and v (total_k,
    kv_heads, head_dim); sequence b is rows cu_q[b]:cu_q[b + 1] of q and cu_k[b]:cu_k[b
    + 1] of k, v, and sees its own keys only: :func:`attention` on each sequence (so
    ``causal`` is bottom-right within each), 0 for a query of a sequence without keys.
    Returns (total_q, heads, head_dim); autograd through it gives the vjp."""
    q, k, v = _d(q), _d(k), _d(v)
    cq, ck = (torch.as_tensor(c).tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    out = []
    for b in range(len(cq) - 1):
        qb, kb, vb = (
            t[c[b] : c[b + 1]].transpose(0, 1)[None]  # (1, heads, length, head_dim)
            for t, c in ((q, cq), (k, ck), (v, ck))
        )
        if kb.shape[-2] == 0:  # no key: the empty sum
            out.append(torch.zeros_like(qb[0].transpose(0, 1)))
            continue
        o = attention(qb, kb, vb, causal, scale, window, softcap)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out) if out else q[:0] * 0.0


# ---------------------------------------------------------------- sampling


def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None, min_p=None):
    r"""The exact distribution ``normbook.sample`` draws from, in float64, one row per
    last dim.

    z = (x − max x)/T and p ∝ e^z, restricted in Hugging Face's order to the tokens kept
    by top-k (z_i ≥ the k-th largest z; ties kept), then top-p over the renormalized
    top-k set (keep i iff Σ_{j kept: z_j > z_i} p_j < (1 − TOP_P_SLACK)·top_p; ties kept
    together), then min-p (p_i ≥ min_p · p_max ⇔ z_i ≥ ln min_p); renormalized. T = 0:
    all mass on the first argmax. The slack (2⁻¹⁶,
    normbook._sampling_search.TOP_P_SLACK) counts a mass within rounding of top_p as
    having reached it; without ties and outside that band, Hugging Face's
    TopPLogitsWarper (cumulative sum ascending, drop where it is ≤ 1 − top_p) keeps the
    same set.
    """
    from ._sampling_search import TOP_P_SLACK

    x = _d(logits)
    n = x.shape[-1]
    if temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(-1), n).to(f64)
    z = (x - x.amax(-1, keepdim=True)) / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None and top_k < n:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        keep &= z >= kth
    if top_p is not None:
        e = torch.where(keep, torch.exp(z), 0.0)
        zs, order = torch.sort(z, dim=-1)  # ascending
        tail = torch.flip(
            torch.cumsum(torch.flip(torch.gather(e, -1, order), [-1]), -1), [-1]
        )
        # tail[j] = Σ_{l ≥ j} e_(l)
        tail = torch.cat([tail, torch.zeros_like(tail[..., :1])], -1)
        first_above = torch.searchsorted(zs.contiguous(), z.contiguous(), right=True)
        mass_above = torch.gather(tail, -1, first_above)  # Σ e_j over z_j > z_i
        keep &= mass_above < (1 - TOP_P_SLACK) * top_p * e.sum(-1, keepdim=True)
    if min_p is not None:
        keep &= torch.exp(z) >= min_p
    p = torch.where(keep, torch.exp(z), 0.0)
    return p / p.sum(-1, keepdim=True)


def penalize(logits, token_ids, rho=1.0, presence=0.0, frequency=0.0):
    """y = r − φ·c − π·[c > 0], r = x·ρ (x < 0) or x/ρ where c > 0: c the count of each
    id in the row's ``token_ids`` (−1: padding); ρ, π, φ numbers or one per row."""
    x = _d(logits)
    c = torch.zeros_like(x)
    c.scatter_add_(-1, token_ids.clamp(min=0), (token_ids >= 0).to(f64))
    rho, presence, frequency = (
        _d(v).reshape(-1, 1) for v in (rho, presence, frequency)
    )
    r = torch.where(c > 0, torch.where(x < 0, x * rho, x / rho), x)
    return r - frequency * c - presence * (c > 0)


# ---------------------------------------------------------------- SwiGLU and the linear
# cross-entropy


def silu(x):
    r"""silu(x) = x σ(x) = x / (1 + e^{−x})."""
    x = _d(x)
    return x * torch.sigmoid(x)


def swiglu(gate, up):
    r"""y = silu(g) · u, elementwise."""
    return silu(gate) * _d(up)


def swiglu_vjp(gate, up, dy):
    r"""(dg, du) = (dy · u · σ(g)(1 + g(1 − σ(g))),  dy · g σ(g))."""
    g, u, dy = _d(gate), _d(up), _d(dy)
    s = torch.sigmoid(g)
    return dy * u * s * (1 + g * (1 - s)), dy * g * s


def linear_cross_entropy(hidden, weight, target, ignore_index=-100, reduction="mean"):
    r"""cross_entropy(h Wᵀ, t): the loss of a linear head, the logits computed in
    float64."""
    return cross_entropy(_d(hidden) @ _d(weight).T, target, ignore_index, reduction)


# ---------------------------------------------------------------- the matrix products


def linear(x, weight, bias=None):
    r"""y = x Wᵀ + b, over the last dimension of x (``torch.nn.functional.linear``)."""
    y = _d(x) @ _d(weight).T
    return y if bias is None else y + _d(bias)


def linear_vjp(x, weight, dy):
    r"""(dx, dW, db) = (δ W,  δᵀ x,  Σ_rows δ), the rows being every leading index of
    x and δ."""
    x2 = _d(x).reshape(-1, x.shape[-1])
    dy2 = _d(dy).reshape(-1, dy.shape[-1])
    return (dy2 @ _d(weight)).reshape(x.shape), dy2.T @ x2, dy2.sum(0)


# ---------------------------------------------------------------- decoding: KV cache,
# speculation


def cached_keys(cache, b, n, block_table=None):
    r"""Row b's first n cached keys (or values) as (H_kv, n, D): a contiguous cache (B,
    H_kv, S_max, D) is sliced; a paged one (num_blocks, H_kv, block_size, D) is gathered
    through block_table[b]: key j lives in block block_table[b, j // block_size], slot j
    % block_size."""
    if block_table is None:
        return _d(cache[b, :, :n])
    j = torch.arange(n)
    page = cache.shape[2]
    blocks = torch.as_tensor(block_table)[b].to(torch.int64).cpu()[j // page]
    return _d(cache.cpu()[blocks, :, j % page].transpose(0, 1))


def dequantize_kv(cache, scale):
    r"""An fp8 cache's values, x = x8 · κ in float64 (exact: 4 significant bits times an
    fp32 scale), κ a number, a 0-d or (1,) tensor (per tensor) or one per k/v head
    (dimension 1 of the cache)."""
    s = _d(scale).cpu().reshape(-1)
    return _d(cache).cpu() * s[None, :, None, None]


def decode_attention(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    block_table=None,
    scale=None,
    window=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
):
    r"""O[b] = softmax(scale · q[b] K_bᵀ + mask) V_b per row, in float64, where K_b, V_b
    are row b's n_b = cache_seqlens[b] cached keys and values and the S_q queries are
    its last S_q tokens: query i sees keys j ≤ n_b − S_q + i (bottom-right causal; with
    a window also j > n_b − S_q + i − W). A query that sees no key gives 0, as
    :func:`attention`; a soft cap c makes each score c · tanh(s / c) first. With
    scales, the caches are fp8 and dequantized first (:func:`dequantize_kv`)."""
    if k_scale is not None:
        k_cache = dequantize_kv(k_cache, k_scale)
    if v_scale is not None:
        v_cache = dequantize_kv(v_cache, v_scale)
    q = _d(q).cpu()
    out = torch.zeros_like(q)
    for b, n in enumerate(torch.as_tensor(cache_seqlens).tolist()):
        if n == 0:
            continue  # no key at all: 0
        k = cached_keys(k_cache.cpu(), b, n, block_table)[None]
        v = cached_keys(v_cache.cpu(), b, n, block_table)[None]
        out[b] = attention(
            q[b : b + 1],
            k,
            v,
            causal=True,
            scale=scale,
            window=window,
            softcap=softcap,
        )[0]
    return out


def speculative_acceptance(p, q):
    r"""α = Σ_x min(p(x), q(x)): the probability that a draft token x ~ q is accepted
    with probability min(1, p(x)/q(x)) (along the last dimension)."""
    return torch.minimum(_d(p), _d(q)).sum(-1)


def speculative_residual(p, q):
    r"""The distribution a rejected draft is replaced from: norm(max(0, p − q)). When p
    = q there is no residual (rejection never happens); returned as p then."""
    p, q = _d(p), _d(q)
    r = (p - q).clamp(min=0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / torch.where(total > 0, total, 1.0), p)


# ---------------------------------------------------------------- fp8, block scales


def fp8_blocks(s, block, shape):
    r"""A per-block tensor (M/bm, K/bk) spread over its blocks' elements: (M, K)."""
    s = _d(s).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return s[: shape[0], : shape[1]]


def dequantize_fp8(q, scale, block=(1, 128)):
    r"""x̃ = q · s_b: each fp8 value times its block's scale (exact in float64)."""
    return _d(q.float()) * fp8_blocks(scale, block, q.shape)


def linear_fp8(x_q, x_scale, w_q, w_scale, block_x=(1, 128), block_w=(128, 128)):
    r"""y = x̃ w̃ᵀ of the dequantized operands, in float64."""
    return dequantize_fp8(x_q, x_scale, block_x) @ (
        dequantize_fp8(w_q, w_scale, block_w).T
    )
