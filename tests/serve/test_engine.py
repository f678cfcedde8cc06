"""normbook.serve.Engine on tiny random Qwen3 models, against Hugging Face's own
``generate`` on the same model (greedy: its tokens exactly).

What each test guards: requests joining while others decode (more prompts than
max_num_seqs) and prompts longer than the token budget (chunked prefill beside
decoding) give HF's tokens; a cache too small for all requests at once preempts and
still gives them; a shared 12-token prefix costs fewer blocks than two requests apart;
identical prompts share even the partial block and copy it on the first write; stop
tokens stop; the repetition penalty is HF's processor's; speculative greedy decoding
(ragged acceptance over a batch) is the target's greedy; with ``batch_invariant=True`` a
seeded sampled request's logits are the same bits alone and beside three others started
at other steps. Sizes: 2 layers, hidden 64, 4 query and 2 k/v heads of 16, a vocabulary
of 256; prompts of 3 to 17 tokens, blocks of 4 tokens, budgets of 8 to 16: every prompt
spans several blocks and some several chunks, at interpreter speed.

Greedy ties: the logits are fp32 sums that differ from HF's by rounding only (another
order of additions), ~1e-7 relative; two tokens within that of each other in a random
model are unlikely, and the prompts are fixed, so a mismatch is a bug, not bad luck.
"""

import pytest
import torch

import normbook
from normbook.decode_attention import KV_CHUNK
from normbook.serve import Engine, SamplingParams

transformers = pytest.importorskip("transformers")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_new_tokens=6)


def tiny_qwen3(layers, seed):
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).to(normbook.DEVICE).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(2, seed=1)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 3, 17, 9)
    ]


def hf_greedy(model, prompt, n, **kw):
    ids = torch.tensor([prompt], device=normbook.DEVICE)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(prompt):].tolist()  # fmt: skip


@pytest.fixture(scope="module")
def want(target, prompts):
    return [hf_greedy(target, p, GREEDY.max_new_tokens) for p in prompts]


def engine(model, **kw):
    args = dict(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    return Engine(model, **{**args, **kw})


def test_continuous_batching_with_chunked_prefill_is_hf_greedy(target, prompts, want):
    """Five prompts, two running at a time, a budget of 8 tokens: the 11- and 17-token
    prompts are prefilled in chunks, some beside the others' decode steps, and each
    request joins as soon as another leaves."""
    e = engine(target, max_num_seqs=2, max_num_batched_tokens=8)
    ids = [e.add_request(p, GREEDY) for p in prompts]
    joined_while_decoding, seen = False, set()
    while e.has_unfinished():
        running = {r.id for r in e.running}
        events = e.step()
        first = {i for i, toks, _ in events if toks and i not in seen}
        joined_while_decoding |= bool(first and (running - first) & seen)
        seen |= {i for i, toks, _ in events if toks}
    assert [e.output_of(i) for i in ids] == want
    s = e.stats()
    assert joined_while_decoding and s["mixed_steps"] > 0
    assert s["blocks_used"] == 0  # everything given back


def test_a_cache_too_small_preempts_and_recomputes(target, prompts, want):
    e = engine(target, num_blocks=8)
    assert e.generate(prompts, GREEDY) == want
    s = e.stats()
    assert s["preemptions"] > 0 and s["blocks_used_peak"] <= 8


def test_a_shared_prefix_costs_fewer_blocks(target):
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 256, (12,), generator=g).tolist()
    pa, pb = base + [1, 2, 3], base + [7, 8]

    def run(ps, params=(GREEDY, GREEDY)):
        e = engine(target, max_num_batched_tokens=32)
        ids = [e.add_request(ps[0], params[0])]
        e.step()  # the first prompt's blocks computed, and registered
        ids += [e.add_request(p, params[1]) for p in ps[1:]]
        while e.has_unfinished():
            e.step()
        return [e.output_of(i) for i in ids], e.stats()

    both, s2 = run([pa, pb])
    _, s1 = run([pa])
    assert both == [hf_greedy(target, pa, 6), hf_greedy(target, pb, 6)]
    assert s2["shared_prefix_tokens"] == 12
    assert s2["blocks_used_peak"] < 2 * s1["blocks_used_peak"]
    # The same prompt twice: all but its last token shared, a partial block too. The
    # second request's outputs diverge (sampled, from a seed), so a write into the
    # shared block without a copy would change the first's tokens.
    other = SamplingParams(temperature=1.5, seed=3, max_new_tokens=6)
    same, s3 = run([pb, pb], (GREEDY, other))
    alone, _ = run([pb], (other,))
    assert same == [hf_greedy(target, pb, 6), alone[0]] and same[0] != same[1]
    assert s3["shared_prefix_tokens"] == len(pb) - 1 and s3["copy_on_write"] == 1


def test_stop_tokens_stop(target, prompts, want):
    stop = want[0][2]
    e = engine(target)
    params = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[stop])
    assert e.generate([prompts[0]], params) == [want[0][:3]]


def test_repetition_penalty_is_hf_processor(target, prompts):
    params = SamplingParams(temperature=0, max_new_tokens=8, repetition_penalty=1.5)
    e = engine(target)
    got = e.generate(prompts[:3], params)
    assert got == [hf_greedy(target, p, 8, repetition_penalty=1.5) for p in prompts[:3]]


def test_drafts_past_a_stop_token_are_not_counted_as_accepted(target, prompts, want):
    """The target as its own draft: every draft is accepted, and the second step's
    three drafts run past the stop token (want[2]); two of them were emitted."""
    assert want[0][2] not in want[0][:2]
    stop = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[want[0][2]])
    e = engine(target, draft_model=target, num_speculative_tokens=3)
    assert e.generate([prompts[0]], stop) == [want[0][:3]]
    s = e.stats()
    assert s["drafted"] == 3 and s["accepted"] == 2


def test_speculative_greedy_is_the_targets_greedy(target, prompts, want):
    """A layer-skipping draft (the target's first layer): it agrees often but not
    always, so acceptance is ragged across the batch; three run at once."""
    draft = tiny_qwen3(1, seed=1)
    draft.load_state_dict(
        {k: v for k, v in target.state_dict().items() if "layers.1." not in k}
    )
    e = engine(target, max_num_seqs=3, draft_model=draft, num_speculative_tokens=3)
    assert e.generate(prompts, GREEDY) == want
    s = e.stats()
    assert 0 < s["accepted"] < s["drafted"]


def test_batch_invariant_request_has_the_same_bits_beside_others(target, prompts):
    """A seeded sampled request alone, then beside three others started one, two and
    four steps apart: every logits row it drew from is the same bits, so its tokens
    are too."""
    mine = SamplingParams(temperature=0.9, seed=11, max_new_tokens=6)

    def run(others):
        e = engine(target, max_num_batched_tokens=8, batch_invariant=True)
        e.record_logits = True
        if others:
            e.add_request(prompts[3], SamplingParams(temperature=0, max_new_tokens=8))
            e.step()
        rid = e.add_request(prompts[1], mine)
        if others:
            e.step()
            e.add_request(prompts[0], SamplingParams(temperature=0.5, seed=1))
            e.step()
            e.step()
            e.add_request(prompts[4], SamplingParams(temperature=0, max_new_tokens=5))
        while e.has_unfinished():
            e.step()
        return e.output_of(rid), e.logits_of(rid)

    alone, alone_logits = run(False)
    beside, beside_logits = run(True)
    assert alone == beside and len(alone_logits) == 6
    assert all(torch.equal(a, b) for a, b in zip(alone_logits, beside_logits))


def test_batch_invariant_prefill_and_decode_give_a_token_the_same_bits():
    """The logits a token is drawn from when its request decodes it are the same bits
    as when the same text comes back as a prompt, prefilled in one chunk (an RL
    trainer's re-scoring of its own samples), and as when that prompt takes its keys
    from a cached prefix. KV_CHUNK + 2 prompt tokens: past one of decode_attention's
    chunks, where attention_varlen over the whole prompt rounds otherwise (a planted
    bug, varlen for prefill, fails the first comparison; with fewer keys it passes).
    One layer: the per-token prefill costs a program per token at interpreter speed."""
    model = tiny_qwen3(1, seed=1)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (KV_CHUNK + 2,), generator=g).tolist()
    e = engine(model, num_blocks=48, max_num_batched_tokens=160, batch_invariant=True)
    e.record_logits = True
    rid = e.add_request(
        prompt, SamplingParams(temperature=0.8, seed=3, max_new_tokens=3)
    )
    while e.has_unfinished():
        e.step()
    decoded, decoded_logits = e.output_of(rid), e.logits_of(rid)
    once = SamplingParams(temperature=0, max_new_tokens=1)
    fresh = engine(model, num_blocks=48, max_num_batched_tokens=160,
                   batch_invariant=True)  # fmt: skip
    fresh.record_logits = True
    whole = fresh.add_request(prompt + decoded[:2], once)
    fresh.step()  # the whole text in one chunk
    assert torch.equal(fresh.logits_of(whole)[0], decoded_logits[2])
    shared = fresh.add_request(prompt + decoded[:1], once)
    fresh.step()
    assert fresh.stats()["shared_prefix_tokens"] >= KV_CHUNK  # 3 tokens computed
    assert torch.equal(fresh.logits_of(shared)[0], decoded_logits[1])


def test_bad_arguments(target):
    with pytest.raises(TypeError, match="Qwen3"):
        Engine(torch.nn.Linear(2, 2), num_blocks=4, block_size=4, max_num_seqs=1,
               max_num_batched_tokens=4)  # fmt: skip
    for kw, exc, words in [
        (dict(num_blocks=0), ValueError, "num_blocks"),
        (dict(block_size=2.0), TypeError, "block_size"),
        (dict(num_speculative_tokens=2), ValueError, "draft_model"),
        (dict(draft_model=target), ValueError, "num_speculative_tokens"),
    ]:
        with pytest.raises(exc, match=words):
            engine(target, **kw)
    e = engine(target, num_blocks=2)
    for prompt, params, exc, words in [
        ([], GREEDY, ValueError, "empty"),
        ([1, 256], GREEDY, ValueError, "vocabulary"),
        ([1] * 9, GREEDY, ValueError, "blocks"),
        ([1], "greedy", TypeError, "SamplingParams"),
    ]:
        with pytest.raises(exc, match=words):
            e.add_request(prompt, params)
    for kw, exc, words in [
        (dict(temperature=-1), ValueError, "temperature"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(repetition_penalty=0), ValueError, "repetition_penalty"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(stop_token_ids="a"), TypeError, "stop_token_ids"),
    ]:
        with pytest.raises(exc, match=words):
            SamplingParams(**kw)


def test_speculative_seeded_request_draws_the_same_alone_and_beside_another(
    target, prompts
):
    """With drafts, a seeded sampled request's tokens do not depend on the batch: its
    first token is always a plain draw (never a verification that a split prompt would
    otherwise get), each later step verifies a number of drafts set by the request
    alone, and a preempted request resumes with the verification it would have run.
    Budget 8: beside the other request, the prompt is split differently."""
    draft = tiny_qwen3(1, seed=1)
    draft.load_state_dict(
        {k: v for k, v in target.state_dict().items() if "layers.1." not in k}
    )
    mine = SamplingParams(temperature=1.0, seed=5, max_new_tokens=8)
    kw = dict(max_num_batched_tokens=8, draft_model=draft, num_speculative_tokens=3)
    alone = engine(target, **kw).generate([prompts[0]], mine)
    e = engine(target, **kw)
    e.add_request(prompts[3], SamplingParams(temperature=0, max_new_tokens=8))
    e.step()
    rid = e.add_request(prompts[0], mine)
    while e.has_unfinished():
        e.step()
    small = engine(target, num_blocks=7, **kw)
    both = small.generate([prompts[3], prompts[0]], [GREEDY, mine])
    assert e.output_of(rid) == alone[0] == both[1]
    assert small.stats()["preemptions"] > 0
