"""normbook.sample against the exact filtered distribution (normbook.reference.sampling_probs).

Statistics with fixed seeds: every test here is deterministic. The chi-square tests use a
significance level of 1e-3 each: were the seeds random, a correct sampler would fail one of them
with probability 1e-3 (about 1% for the whole file); with the seeds fixed, the verdict is the same
on every run. Their power: with 8192 draws, a token of probability > 0.5%
wrongly dropped (expected count > 40, observed 0) adds > 40 to the statistic, more than the
1e-3 critical value for up to 12 degrees of freedom (32.9); a token wrongly kept is caught
exactly (its expected count is 0, so any draw of it fails); and a temperature off by 10% moves
the counts by far more (checked in test_chi_square_detects_a_wrong_temperature).
"""

import math

import mpmath
import pytest
import torch
from conftest import LOW_PRECISION, assert_rejected_before_launch

from normbook import DEVICE, _sampling_search, sample, sampling, sampling_split
from normbook import reference as ref

ALPHA = 1e-3
DRAWS = 8192


def chi_square(draws, probs):
    """(statistic, degrees of freedom, p-value, draws outside the support) of integer draws
    against float64 probabilities."""
    counts = torch.bincount(draws.cpu().reshape(-1), minlength=probs.numel()).double()
    expected = probs * draws.numel()
    support = probs > 0
    stat = (((counts - expected) ** 2) / expected)[support].sum().item()
    df = int(support.sum()) - 1
    pvalue = (
        float(mpmath.gammainc(df / 2, stat / 2, mpmath.inf, regularized=True))
        if df
        else 1.0
    )
    return stat, df, pvalue, int(counts[~support].sum())


def logits_row(n, seed, scale=1.0, dtype=torch.float32):
    """A row of n logits with well separated values (ties only where a test makes them)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


CONFIGS = [
    dict(),
    dict(temperature=0.6),
    dict(temperature=1.7, top_k=5),
    dict(top_p=0.8),
    dict(min_p=0.08),
    dict(temperature=0.8, top_k=9, top_p=0.95, min_p=0.02),
]


CASES = [(kw, torch.float32) for kw in CONFIGS] + [
    (CONFIGS[-1], torch.float16),
    (CONFIGS[-1], torch.bfloat16),
]


@pytest.mark.parametrize("kw, dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_chi_square_against_exact_distribution(kw, dtype):
    row = logits_row(12, seed=7, dtype=dtype)
    probs = ref.sampling_probs(row, **kw)
    assert probs[probs > 0].min() * DRAWS >= 5  # Cochran: every expected count >= 5
    # 8192 rows that share one row of memory (row stride 0): one launch, independent draws.
    draws = sample(row.to(DEVICE).expand(DRAWS, 12), generator=1234, **kw)
    stat, df, pvalue, outside = chi_square(draws, probs)
    assert outside == 0, f"{outside} draws of tokens the filters remove"
    assert pvalue > ALPHA, f"chi2 = {stat:.1f} with {df} dof, p = {pvalue:.2e}"


def test_chi_square_detects_a_wrong_temperature():
    """The test's power: the same draws judged against T = 1.1 instead of 1.0 fail it."""
    row = logits_row(12, seed=7)
    draws = sample(row.to(DEVICE).expand(DRAWS, 12), generator=1234)
    assert chi_square(draws, ref.sampling_probs(row))[2] > ALPHA
    assert chi_square(draws, ref.sampling_probs(row, temperature=1.1))[2] < ALPHA


def test_chi_square_with_a_torch_generator_and_ties():
    """Tied logits at the top-k boundary are kept together (Hugging Face keeps them too)."""
    row = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.5, -1.0, 3.0, 1.0])
    kw = dict(top_k=3)
    probs = ref.sampling_probs(row, **kw)
    assert int((probs > 0).sum()) == 6  # the 3rd largest value, 1.0, appears four times
    g = torch.Generator(device=DEVICE).manual_seed(99)
    draws = sample(row.to(DEVICE).expand(DRAWS, 8), generator=g, **kw)
    stat, df, pvalue, outside = chi_square(draws, probs)
    assert outside == 0 and pvalue > ALPHA, (stat, df, pvalue)


def kept_by_kernel(x, block_n=None, **kw):
    """The kernel's kept set, from the threshold key it stores: key(z) >= tau."""
    x2d = x.reshape(-1, x.shape[-1])
    rowmax = x2d.amax(-1)
    _, tau = sampling._launch(
        x2d,
        rowmax,
        kw.get("temperature", 1.0),
        kw.get("top_k"),
        kw.get("top_p"),
        kw.get("min_p"),
        5,
        block_n=block_n,
    )
    return (order_keys(x2d, kw.get("temperature", 1.0)) >= tau[:, None]).cpu()


def order_keys(x2d, temperature):
    """The kernel's order keys of z = (x - max x) / T (_sampling_search._order_key, in torch)."""
    inv_t = min(1.0 / temperature, torch.finfo(torch.float32).max)
    z = (x2d.float() - x2d.amax(-1).float()[:, None]) * torch.tensor(
        inv_t, dtype=torch.float32
    )
    z = torch.where(z == 0, torch.zeros_like(z), z)
    bits = z.view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@pytest.mark.parametrize("kw", CONFIGS[2:], ids=str)
@pytest.mark.parametrize("block_n", [None, 32])
def test_kept_set_equals_the_reference(kw, block_n):
    """Thresholds found by bisection equal the exact filters, row by row (one block or looped)."""
    g = torch.Generator().manual_seed(3)
    # The looped path runs one program per row: few rows keep the interpreter quick.
    x = (torch.randn(40 if block_n is None else 3, 100, generator=g) * 2).to(DEVICE)
    kept = kept_by_kernel(x, block_n=block_n, **kw)
    exact = ref.sampling_probs(x, **kw) > 0
    assert torch.equal(kept, exact), f"{int((kept != exact).sum())} tokens differ"


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_draws_stay_in_the_kept_set_of_each_row(dtype, poison_empty):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(300, 37, generator=g) * 3).to(dtype).to(DEVICE)
    kw = dict(temperature=0.9, top_k=10, top_p=0.9)
    draws = sample(x, generator=5, **kw)
    assert draws.dtype == torch.int64 and draws.shape == (300,)
    probs = ref.sampling_probs(x, **kw)
    assert bool((probs.gather(-1, draws.cpu()[:, None]) > 0).all())


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_greedy_is_the_first_argmax(dtype, poison_empty):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (64, 7), generator=g).to(dtype).to(DEVICE)  # many ties
    out = sample(x, temperature=0, top_k=3, top_p=0.5)
    assert torch.equal(
        out.cpu(), x.cpu().float().argmax(-1)
    )  # torch.argmax: first maximal index


def test_top_k_one_and_tiny_top_p_and_min_p_one_are_greedy():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(200, 33, generator=g) * 2).to(DEVICE)
    expected = x.argmax(-1).cpu()
    for kw in (
        dict(top_k=1),
        dict(top_p=1e-9),
        dict(min_p=1.0),
        dict(temperature=1e-30),
    ):
        assert torch.equal(sample(x, generator=9, **kw).cpu(), expected), kw


def test_one_finite_logit_among_minus_inf():
    x = torch.full((50, 20), float("-inf"), device=DEVICE)
    where = torch.arange(50) % 20
    x[torch.arange(50), where.to(DEVICE)] = torch.randn(50, device=DEVICE)
    for kw in (
        dict(),
        dict(top_k=5),
        dict(top_p=0.5),
        dict(min_p=0.5),
        dict(temperature=3.0),
    ):
        assert torch.equal(sample(x, generator=4, **kw).cpu(), where), kw


@pytest.mark.slow  # a 151,936-word row: not a small size
def test_vocabulary_of_qwen3_at_one_and_two_rows():
    """151,936 logits: the looped path (rows wider than a tile), at the decode batch sizes."""
    n = 151_936
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, n, generator=g) * 3).to(DEVICE)
    x[1, n - 1] = 20.0  # the last token dominates row 1
    assert torch.equal(sample(x, temperature=0).cpu(), x.argmax(-1).cpu())
    assert sample(x[:1], temperature=0).shape == (1,)
    kw = dict(top_k=50, top_p=0.9)
    draws = sample(x, generator=21, **kw)
    probs = ref.sampling_probs(x, **kw)
    assert bool((probs.gather(-1, draws.cpu()[:, None]) > 0).all())
    assert draws[1].item() == n - 1 or probs[1, draws[1]] > 0
    assert torch.equal(kept_by_kernel(x, **kw), probs > 0)


def test_same_seed_same_draws_and_generators_advance():
    x = torch.randn(64, 30, device=DEVICE)
    assert torch.equal(sample(x, generator=123), sample(x, generator=123))
    assert not torch.equal(sample(x, generator=123), sample(x, generator=124))
    g1 = torch.Generator(device=DEVICE).manual_seed(5)
    g2 = torch.Generator(device=DEVICE).manual_seed(5)
    first, second = sample(x, generator=g1), sample(x, generator=g1)
    assert not torch.equal(first, second)  # the generator advanced
    assert torch.equal(first, sample(x, generator=g2)) and torch.equal(
        second, sample(x, generator=g2)
    )
    torch.manual_seed(8)
    a = sample(x)
    torch.manual_seed(8)
    assert torch.equal(a, sample(x))  # generator=None follows torch's global seed


def test_draws_do_not_depend_on_the_tiling():
    """The Philox counter is the element's index in the (M, N) view, not a lane of a tile."""
    x = torch.randn(3, 50, device=DEVICE)
    rowmax = x.amax(-1)
    for kw in (dict(), dict(top_k=7, min_p=0.05)):
        args = (x, rowmax, 1.0, kw.get("top_k"), None, kw.get("min_p"), 77)
        one_block, _ = sampling._launch(*args)
        looped, _ = sampling._launch(*args, block_n=16)
        assert torch.equal(one_block, looped)


def test_shapes_strides_and_empty_inputs():
    base = torch.randn(6, 40, device=DEVICE)
    x = base[:, 3 : 3 + 30]  # row stride 40
    assert not x.is_contiguous()
    assert torch.equal(sample(x, generator=1), sample(x.contiguous(), generator=1))
    x3 = torch.randn(2, 3, 16, device=DEVICE)
    assert sample(x3, generator=1).shape == (2, 3)
    assert torch.equal(
        sample(x3, generator=1).reshape(-1), sample(x3.reshape(6, 16), generator=1)
    )
    xt = torch.randn(16, 5, device=DEVICE).t()  # last dimension not contiguous: copied
    assert torch.equal(sample(xt, generator=2), sample(xt.contiguous(), generator=2))
    assert sample(torch.randn(1, 5, device=DEVICE)).shape == (1,)
    assert sample(torch.randn(5, device=DEVICE)).shape == ()
    for shape in [(0, 16), (2, 0, 5), (0, 0)]:
        out = sample(torch.empty(shape, device=DEVICE))
        assert out.shape == shape[:-1] and out.dtype == torch.int64


def test_float64_is_accepted():
    x = torch.randn(20, 9, dtype=torch.float64, device=DEVICE)
    assert torch.equal(sample(x, temperature=0).cpu(), x.argmax(-1).cpu())
    assert torch.equal(sample(x, generator=3), sample(x.float(), generator=3))


def test_requires_grad_gives_indices_without_gradient():
    """Indices are integers: there is no gradient to drop, as for torch.argmax/multinomial."""
    x = torch.randn(4, 10, device=DEVICE, requires_grad=True)
    out = sample(x, generator=0)
    assert out.dtype == torch.int64 and not out.requires_grad


# ------------------------------------------------------------------ bad arguments, before any launch


def _ones():
    return torch.ones(3, 4, device=DEVICE)


def _with(i, j, value):
    x = torch.randn(3, 4, device=DEVICE)
    x[i, j] = value
    return x


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: sample([1.0, 2.0]), TypeError, "logits must be a torch.Tensor"),
        (
            lambda: sample(torch.ones(3, 4, dtype=torch.int64, device=DEVICE)),
            TypeError,
            "logits must be",
        ),
        (
            lambda: sample(torch.tensor(1.0, device=DEVICE)),
            ValueError,
            "at least one dimension",
        ),
        (
            lambda: sample(torch.ones(3, 0, device=DEVICE)),
            ValueError,
            "at least one entry",
        ),
        (
            lambda: sample(torch.ones(3, 4, device="meta")),
            ValueError,
            "logits is on meta",
        ),
        (lambda: sample(_with(1, 2, math.nan)), ValueError, "NaN"),
        (lambda: sample(_with(2, 0, math.inf), temperature=0), ValueError, "+inf"),
        (
            lambda: sample(torch.full((2, 4), -math.inf, device=DEVICE)),
            ValueError,
            "all -inf",
        ),
        (
            lambda: sample(_ones(), temperature=-0.5),
            ValueError,
            "temperature must be >= 0",
        ),
        (
            lambda: sample(_ones(), temperature=math.nan),
            ValueError,
            "temperature must be finite",
        ),
        (
            lambda: sample(_ones(), temperature=math.inf),
            ValueError,
            "temperature must be finite",
        ),
        (
            lambda: sample(_ones(), temperature="1"),
            TypeError,
            "temperature must be a real number",
        ),
        (lambda: sample(_ones(), top_k=0), ValueError, "top_k must be >= 1"),
        (lambda: sample(_ones(), top_k=2.0), TypeError, "top_k must be an int"),
        (lambda: sample(_ones(), top_k=True), TypeError, "top_k must be an int"),
        (lambda: sample(_ones(), top_p=0.0), ValueError, "top_p must be in (0, 1]"),
        (lambda: sample(_ones(), top_p=1.5), ValueError, "top_p must be in (0, 1]"),
        (lambda: sample(_ones(), top_p=math.nan), ValueError, "top_p must be finite"),
        (lambda: sample(_ones(), min_p=-0.1), ValueError, "min_p must be in [0, 1]"),
        (lambda: sample(_ones(), min_p=2), ValueError, "min_p must be in [0, 1]"),
        (lambda: sample(_ones(), generator=-1), ValueError, "generator as an int seed"),
        (
            lambda: sample(_ones(), generator=2**63),
            ValueError,
            "generator as an int seed",
        ),
        (
            lambda: sample(_ones(), generator=1.5),
            TypeError,
            "generator must be a torch.Generator",
        ),
        (lambda: sample(_ones(), generator="seed"), TypeError, "generator must be"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, exc, words, monkeypatch):
    assert_rejected_before_launch(monkeypatch, "sampling", call, exc, words)


# The GPU compiler's view of every sample variant (registers, spills, sm_90/80/75) is
# tests/lab/test_inspect.py's, like every other kernel's.


# ------------------------------------------------------------------ top-p at its boundary, and HF


def hf_kept(x, temperature=1.0, top_k=None, top_p=None):
    """The tokens Hugging Face's warpers keep, in its order (temperature, top-k, top-p)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    s = (
        x.double().cpu().reshape(-1, x.shape[-1])
    )  # float64: HF's own rounding out of the way
    s = TemperatureLogitsWarper(temperature)(None, s)
    if top_k is not None:
        s = TopKLogitsWarper(top_k)(None, s)
    if top_p is not None:
        s = TopPLogitsWarper(top_p)(None, s)
    return (s > -math.inf).reshape(x.shape)


def test_hugging_faces_own_top_p_examples():
    """transformers' test_top_p_dist_warper: log([0.3, 0.1, 0.1, 0.5]) with top_p = 0.8 keeps
    {0, 3} (the mass above each 0.1 token is exactly 0.8: it reaches top_p); the second row
    drops only 0.15. Its ramp: logits -5..4 keep three tokens at top_p = 0.9; ×100, one."""
    dist = torch.log(torch.tensor([[0.3, 0.1, 0.1, 0.5], [0.15, 0.3, 0.3, 0.25]]))
    expected = torch.tensor([[True, False, False, True], [False, True, True, True]])
    ramp = torch.arange(10, dtype=torch.float32).expand(2, 10) - 5
    ramp = ramp * torch.tensor([[1.0], [100.0]])
    for x, top_p, want in [(dist, 0.8, expected), (ramp, 0.9, None)]:
        for block_n in (None, 2):  # one block, and the looped path with several tiles
            kept = kept_by_kernel(x.to(DEVICE), block_n=block_n, top_p=top_p)
            assert torch.equal(kept, hf_kept(x, top_p=top_p))
            assert torch.equal(kept, ref.sampling_probs(x, top_p=top_p) > 0)
            if want is not None:
                assert torch.equal(kept, want)
    assert kept.sum(-1).tolist() == [3, 1]
    # And the draws: 4096 of the first row, never a 0.1 token.
    draws = sample(dist[0].to(DEVICE).expand(4096, 4), top_p=0.8, generator=3)
    assert set(draws.unique().tolist()) == {0, 3}


def test_mass_meant_to_be_exactly_top_p_at_the_vocabulary_of_qwen3():
    """A row whose two top tokens hold 0.5 + 0.3 and whose 151,934 others share 0.2 equally:
    the mass above every tail token is exactly 0.8, so top_p = 0.8 keeps two tokens. The fp32
    sums over the row err by far more than the few ulp of the 4-token example; the slack
    decides the row as exact arithmetic does. Just outside the band (0.8 · (1 + 2**-13)) the
    tail is kept, as the exact rule says."""
    n = 151_936
    p = torch.full((n,), 0.2 / (n - 2), dtype=torch.float64)
    p[7], p[n - 3] = 0.5, 0.3
    x = torch.log(p).float().to(DEVICE)
    kept = kept_by_kernel(x[None], top_p=0.8)[0]
    assert kept.nonzero().flatten().tolist() == [7, n - 3]
    assert torch.equal(kept, ref.sampling_probs(x, top_p=0.8)[None][0] > 0)
    assert bool(kept_by_kernel(x[None], top_p=0.8 * (1 + 2**-13)).all())


def test_top_p_slack_is_far_above_the_kernels_rounding():
    """The slack must exceed the relative error of the kernel's masses (fp32 e^z, summed by a
    tree within a tile and across tiles in order), or the band it decides would be decided by
    rounding again. Measured here on a vocabulary-sized row against float64: below 2**-20,
    16 times smaller than the slack. On a GPU, ex2.approx adds about 2 ulp (2**-22) per term,
    which moves a sum of positive terms by at most as much, relatively."""
    n = 151_936
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, generator=g) * 3
    z = (x - x.max()).float()
    e32 = torch.exp(z)
    # The kernel's order: tiles of SAMPLE_TILE summed by a tree, tiles added in turn.
    total = torch.zeros((), dtype=torch.float32)
    for tile in e32.split(_sampling_search.SAMPLE_TILE):
        total = total + tile.sum()
    exact = torch.exp(z.double()).sum()
    assert (
        abs(total.double() / exact - 1) < 2.0**-20 <= _sampling_search.TOP_P_SLACK / 16
    )


def test_top_p_ties_keep_the_whole_group_where_hugging_face_splits_it():
    """HF sorts, so among tokens tied at the boundary it keeps those its sort puts last. The
    kernel keeps the whole tie group: HF's kept set plus the rest of the group."""
    x = torch.log(torch.tensor([0.4, 0.15, 0.15, 0.15, 0.15]))
    kept = kept_by_kernel(x[None].to(DEVICE), top_p=0.5)[0]
    assert kept.tolist() == [True] * 5  # mass above the 0.15 group is 0.4 < 0.5
    hf = hf_kept(x, top_p=0.5)
    assert 1 < int(hf.sum()) < 5 and bool(hf[0]) and bool((kept | ~hf).all())


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_p=0.9),
        dict(top_k=20),
        dict(top_k=30, top_p=0.7),
        dict(temperature=0.7, top_k=50, top_p=0.95),
    ],
    ids=str,
)
@pytest.mark.parametrize("block_n", [None, 64])
def test_kept_set_equals_hugging_faces_warpers(kw, block_n):
    """Random rows (no ties), 300 tokens: the kernel's kept set is HF's, row by row."""
    g = torch.Generator().manual_seed(17)
    x = (torch.randn(8 if block_n is None else 3, 300, generator=g) * 2).to(DEVICE)
    assert torch.equal(kept_by_kernel(x, block_n=block_n, **kw), hf_kept(x, **kw))


def test_search_pins_the_threshold_in_its_passes():
    """SEARCH_PASSES passes of SEARCH_BITS bits cover the 2**31 keys of z in [-inf, 0]; the
    reads per row are the passes plus the draw (and the top-p total)."""
    assert _sampling_search.SEARCH_BITS * _sampling_search.SEARCH_PASSES >= 31
    assert (
        _sampling_search.KEY_LO <= _sampling_search.KEY_NEG_INF
        and _sampling_search.KEY_PAD < _sampling_search.KEY_LO
    )
    assert sampling.row_reads() == 1
    assert sampling.row_reads(top_k=True) == _sampling_search.SEARCH_PASSES + 1
    assert (
        sampling.row_reads(top_k=True, top_p=True)
        == 2 * _sampling_search.SEARCH_PASSES + 2
    )


@pytest.mark.parametrize("n", [50, 300])
def test_a_rows_threshold_and_draw_do_not_depend_on_its_batch(n):
    """Tiles depend on N only (never on M): row 0's threshold key and draw are the same alone
    and in batches of 3 and 64 (its Philox counters, r·N + c with r = 0, are the same too).
    A threshold found by a different reduction order could move at a top-p boundary."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(64, n, generator=g) * 2).to(DEVICE)
    filters = (0.9, 20, 0.8, None, 41)  # temperature, top-k, top-p, min-p, seed
    alone = sampling._launch(x[:1], x[:1].amax(-1), *filters)
    for m in (3, 64):
        batch = sampling._launch(x[:m], x[:m].amax(-1), *filters)
        assert batch[0][0] == alone[0][0] and batch[1][0] == alone[1][0]


# ------------------------------------------------------------------ a row split over programs


@pytest.mark.parametrize(
    "filters",
    [(0.8, 9, 0.7, None), (1.0, None, None, 0.05)],
    ids=["top_k-top_p", "min_p"],
)
def test_split_rows_draw_what_one_program_draws(filters, poison_empty):
    """The split path (one program per tile, a merge per launch) against the single-program
    loop over the same 32-element tiles: the same threshold key and the same token, bit for
    bit, with every kind of launch (counts, total, masses, draw; min-p applied in the draw's).
    40 keys: two tiles, the second one partial, holding three of the top 9 (one row: the
    interpreter runs 19 launches). The top-p threshold stands on the top-k one (its floor)
    and keeps fewer than 9 tokens, so a merge that dropped a tile or a step would move it;
    the poisoned buffers catch a state or partial that no launch wrote."""
    x = (logits_row(40, seed=5, scale=2.0) - 1.0)[None].to(DEVICE)
    assert int((x.topk(9).indices >= 32).sum()) == 3
    args = (x, x.amax(-1), *filters, 5)
    one = sampling._launch(*args, block_n=32, split=False)
    split = sampling._launch(*args, block_n=32, split=True)
    assert torch.equal(one[0], split[0]) and torch.equal(one[1], split[1])
    kept = int((order_keys(x, filters[0]) >= split[1][:, None]).sum())
    assert 1 < kept < (9 if filters[1] else 40), kept  # the last filter acted


def test_split_greedy_ties_across_tiles_go_to_the_first():
    """The row's maximum in tiles 0 and 2 (and twice in tile 2): the argmax merge keeps the
    earliest tile on a tie, as the loop does. Merging tiles last to first would pick 67."""
    x = logits_row(70, seed=6).clamp(max=1.0)
    x[[20, 65, 67]] = 4.0
    x = x[None].to(DEVICE)
    for temperature in (
        0.0,
        1e-30,
    ):  # greedy; the T -> 0 limit, a draw among the maxima
        args = (x, x.amax(-1), temperature, None, None, None, 3)
        out, _ = sampling._launch(*args, block_n=32, split=True)
        assert out.item() == 20 if temperature == 0.0 else out.item() in (20, 65, 67)
        assert torch.equal(out, sampling._launch(*args, block_n=32, split=False)[0])


@pytest.mark.slow  # rows of more tiles than one merge group: not a small size
def test_split_rows_merge_more_tiles_than_one_group():
    """Past MERGE_GROUP tiles a launch merges group after group (the tile count is an
    argument, not a constexpr): 18 tiles of 16 keys, two groups, the second one partial
    and its last tile too. The merged counts (top-k's nine launches: the interpreter runs
    18 programs each), the threshold and the token equal the single program's, bit for bit
    (totals and masses go through the same _merged: test_split_rows_draw_what_one_program
    _draws). Greedy, the maximum in tile 17 alone is found there, and one in tiles 1 and 17
    (a group apart) goes to tile 1, as in the loop."""
    assert sampling_split.MERGE_GROUP < 18 <= 2 * sampling_split.MERGE_GROUP
    x = (logits_row(16 * 17 + 5, seed=8, scale=2.0) - 1.0)[None].to(DEVICE)
    args = (x, x.amax(-1), 0.8, 9, None, None, 5)
    one = sampling._launch(*args, block_n=16, split=False)
    split = sampling._launch(*args, block_n=16, split=True)
    assert torch.equal(one[0], split[0]) and torch.equal(one[1], split[1])
    for at, want in (([16 * 17 + 3], 16 * 17 + 3), ([20, 16 * 17 + 3], 20)):
        peaked = x.clamp(max=1.0)
        peaked[0, at] = (
            4.0  # the maximum in the last group only, then also in the first
        )
        args = (peaked, peaked.amax(-1), 0.0, None, None, None, 3)
        assert sampling._launch(*args, block_n=16, split=True)[0].item() == want, at


def test_split_row_does_not_depend_on_its_batch():
    """The split path's grid is (rows, tiles) and a row's programs read only their row's
    partial sums: row x1's top-p threshold is the same alone and after x0, and its draw the
    same in the batches [x0, x1] and [x0, x1, x2] (its Philox counters, r·N + c with r = 1,
    are the same there). An index of the partials that used the batch size, not the tile
    count, would mix rows."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 20, generator=g) * 2).to(DEVICE)
    top_p = (1.0, None, 0.8, None, 17)
    alone = sampling._launch(x[1:2], x[1:2].amax(-1), *top_p, block_n=16, split=True)
    two = sampling._launch(x[:2], x[:2].amax(-1), *top_p, block_n=16, split=True)
    assert alone[1][0] == two[1][1]
    draw = (1.0, None, None, 0.01, 17)
    two = sampling._launch(x[:2], x[:2].amax(-1), *draw, block_n=16, split=True)
    three = sampling._launch(x, x.amax(-1), *draw, block_n=16, split=True)
    assert two[0][1] == three[0][1] and two[1][1] == three[1][1]


def test_split_is_chosen_from_the_vocabulary_size_only():
    """Rows of SAMPLE_SPLIT_MIN_N keys and more are split, at any M; the launches a split row
    takes: one per search pass, the top-p total and the draw, then the argmax merge."""
    assert sampling_split.SAMPLE_SPLIT_MIN_N > _sampling_search.SAMPLE_TILE
    assert len(sampling_split._split_steps(False, False)) == 1
    assert (
        len(sampling_split._split_steps(True, True))
        == 2 * _sampling_search.SEARCH_PASSES + 2
    )
    assert sampling.row_reads(top_k=True, top_p=True) == len(
        sampling_split._split_steps(True, True)
    )


def test_per_row_seeds_and_parameters_depend_on_the_row_alone():
    """(B,) tensors for every argument (vLLM's per-request parameters): row b's token is
    the token of a call on that row alone with its own values, bit for bit, wherever the
    row stands in the batch; the rows of one seed tensor draw independently (not all
    one token)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 300, generator=g).to(DEVICE) * 2
    kw = dict(
        temperature=torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.9], device=DEVICE),
        top_k=torch.tensor([300, 5, 40, 300, 7, 2], device=DEVICE),
        top_p=torch.tensor([1.0, 0.9, 0.8, 0.95, 1.0, 1.0], device=DEVICE),
        min_p=torch.tensor([0.0, 0.0, 0.05, 0.0, 0.1, 0.0], device=DEVICE),
        generator=torch.tensor([11, 12, 13, 14, 15, 16], device=DEVICE),
    )
    tokens = sample(x, **kw)
    for b in range(6):
        alone = sample(
            x[b : b + 1],
            **{
                k: float(v[b]) if v.is_floating_point() else int(v[b])
                for k, v in kw.items()
            },
        )
        assert torch.equal(tokens[b : b + 1], alone), b
    perm = torch.tensor([3, 0, 5, 1, 4, 2], device=DEVICE)
    shuffled = sample(x[perm], **{k: v[perm] for k, v in kw.items()})
    assert torch.equal(shuffled, tokens[perm])
    same_row = sample(
        x[:1].expand(64, 300),
        generator=torch.arange(64, device=DEVICE),
        temperature=torch.full((64,), 1.0, device=DEVICE),
    )
    assert len(set(same_row.tolist())) > 1  # 64 seeds, 64 draws, not one


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        ({"generator": torch.tensor([1, 2, 3])}, ValueError, "shape (2,)"),
        ({"generator": torch.tensor([1.0, 2.0])}, TypeError, "must be int64"),
        ({"top_k": torch.tensor([3, 0])}, ValueError, "row 1: top_k must be >= 1"),
        ({"temperature": torch.tensor([1, 2])}, TypeError, "floating point"),
        ({"top_p": torch.tensor([0.5, 1.5])}, ValueError, "row 1: top_p"),
        ({"generator": torch.tensor([-1, 2])}, ValueError, "row 0: generator"),
    ],
)
def test_bad_per_row_arguments_are_refused_before_launch(monkeypatch, kw, exc, words):
    kw = {k: v.to(DEVICE) for k, v in kw.items()}
    x = torch.randn(2, 16).to(DEVICE)
    assert_rejected_before_launch(
        monkeypatch, "sampling", lambda: sample(x, **kw), exc, words
    )
