"""The engine: continuous batching over a paged KV cache, with chunked prefill,
prefix sharing, preemption by recomputation, stop tokens, per-request sampling and
speculative decoding (see :class:`Engine`)."""

from collections import deque

import torch

import normbook

from .blocks import BlockManager, Sequence
from .params import SamplingParams, token_seed
from .runner import Chunk, KVPool, check_model, forward

_TARGET, _DRAFT, _VERIFY = 0, 1, 2  # salts of a request's draws


class _Request:
    def __init__(self, rid, prompt, params, seed, arrival):
        self.id, self.prompt, self.params, self.seed = rid, prompt, params, seed
        self.arrival = arrival
        self.output: list[int] = []
        self.seq = Sequence()
        self.draft_computed = 0  # tokens with the draft model's keys and values
        self.finished = False
        self.logits: list[torch.Tensor] = []  # recorded when Engine.record_logits

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output)


def _int(value, name, low):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


class Engine:
    """Serve a Hugging Face Qwen3 causal LM on this package's kernels.

    Args:
        model: a ``Qwen3ForCausalLM`` on the kernels' device, in eval mode.
        num_blocks, block_size: the KV cache, ``num_blocks`` blocks of ``block_size``
            tokens shared by all requests (per layer, keys and values).
        max_num_seqs: at most this many requests run at once; the others wait.
        max_num_batched_tokens: a step's token budget: decode tokens, drafts to
            verify and prefill chunks together. A prompt longer than what is left is
            prefilled in chunks over several steps, beside the others' decoding.
        batch_invariant: a request's bits do not depend on what runs beside it, nor
            on how its tokens arrive (in a prompt, a chunk, a decode step or a
            verification): the products are ``normbook.linear`` (rows independent of
            the batch), and every new token attends through ``decode_attention`` as
            its own row, over the keys up to its own, as a decode step computes it.
            So a shared prefix's keys are the ones a request would compute itself,
            and prefix sharing stays on. The price: attention's fp32 partial states
            grow as the step's tokens times the longest table's chunks.
        draft_model: a smaller Qwen3 with the same vocabulary, for speculative
            decoding; its own KV cache uses the same block tables.
        num_speculative_tokens: K >= 1 drafts per request per step with a draft model.

    ``add_request`` queues a prompt; each ``step`` schedules, runs the draft (if any)
    and one target forward pass, samples, and returns ``[(id, new_token_ids,
    finished)]``; ``generate`` runs requests to the end. ``stats()`` counts blocks,
    preemptions, shared prefixes and drafts; ``trace`` lists each step's (id, tokens,
    kind). With ``record_logits = True`` the target
    logits each token was drawn from are kept (``logits_of(id)``).
    """

    def __init__(
        self,
        model,
        *,
        num_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        batch_invariant=False,
        draft_model=None,
        num_speculative_tokens=0,
    ):
        check_model(model)
        _int(num_blocks, "num_blocks", 1)
        _int(block_size, "block_size", 1)
        _int(max_num_seqs, "max_num_seqs", 1)
        _int(max_num_batched_tokens, "max_num_batched_tokens", 1)
        _int(num_speculative_tokens, "num_speculative_tokens", 0)
        if not isinstance(batch_invariant, bool):
            raise TypeError("batch_invariant must be a bool")
        if draft_model is not None:
            check_model(draft_model)
            if draft_model.config.vocab_size != model.config.vocab_size:
                raise ValueError(
                    "draft_model must have the target's vocabulary "
                    f"({model.config.vocab_size}), got {draft_model.config.vocab_size}"
                )
            if num_speculative_tokens < 1:
                raise ValueError("a draft_model needs num_speculative_tokens >= 1")
        elif num_speculative_tokens:
            raise ValueError("num_speculative_tokens needs a draft_model")
        if num_speculative_tokens + 1 > max_num_batched_tokens:
            raise ValueError(
                "max_num_batched_tokens must hold one request's K + 1 verified tokens"
            )
        self.model, self.draft = model, draft_model
        self.K = num_speculative_tokens
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.budget = max_num_batched_tokens
        self.batch_invariant = batch_invariant
        self.blocks = BlockManager(num_blocks, block_size)
        self.pool = KVPool(model, num_blocks, block_size)
        self.draft_pool = (
            KVPool(draft_model, num_blocks, block_size) if self.K else None
        )
        self.waiting: deque = deque()
        self.running: list = []
        self.requests: dict = {}
        self.record_logits = False
        self.trace: list = []  # per step: (id, target tokens, prefill/decode/verify)
        self._next_id = 0
        self._stats = dict(
            steps=0,
            mixed_steps=0,
            preemptions=0,
            prefill_tokens=0,
            decode_tokens=0,
            drafted=0,
            accepted=0,
        )

    # ------------------------------------------------------------ requests
    def add_request(self, prompt_ids, params=None) -> int:
        """Queue a prompt (a sequence of token ids, or a 1-D integer tensor)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"params must be a SamplingParams, got {type(params).__name__}"
            )
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1 or prompt_ids.is_floating_point():
                raise ValueError("prompt_ids as a tensor must be 1-D integer ids")
            prompt_ids = prompt_ids.tolist()
        prompt = [int(t) for t in prompt_ids]
        V = self.model.config.vocab_size
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(f"prompt_ids must lie in [0, {V}), the vocabulary")
        need = len(prompt) + params.max_new_tokens + self.K
        if -(-need // self.block_size) > self.blocks.num_blocks:
            raise ValueError(
                f"the request needs up to {need} tokens of cache, more than the "
                f"{self.blocks.num_blocks} blocks of {self.block_size} hold"
            )
        if (
            self.K
            and not params.greedy
            and (
                params.top_k is not None
                or params.top_p is not None
                or params.min_p is not None
            )
        ):
            raise ValueError(
                "top_k, top_p and min_p are not supported with speculative decoding"
            )
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**63 - 1, ()))
        rid = self._next_id
        self._next_id += 1
        request = _Request(rid, prompt, params, seed, rid)
        self.requests[rid] = request
        self.waiting.append(request)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def output_of(self, rid) -> list[int]:
        return list(self.requests[rid].output)

    def logits_of(self, rid) -> list[torch.Tensor]:
        return list(self.requests[rid].logits)

    def generate(self, prompts, params=None) -> list[list[int]]:
        """Run the prompts to the end; their new tokens, in order. ``params``: one
        SamplingParams for all, or one per prompt."""
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("params must be one SamplingParams or one per prompt")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.has_unfinished():
            self.step()
        return [self.output_of(i) for i in ids]

    def stats(self) -> dict:
        b = self.blocks
        return dict(
            self._stats,
            num_blocks=b.num_blocks,
            block_size=b.block_size,
            blocks_used=b.used,
            blocks_used_peak=b.peak,
            shared_prefix_tokens=b.shared_tokens,
            copy_on_write=b.copies,
            kv_bytes_per_block=self.pool.nbytes // b.num_blocks,
        )

    # ------------------------------------------------------------ scheduling
    def _want(self, r, budget):
        """(n, k): the target tokens r computes this step and how many of them are
        drafts; (0, 0) if it must wait for a step with more room."""
        start = r.seq.num_computed
        need = len(r.tokens) - start
        if self.K and r.output and r.remaining > 1:  # token 0 is always a plain draw
            if need == 1:  # decode with drafts
                k = min(self.K, r.remaining - 1)
                return (k + 1, k) if k + 1 <= budget else (0, 0)
            # recomputed after a preemption: all but the last token, whose step is a
            # verification as it was before (a seeded request's draws do not change)
            need -= 1
        return min(need, budget), 0

    def _preempt(self, r):
        """Recomputation: r gives its blocks back (their contents stay cached for
        its return) and waits at the front of the queue with all its tokens."""
        self.blocks.free_all(r.seq)
        r.draft_computed = 0
        self.waiting.appendleft(r)
        self._stats["preemptions"] += 1

    def _copy(self, pairs):
        self.pool.copy(pairs)
        if self.draft_pool is not None:
            self.draft_pool.copy(pairs)

    def _schedule(self):
        """The step's (request, n, k): running requests first, in the order they were
        admitted, preempting from the most recent when blocks run out; then waiting
        ones while there is room (none after a preemption)."""
        budget, plan, preempted = self.budget, [], False
        i = 0
        while i < len(self.running):
            r = self.running[i]
            n, k = self._want(r, budget)
            if n == 0:
                i += 1
                continue
            while not self.blocks.can_allocate(r.seq, n) and r in self.running:
                self._preempt(self.running.pop())
                preempted = True
            if r not in self.running:
                break
            self._copy(self.blocks.allocate(r.seq, n))
            plan.append((r, n, k))
            budget -= n
            i += 1
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            r = self.waiting[0]
            matched = self.blocks.match(r.seq, r.tokens)
            r.draft_computed = r.seq.num_computed
            n, k = self._want(r, budget)
            if n == 0 or not self.blocks.can_allocate(r.seq, n):
                self.blocks.free_all(r.seq)
                self.blocks.shared_tokens -= matched
                r.draft_computed = 0
                break
            self.waiting.popleft()
            self.running.append(r)
            self._copy(self.blocks.allocate(r.seq, n))
            plan.append((r, n, k))
            budget -= n
        return plan

    # ------------------------------------------------------------ one step
    def step(self):
        """Schedule, run the draft (if any) and the target once, sample; returns
        ``[(id, new_token_ids, finished)]`` for the requests that moved."""
        plan = self._schedule()
        if not plan:
            if self.has_unfinished():  # add_request's checks make this unreachable
                raise RuntimeError("no request could be scheduled")
            return []
        self._stats["steps"] += 1
        self.trace.append(
            [
                (
                    r.id,
                    n,
                    "verify"
                    if k
                    else "decode"
                    if len(r.tokens) - r.seq.num_computed == 1
                    else "prefill",
                )
                for r, n, k in plan
            ]
        )
        drafts = self._run_draft(plan) if self.K else {}
        chunks = []
        for r, n, k in plan:
            start = r.seq.num_computed
            tokens = r.tokens[start : start + n - k]
            if k:
                tokens = tokens + drafts[r.id][0]
            done = start + n - k == len(r.tokens)
            chunks.append(
                Chunk(
                    r.seq.blocks,
                    start,
                    tokens,
                    list(range(n - k - 1, n)) if done else [],
                )
            )
        logits = forward(self.model, self.pool, chunks, self.batch_invariant)
        plain, spec, new, kinds = [], [], {}, set()
        for (r, n, k), lg in zip(plan, logits):
            decoding = len(r.tokens) - r.seq.num_computed == 1
            kinds.add(decoding)
            self._stats["decode_tokens" if decoding else "prefill_tokens"] += n
            r.seq.num_computed += n - k
            if len(lg) and k == 0:
                plain.append((r, lg[-1]))
            elif k:
                spec.append((r, k, lg))
        for (r, row), t in zip(plain, self._sample(plain)):
            new[r.id] = [t]
            if self.record_logits:
                r.logits.append(row)
        self._stats["mixed_steps"] += len(kinds) == 2  # prefill beside decoding
        accepted = {}
        if spec:
            verified, accepted = self._verify(spec, drafts)
            new.update(verified)
        events = []
        for r, _, _ in plan:
            if r.id in new:
                emitted = self._emit(r, new[r.id])
                events.append((r.id, emitted, r.finished))
                # accepted drafts past a stop token were not emitted: not counted
                self._stats["accepted"] += min(accepted.get(r.id, 0), len(emitted))
                if self.record_logits:  # drafts past a stop token were not emitted
                    del r.logits[len(r.output) :]
        for r in list(self.running):
            committed = r.seq.num_computed
            if self.K:
                committed = min(committed, r.draft_computed)
            committed = min(committed, len(r.tokens))  # drafts past a stop token
            self.blocks.commit(r.seq, r.tokens, committed)
            if r.finished:
                self.blocks.free_all(r.seq)
                self.running.remove(r)
        return events

    def _emit(self, r, tokens):
        out = []
        for t in tokens:
            if r.remaining == 0:
                break
            r.output.append(t)
            out.append(t)
            if t in r.params.stop_token_ids:
                r.finished = True
                break
        r.finished = r.finished or r.remaining == 0
        return out

    # ------------------------------------------------------------ sampling
    def _penalized(self, logits, histories, params):
        """Logits (R, V) with each row's penalties: repetition over its prompt and
        output, presence and frequency over its output; histories: (all, output)
        token lists per row."""
        if not any(p.penalized for p in params):
            return logits
        dev = logits.device

        def padded(lists):
            width = max(1, max(len(x) for x in lists))
            ids = torch.full((len(lists), width), -1, dtype=torch.int64)
            for i, x in enumerate(lists):
                ids[i, : len(x)] = torch.tensor(x, dtype=torch.int64)
            return ids.to(dev)

        def per_row(name):
            values = [float(getattr(p, name)) for p in params]
            return torch.tensor(values, dtype=torch.float32, device=dev)

        logits = normbook.penalize(
            logits,
            padded([h[0] for h in histories]),
            repetition_penalty=per_row("repetition_penalty"),
        )
        return normbook.penalize(
            logits,
            padded([h[1] for h in histories]),
            presence_penalty=per_row("presence_penalty"),
            frequency_penalty=per_row("frequency_penalty"),
        )

    def _sample(self, rows):
        """One token per (request, logits row): greedy rows take the argmax, the others
        normbook.sample with their own parameters and a seed from (seed, t)."""
        if not rows:
            return []
        reqs = [r for r, _ in rows]
        logits = torch.stack([row for _, row in rows])
        logits = self._penalized(
            logits, [(r.tokens, r.output) for r in reqs], [r.params for r in reqs]
        )
        out = logits.argmax(-1).tolist()
        drawn = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if drawn:
            V, dev = logits.shape[-1], logits.device
            ps = [reqs[i].params for i in drawn]

            def column(values, dtype):
                return torch.tensor(values, dtype=dtype, device=dev)

            kw = dict(
                temperature=column([p.temperature for p in ps], torch.float32),
                top_k=column([p.top_k or V for p in ps], torch.int64),
                top_p=column(
                    [1.0 if p.top_p is None else p.top_p for p in ps], torch.float32
                ),
                min_p=column([p.min_p or 0.0 for p in ps], torch.float32),
                generator=column(
                    [
                        token_seed(reqs[i].seed, len(reqs[i].output), _TARGET)
                        for i in drawn
                    ],
                    torch.int64,
                ),
            )
            tokens = normbook.sample(logits[drawn], **kw).tolist()
            for i, t in zip(drawn, tokens):
                out[i] = t
        return out

    def _probs(self, logits, histories, params):
        """The distributions speculative sampling compares, (R, V) float64: softmax
        of the penalized logits at the temperature, one-hot for greedy rows."""
        logits = self._penalized(logits, histories, params).double()
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        temps = torch.tensor(
            [max(p.temperature, 1e-30) if p.temperature else 1.0 for p in params],
            dtype=torch.float64,
            device=logits.device,
        )
        soft = torch.softmax(logits / temps[:, None], -1)
        hard = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1])
        return torch.where(greedy[:, None], hard.double(), soft)

    # ------------------------------------------------------------ speculation
    def _run_draft(self, plan):
        """The draft model: the step's prefill chunks (it keeps the same cache), then
        k proposals for each decoding request, one forward per draft position for the
        whole batch. Returns {id: (drafts, q (k, V))}."""
        chunks, spec, at = [], [], []
        for r, n, k in plan:
            if k:  # what the draft has not seen yet: the last token (and one more)
                pending = r.tokens[r.draft_computed :]
                at.append(len(chunks))
                chunks.append(
                    Chunk(r.seq.blocks, r.draft_computed, pending, [len(pending) - 1])
                )
                spec.append((r, k))
            elif r.draft_computed == r.seq.num_computed:  # the same chunk, no logits
                chunks.append(
                    Chunk(
                        r.seq.blocks,
                        r.draft_computed,
                        r.tokens[r.draft_computed : r.draft_computed + n],
                    )
                )
                r.draft_computed += n
        proposals = {r.id: ([], []) for r, _ in spec}
        i = 0
        while spec:
            logits = forward(self.draft, self.draft_pool, chunks, self.batch_invariant)
            rows = [(r, logits[j][-1]) for (r, _), j in zip(spec, at)]
            hist = [
                (r.tokens + proposals[r.id][0], r.output + proposals[r.id][0])
                for r, _ in rows
            ]
            q = self._probs(
                torch.stack([row for _, row in rows]), hist, [r.params for r, _ in rows]
            )
            for (r, _), q_r in zip(rows, q):
                t = len(r.output) + len(proposals[r.id][0])
                g = torch.Generator().manual_seed(token_seed(r.seed, t, _DRAFT))
                d = int(torch.multinomial(q_r.cpu(), 1, generator=g))
                proposals[r.id][0].append(d)
                proposals[r.id][1].append(q_r)
            i += 1
            spec = [(r, k) for r, k in spec if k > i]
            chunks = [
                Chunk(
                    r.seq.blocks, r.seq.num_computed + i, [proposals[r.id][0][-1]], [0]
                )
                for r, k in spec
            ]
            at = list(range(len(spec)))
        if chunks and not proposals:  # prefill chunks only
            forward(self.draft, self.draft_pool, chunks, self.batch_invariant)
        for r, _, k in plan:
            if k:  # its pending tokens and its first k - 1 drafts
                r.draft_computed = r.seq.num_computed + k
        self._stats["drafted"] += sum(k for _, _, k in plan)
        return {rid: (d, torch.stack(q)) for rid, (d, q) in proposals.items()}

    def _verify(self, spec, drafts):
        """speculative_sample over the decoding requests (ragged k), each with its
        own seed; both caches keep the accepted tokens only. Returns the tokens and
        the accepted drafts' count of each request."""
        dev = spec[0][2].device
        B, Kmax, V = len(spec), max(k for _, k, _ in spec), spec[0][2].shape[-1]
        tokens = torch.full((B, Kmax), -1, dtype=torch.int64, device=dev)
        q = torch.zeros((B, Kmax, V), dtype=torch.float64, device=dev)
        p = torch.zeros((B, Kmax + 1, V), dtype=torch.float64, device=dev)
        for b, (r, k, lg) in enumerate(spec):
            d, q_r = drafts[r.id]
            tokens[b, :k] = torch.tensor(d, device=dev)
            q[b, :k] = q_r
            hist = [(r.tokens + d[:i], r.output + d[:i]) for i in range(k + 1)]
            p[b, : k + 1] = self._probs(lg, hist, [r.params] * (k + 1))
        counts = torch.tensor([k for _, k, _ in spec], device=dev)
        seeds = torch.tensor(
            [token_seed(r.seed, len(r.output), _VERIFY) for r, _, _ in spec]
        )
        out, accepted = normbook.speculative_sample(
            tokens, q, p, num_draft_tokens=counts, generator=seeds
        )
        new, kept = {}, {}
        for (r, _, lg), row, a in zip(spec, out.tolist(), accepted.tolist()):
            new[r.id], kept[r.id] = row[: a + 1], a
            if self.record_logits:
                r.logits.extend(lg[: a + 1])
            start = r.seq.num_computed  # the last token's position + 1
            self.blocks.truncate(r.seq, start + a)
            r.draft_computed = min(r.draft_computed, start + a)
        return new, kept
