"""normbook.hf under transformers' attention masks: padding, packing, sliding windows, the
eager and SDPA implementations, generation with a KV cache, attn_implementation="normbook".

Each scenario against the *unpatched* model (transformers' own code is the reference), with
test_hf.py's tiny models and bounds: logits within 1e-5 relatively on the positions that are not
padding (a padded query position outputs zeros on the kernels, as on transformers' FlashAttention
path, and values no other position reads on eager and SDPA), greedy tokens equal, the loss and
every parameter's gradient within 1e-5 relatively.

The masks transformers 5.24 builds (seen by hooking the attention modules): eager, a float
(batch, 1, seq_q, seq_k) mask (0 keep, the dtype's minimum drop) for every call, the same tensor
for every layer of a kind; SDPA, None where its is_causal suffices (no padding) and a boolean mask
otherwise; Gemma 3 one mask for its sliding layers and one for its full ones (SDPA: None for the
full ones without padding); decoding, (batch, 1, 1, seq_k) masks whose keys include the prompt's
left padding (Gemma 3's sliding layers: only the window's last keys). Packed sequences (position_ids
restarting at 0, no attention_mask) are in the mask only when no KV cache is made: with the default
use_cache=True, even in a training step with labels, transformers 5.24 attends across the packed
sequences; the packing scenarios here pass use_cache=False.
"""

import copy
import gc
import warnings

import pytest
import torch

from normbook import DEVICE

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("normbook.hf")
from test_hf import SMALL, VOCAB, _randomize_norms, _rel  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.masking_utils import (  # noqa: E402
    and_masks,
    causal_mask_function,
    packed_sequence_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from normbook.hf import _masks  # noqa: E402

# 4 new tokens: the prefill and three steps over a cache holding the left padding
BATCH, SEQ, NEW_TOKENS = 2, 8, 4


def build(family, impl):
    """A tiny random model of ``family`` on attention implementation ``impl``."""
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, attn_implementation=impl))
    elif family == "qwen3_sliding":  # layer 0 full, layers 1 and 2 sliding (window 4)
        cfg = Qwen3Config(
            **{**SMALL, "num_hidden_layers": 3},
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            attn_implementation=impl,
        )
        model = Qwen3ForCausalLM(cfg)
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, attn_implementation=impl))
    else:  # Gemma 3's default pattern: 5 sliding layers (window 4), then a full one
        cfg = Gemma3TextConfig(
            **{**SMALL, "num_hidden_layers": 6},
            query_pre_attn_scalar=16,
            sliding_window=4,
            attn_implementation=impl,
        )
        model = Gemma3ForCausalLM(cfg)
    return _randomize_norms(model, 0.0 if family == "gemma3" else 1.0).to(DEVICE)


def _ids(batch=BATCH, seq=SEQ):
    # tokens 1..VOCAB-1: 0 is the pad token
    return torch.randint(1, VOCAB, (batch, seq), device=DEVICE)


def _padded(ids, left=(2, 0), right=(0, 3)):
    """attention_mask with ``left[b]`` pads before and ``right[b]`` after row b's tokens
    (default: row 0 left-padded, row 1 right-padded, in one batch); pads set to 0."""
    mask = torch.ones_like(ids)
    for b, (n, m) in enumerate(zip(left, right)):
        mask[b, :n] = 0
        mask[b, mask.shape[1] - m :] = 0
    return ids.masked_fill(mask == 0, 0), mask


# position_ids of packed rows: row 0 holds sequences of 3 and 5 tokens, row 1 of 2, 4, 2
PACKED = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 0, 1]])


def _pair(family, impl):
    ref = build(family, impl).eval()
    return ref, hf.patch(copy.deepcopy(ref))


def _check_logits(ref, patched, **kw):
    valid = kw.get("attention_mask")
    with torch.no_grad():
        got, want = patched(**kw).logits, ref(**kw).logits
    if valid is not None:
        got, want = got[valid.bool()], want[valid.bool()]
    assert _rel(got, want) <= 1e-5


def _check_loss_and_grads(ref, patched, **kw):
    want, got = ref(**kw), patched(**kw)
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * want.loss.item()
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(patched.named_parameters(), ref.parameters()):
        if q.grad is None or not q.grad.any():
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None, f"{name}: no gradient through the patched model"
        rel = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert rel <= 1e-5, f"{name}: relative gradient difference {rel:.3g}"


def inference(ref, patched):
    _check_logits(ref, patched, input_ids=_ids())


def padded_inference(ref, patched):
    ids, mask = _padded(_ids())
    _check_logits(ref, patched, input_ids=ids, attention_mask=mask)


def left_padded_generate(ref, patched):
    ids, mask = _padded(_ids(seq=6), left=(2, 0), right=(0, 0))
    # eos_token_id=None: a random model emits an EOS now and then (see test_hf.py)
    kw = dict(
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.no_grad():
        want, got = ref.generate(ids, **kw), patched.generate(ids, **kw)
    assert want.shape[1] == 6 + NEW_TOKENS
    assert torch.equal(got, want)


def right_padded_train(ref, patched):
    ids, mask = _padded(_ids(), left=(0, 0), right=(3, 0))
    labels = ids.masked_fill(mask == 0, -100)
    _check_loss_and_grads(
        ref.train(), patched.train(), input_ids=ids, attention_mask=mask, labels=labels
    )


def packed_train(ref, patched):
    ids = _ids()
    kw = dict(input_ids=ids, position_ids=PACKED.to(DEVICE), labels=ids)
    _check_loss_and_grads(ref.train(), patched.train(), use_cache=False, **kw)


SCENARIOS = {
    "inference": inference,
    "padded_inference": padded_inference,
    "left_padded_generate": left_padded_generate,
    "right_padded_train": right_padded_train,
    "packed_train": packed_train,
}
CHEAP = ("inference", "padded_inference")


def _cases(families):
    for family in families:
        for impl in ("eager", "sdpa"):
            for scenario in SCENARIOS:
                marks = () if scenario in CHEAP else (pytest.mark.slow,)
                yield pytest.param(
                    family,
                    impl,
                    scenario,
                    id=f"{family}-{impl}-{scenario}",
                    marks=marks,
                )


@pytest.fixture(autouse=True)
def _fresh_warnings():
    hf._attention._WARNED.clear()
    yield
    hf._attention._WARNED.clear()


@pytest.mark.parametrize(
    "family, impl, scenario",
    list(_cases(("qwen3", "llama", "gemma3", "qwen3_sliding"))),
)
def test_against_unpatched(family, impl, scenario):
    """Every scenario runs on the kernels (no warning: no call fell back) and computes what
    the unpatched model computes."""
    ref, patched = _pair(family, impl)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="normbook.hf")
        SCENARIOS[scenario](ref, patched)


def test_padding_and_packing_run_on_the_kernels(monkeypatch):
    """Padded and packed batches run varlen attention in every layer, not transformers'
    (and compute what it computes: the quick run's packing case)."""
    calls = []
    real = hf._attention._varlen_attention
    monkeypatch.setattr(
        hf._attention,
        "_varlen_attention",
        lambda *a, **k: calls.append(a[3].numel() - 1) or real(*a, **k),
    )
    ref, patched = _pair("qwen3", "sdpa")
    ids, mask = _padded(_ids())
    _check_logits(ref, patched, input_ids=ids, attention_mask=mask)
    assert calls == [BATCH] * 2  # one sequence a row, in each of the 2 layers
    calls.clear()
    packed = dict(input_ids=_ids(), position_ids=PACKED.to(DEVICE), use_cache=False)
    _check_logits(ref, patched, **packed)
    assert calls == [5] * 2  # 2 + 3 packed sequences


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_each_mask_is_read_once_per_forward(monkeypatch, impl):
    """Every layer receives the same mask tensor: read once (Gemma 3: one mask for its
    sliding layers, one for the full one), not once a layer."""
    reads = []
    real = _masks._read
    monkeypatch.setattr(_masks, "_read", lambda *a: reads.append(a[5]) or real(*a))
    ids, mask = _padded(_ids())
    with torch.no_grad():
        hf.patch(build("gemma3", impl)).eval()(ids, attention_mask=mask)
    assert sorted(reads, key=str) == [4, None]  # the sliding mask, the full one


def _custom_masks(ids):
    """A bidirectional boolean mask (SDPA's form) and a causal float mask with one extra
    hole (eager's form): transformers passes a 4-D mask through as given."""
    n = ids.shape[1]
    both = torch.ones(BATCH, 1, n, n, dtype=torch.bool, device=DEVICE)
    keep = torch.ones(n, n, device=DEVICE).tril().bool()
    keep[n - 1, 0] = False
    odd = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    return {"sdpa": both, "eager": odd.expand(BATCH, 1, n, n)}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_other_masks_fall_back_with_one_warning_or_raise_under_strict(impl):
    ref, patched = _pair("qwen3", impl)
    ids = _ids()
    mask = _custom_masks(ids)[impl]
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        with pytest.warns(UserWarning, match="Qwen3Attention") as record:
            got = patched(ids, attention_mask=mask).logits
            patched(ids, attention_mask=mask)  # warned once, not once a layer or call
        assert len([w for w in record if "normbook.hf" in str(w.message)]) == 1
        assert _rel(got, want) <= 1e-5
        hf.patch(patched, strict=True)
        with pytest.raises(ValueError, match="attention_mask"):
            patched(ids, attention_mask=mask)
        hf.patch(patched)  # strict off again: padding still runs on the kernels
        ids, pad = _padded(ids)
        patched(ids, attention_mask=pad)


def test_strict_accepts_every_mask_the_kernels_compute():
    ref = build("gemma3", "eager").eval()
    patched = hf.patch(copy.deepcopy(ref), strict=True)
    ids, mask = _padded(_ids())
    _check_logits(ref, patched, input_ids=ids, attention_mask=mask)
    assert not any(
        "_normbook_strict" in m.__dict__ for m in hf.unpatch(patched).modules()
    )


@pytest.mark.parametrize(
    "family, scenario",
    [
        ("qwen3", "padded_inference"),
        ("gemma3", "padded_inference"),
        pytest.param("qwen3", "left_padded_generate", marks=pytest.mark.slow),
        pytest.param("qwen3", "right_padded_train", marks=pytest.mark.slow),
    ],
    ids=lambda x: x,
)
def test_attn_implementation_normbook(monkeypatch, family, scenario):
    """attn_implementation="normbook" (registered on import of normbook.hf): the kernels run
    every layer's attention without patch(), against the unpatched SDPA model."""
    assert hf.register() == "normbook"  # idempotent
    calls = []
    for name in ("attention", "_varlen_attention"):
        real = getattr(hf._attention, name)
        monkeypatch.setattr(
            hf._attention,
            name,
            lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k),
        )
    ref = build(family, "sdpa").eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("normbook")
    assert model.config._attn_implementation == "normbook" and not hf.is_patched(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="normbook.hf")
        SCENARIOS[scenario](ref, model)
    assert calls
    fresh = AutoModelForCausalLM.from_config(ref.config, attn_implementation="normbook")
    assert fresh.config._attn_implementation == "normbook"


@pytest.mark.slow  # generation
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_static_cache(monkeypatch, impl):
    """A static cache: the prefill's mask is the top-left pattern (SDPA: None, its
    is_causal), on the kernels; a decoding step whose keys include empty slots after the
    query, which the kernels do not compute: transformers' attention, one warning."""
    alignments = []
    real = hf._attention.attention
    monkeypatch.setattr(
        hf._attention,
        "attention",
        lambda *a, **k: alignments.append(k["causal"]) or real(*a, **k),
    )
    ref, patched = _pair("qwen3", impl)
    ids = _ids(batch=1, seq=5)
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        cache_implementation="static",
    )
    with torch.no_grad(), pytest.warns(UserWarning, match="static cache") as record:
        want, got = ref.generate(ids, **kw), patched.generate(ids, **kw)
    assert len([w for w in record if "normbook.hf" in str(w.message)]) == 1
    assert torch.equal(got, want)
    # the prefill in each layer; then the last step, whose query fills the last slot (the
    # cache holds 5 + 3 - 1 tokens): the plain pattern again
    assert alignments == ["top_left"] * 2 + ["bottom_right"] * 2


# ---------------------------------------------------------------- reading masks directly


def _sdpa_mask(padding=None, packed=None, window=None, q_length=SEQ, kv_length=SEQ):
    fn = causal_mask_function
    if window is not None:
        fn = sliding_window_causal_mask_function(window)
    if packed is not None:
        from transformers.masking_utils import find_packed_sequence_indices

        fn = and_masks(
            fn, packed_sequence_mask_function(find_packed_sequence_indices(packed))
        )
    return sdpa_mask(
        batch_size=BATCH,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=kv_length - q_length,
        mask_function=fn,
        attention_mask=None if padding is None else padding.bool(),
        allow_is_causal_skip=False,
    )


@pytest.mark.parametrize("window", [None, 1, 3])
def test_layouts_of_padding_and_packing(window):
    _, pad = _padded(_ids())  # row 0: 2 pads, then 6 tokens; row 1: 5 tokens, 3 pads
    layout = _masks.mask_layout(
        _sdpa_mask(pad, window=window), "sdpa", BATCH, SEQ, SEQ, window
    )
    assert isinstance(layout, _masks.Varlen)
    assert (
        layout.q_index.tolist()
        == layout.k_index.tolist()
        == [*range(2, 8), *range(8, 13)]
    )
    if window != 1:  # window 1: every token alone, however the rows are cut
        assert (
            layout.cu_seqlens_q.tolist() == layout.cu_seqlens_k.tolist() == [0, 6, 11]
        )
    # decoding: 1 query; the keys include row 0's left padding (a window, not)
    _, left = _padded(_ids(), right=(0, 0))
    decode = _sdpa_mask(left, window=window, q_length=1)
    layout = _masks.mask_layout(decode, "sdpa", BATCH, 1, SEQ, window)
    if window is None:
        assert layout.cu_seqlens_q.tolist() == [0, 1, 2]
        assert layout.cu_seqlens_k.tolist() == [0, 6, 14]
    else:
        assert layout == _masks.Dense("bottom_right")
    packed = _sdpa_mask(packed=PACKED, window=window)
    layout = _masks.mask_layout(packed, "sdpa", BATCH, SEQ, SEQ, window)
    if window != 1:
        assert layout.cu_seqlens_k.tolist() == [0, 3, 8, 10, 14, 16]


def test_what_is_not_recognized():
    causal = _sdpa_mask()
    float_mask = torch.where(causal, 0.0, -1.0)  # a bias, not a mask
    # a static cache's decode step: the query is key SEQ - 1, the last 4 slots are empty
    static = torch.zeros(BATCH, 1, 1, SEQ + 4, dtype=torch.bool, device=DEVICE)
    static[..., :SEQ] = True
    for mask, kind in [
        (causal, "eager"),  # eager adds a boolean mask as 0/1
        (float_mask, "eager"),
        (torch.ones_like(causal), "sdpa"),  # bidirectional
        (static, "sdpa"),
        (causal[:, :, :, :-1], "sdpa"),  # not the shape of the scores
    ]:
        q, k = mask.shape[-2], max(mask.shape[-1], SEQ)
        layout = _masks.mask_layout(mask, kind, BATCH, q, k, None)
        assert isinstance(layout, _masks.Unrecognized), (kind, layout)
    assert isinstance(
        _masks.mask_layout(
            torch.where(causal, 0.0, -torch.inf), "eager", BATCH, SEQ, SEQ, None
        ),
        _masks.Dense,
    )


def test_masks_are_cached_by_identity_and_version_never_compared():
    _, pad = _padded(_ids())
    a = _sdpa_mask(pad)
    b = a.clone()  # equal values, another tensor: no elementwise comparison, own entry
    first = _masks.mask_layout(a, "sdpa", BATCH, SEQ, SEQ, None)
    assert _masks.mask_layout(a, "sdpa", BATCH, SEQ, SEQ, None) is first
    assert _masks.mask_layout(b, "sdpa", BATCH, SEQ, SEQ, None) is not first
    a[1] = a[0]  # in place: a new version, read again
    again = _masks.mask_layout(a, "sdpa", BATCH, SEQ, SEQ, None)
    assert again is not first and again.cu_seqlens_q.tolist() == [0, 6, 12]
    key = id(a)
    del a
    gc.collect()
    assert key not in _masks._LAYOUTS  # dropped with the mask: a reused id starts fresh
