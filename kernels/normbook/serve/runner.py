"""One forward pass of a Hugging Face Qwen3 over a step's packed tokens, on this
package's kernels, reading and writing a paged KV cache.

A step packs the new tokens of every scheduled request into one row of ``T`` tokens:
prefill chunks, decode tokens, and drafts to verify. The weights are the model's own
modules; every operation is a ``normbook`` kernel:

* ``rms_norm`` / ``fused_add_rms_norm`` (the residual add and the norm in one pass),
  ``qk_norm_rope`` (Qwen3's per-head norm, then RoPE, at each token's own position),
  ``swiglu``;
* ``reshape_and_cache``: the step's keys and values into their slots, one launch per
  layer;
* attention by chunk. A chunk of a request that already has tokens in the cache and at
  most :data:`DECODE_MAX_Q` new ones (a decode token, drafts to verify) runs
  ``decode_attention`` over the paged cache, with the chunks of the same length in one
  launch. Every other chunk (a prompt, or a chunk of one) runs ``attention_varlen``,
  causal (bottom-right), over the request's keys gathered from the cache into one
  packed tensor: its fp32 state is sized by the chunk, where ``decode_attention``'s
  partial states grow with the chunk times the cache's capacity;
  A batch-invariant engine instead gives every new token its own row of one
  ``decode_attention`` launch (``S_q = 1``, its keys up to its own): the computation a
  decode step gives it, so a token's bits do not depend on whether it was prefilled,
  decoded or verified, nor on how its prompt was chunked;
* the matrix products: ``torch.nn.functional.linear`` over the whole step, or, for a
  batch-invariant engine, ``normbook.linear``, whose rows do not depend on the others;
* the LM head only at the positions whose logits are sampled.

Which path a chunk takes depends on its own start and length only, never on the rest of
the step: with batch-invariant products, a request's bits do not depend on its
neighbours.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import normbook

DECODE_MAX_Q = 16  # new tokens of a cached chunk that still run decode_attention


@dataclass
class Chunk:
    """``tokens`` at positions ``start, start + 1, …`` of a request whose block table
    is ``blocks``; the logits of the chunk's positions ``logits_at`` are returned."""

    blocks: list
    start: int
    tokens: list
    logits_at: list = field(default_factory=list)


def check_model(model) -> None:
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) != "qwen3" or not hasattr(model, "lm_head"):
        raise TypeError(
            "the engine runs a Hugging Face Qwen3 causal LM (Qwen3ForCausalLM), got "
            f"{type(model).__name__}"
        )
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("sliding-window Qwen3 layers are not supported by the engine")
    if model.device.type != normbook.DEVICE.type:
        raise ValueError(
            f"the model is on {model.device}; the kernels run on {normbook.DEVICE}"
        )


class KVPool:
    """Per layer one (num_blocks, H_kv, block_size, D) pool of keys and one of
    values, in the model's dtype. NaN at first: a slot is never read before it is
    written (the kernels mask every slot past a request's length)."""

    def __init__(self, model, num_blocks: int, block_size: int):
        cfg = model.config
        shape = (num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim)
        nan = float("nan")
        kw = dict(dtype=model.dtype, device=model.device)
        self.k = [torch.full(shape, nan, **kw) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.full(shape, nan, **kw) for _ in range(cfg.num_hidden_layers)]
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy(self, pairs) -> None:
        """Copy-on-write: block src's keys and values into block dst, every layer."""
        if not pairs:
            return
        src, dst = (torch.tensor(x, device=self.k[0].device) for x in zip(*pairs))
        for t in self.k + self.v:
            t[dst] = t[src]


def _slots(chunks, block_size, device):
    """Each new token's slot: block · block_size + offset."""
    slots = []
    for c in chunks:
        for p in range(c.start, c.start + len(c.tokens)):
            slots.append(c.blocks[p // block_size] * block_size + p % block_size)
    return torch.tensor(slots, dtype=torch.int64, device=device)


class _Plan:
    """How the step's attention is launched: the decode groups (one per chunk
    length) and the varlen set, with their index tensors, built once per step."""

    def __init__(self, chunks, block_size, device, per_token=False):
        starts, offset = [], 0
        for c in chunks:
            starts.append(offset)
            offset += len(c.tokens)
        self.groups, self.varlen = [], None
        if per_token:
            self._per_token(chunks, starts, device)
            return
        decode, varlen = {}, []
        for i, c in enumerate(chunks):
            n = len(c.tokens)
            if c.start > 0 and n <= DECODE_MAX_Q:
                decode.setdefault(n, []).append(i)
            else:
                varlen.append(i)
        for n, members in sorted(decode.items()):
            rows = torch.tensor(
                [starts[i] + j for i in members for j in range(n)], device=device
            )
            lens = torch.tensor(
                [chunks[i].start + n for i in members], dtype=torch.int32, device=device
            )
            width = max(len(chunks[i].blocks) for i in members)
            table = torch.full((len(members), width), -1, dtype=torch.int32)
            for r, i in enumerate(members):
                table[r, : len(chunks[i].blocks)] = torch.tensor(chunks[i].blocks)
            self.groups.append((n, rows, lens, table.to(device)))
        if varlen:
            rows, keys, cu_q, cu_k = [], [], [0], [0]
            for i in varlen:
                c = chunks[i]
                n, total = len(c.tokens), c.start + len(c.tokens)
                rows.extend(range(starts[i], starts[i] + n))
                keys.extend(
                    c.blocks[p // block_size] * block_size + p % block_size
                    for p in range(total)
                )
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + total)
            keys = torch.tensor(keys, device=device)
            max_q = max(a - b for a, b in zip(cu_q[1:], cu_q))
            max_k = max(a - b for a, b in zip(cu_k[1:], cu_k))
            self.varlen = (
                torch.tensor(rows, device=device),
                keys // block_size,
                keys % block_size,
                torch.tensor(cu_q, dtype=torch.int32, device=device),
                torch.tensor(cu_k, dtype=torch.int32, device=device),
                max_q,
                max_k,
            )

    def _per_token(self, chunks, starts, device):
        """Every new token its own row of one ``decode_attention`` launch (S_q = 1),
        over the keys up to and including its own: the computation a decode step
        gives that token, whatever chunk, prompt or verification it arrives in."""
        rows, lens, tables = [], [], []
        width = max(len(c.blocks) for c in chunks)
        for i, c in enumerate(chunks):
            for j in range(len(c.tokens)):
                rows.append(starts[i] + j)
                lens.append(c.start + j + 1)
                tables.append(c.blocks + [-1] * (width - len(c.blocks)))
        self.groups.append(
            (
                1,
                torch.tensor(rows, device=device),
                torch.tensor(lens, dtype=torch.int32, device=device),
                torch.tensor(tables, dtype=torch.int32, device=device),
            )
        )


def _attend(q, kc, vc, plan, scale):
    """q (T, H, D) → o (T, H, D) over the cache (which already holds the step's
    keys and values)."""
    o = torch.empty_like(q)
    H, D = q.shape[1:]
    for n, rows, lens, table in plan.groups:
        qg = q[rows].view(-1, n, H, D).transpose(1, 2)
        og = normbook.decode_attention(qg, kc, vc, lens, block_table=table, scale=scale)
        o[rows] = og.transpose(1, 2).reshape(-1, H, D)
    if plan.varlen is not None:
        rows, blk, off, cu_q, cu_k, max_q, max_k = plan.varlen
        k, v = kc[blk, :, off], vc[blk, :, off]  # (keys, H_kv, D), packed
        o[rows] = normbook.attention_varlen(
            q[rows], k, v, cu_q, cu_k, max_q, max_k, causal=True, scale=scale
        )
    return o


@torch.no_grad()
def forward(model, pool: KVPool, chunks: list, batch_invariant: bool = False):
    """Run the chunks through the model; their keys and values land in ``pool``.
    Returns one ``(len(logits_at), vocab)`` logits tensor per chunk."""
    device = model.device
    linear = normbook.linear if batch_invariant else F.linear
    cfg = model.config
    H, H_kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    tokens = torch.tensor([t for c in chunks for t in c.tokens], device=device)
    T = tokens.numel()
    positions = torch.tensor(
        [p for c in chunks for p in range(c.start, c.start + len(c.tokens))],
        device=device,
    )
    slots = _slots(chunks, pool.block_size, device)
    plan = _Plan(chunks, pool.block_size, device, per_token=batch_invariant)
    x = model.model.embed_tokens(tokens)[None]  # (1, T, hidden)
    cos, sin = model.model.rotary_emb(x, positions[None])
    residual = None
    for i, layer in enumerate(model.model.layers):
        att, norm1 = layer.self_attn, layer.input_layernorm
        if residual is None:
            residual, h = x, normbook.rms_norm(x, norm1.weight, norm1.variance_epsilon)
        else:  # the previous MLP output added to the residual stream, and normed
            h, residual = normbook.fused_add_rms_norm(
                x, residual, norm1.weight, norm1.variance_epsilon
            )
        q = linear(h, att.q_proj.weight, att.q_proj.bias).view(1, T, H, D)
        k = linear(h, att.k_proj.weight, att.k_proj.bias).view(1, T, H_kv, D)
        v = linear(h, att.v_proj.weight, att.v_proj.bias).view(1, T, H_kv, D)
        q, k = normbook.qk_norm_rope(
            q,
            k,
            att.q_norm.weight,
            att.k_norm.weight,
            cos,
            sin,
            att.q_norm.variance_epsilon,
        )
        normbook.reshape_and_cache(k[0], v[0], pool.k[i], pool.v[i], slots)
        o = _attend(q[0], pool.k[i], pool.v[i], plan, att.scaling)
        x = linear(o.reshape(1, T, H * D), att.o_proj.weight, att.o_proj.bias)
        norm2, mlp = layer.post_attention_layernorm, layer.mlp
        h, residual = normbook.fused_add_rms_norm(
            x, residual, norm2.weight, norm2.variance_epsilon
        )
        gate = linear(h, mlp.gate_proj.weight)
        up = linear(h, mlp.up_proj.weight)
        x = linear(normbook.swiglu(gate, up), mlp.down_proj.weight)
    final = model.model.norm
    h, _ = normbook.fused_add_rms_norm(
        x, residual, final.weight, final.variance_epsilon
    )
    at, offset = [], 0
    for c in chunks:
        at.extend(offset + j for j in c.logits_at)
        offset += len(c.tokens)
    if not at:  # every chunk is the middle of a prompt: nothing to sample
        return [h.new_empty((0, cfg.vocab_size)) for _ in chunks]
    logits = linear(h[0, torch.tensor(at, device=device)], model.lm_head.weight)
    out, offset = [], 0
    for c in chunks:
        out.append(logits[offset : offset + len(c.logits_at)])
        offset += len(c.logits_at)
    return out
