"""The GPU day's trimmed benchmark: ``python -m normbook.lab.bench --plan gpu-day``.

A GPU machine is lent for minutes at a time, so ``tools/gpu_check.py`` cannot afford the
full sweep (every case at 13 shapes, torch.compile at each). This plan measures, in
order of value:

1. the device-to-device copy bandwidth (the speed of light every row is divided by);
2. every entry of :data:`PLAN` at its shapes, for our Triton kernel and eager PyTorch
   (and Liger-Kernel where installed), in the order listed;
3. then torch.compile, at two shapes per entry (it compiles once per shape: seconds).

Rows are written as they are measured, so a run stopped by its budget keeps everything
before the stop (see :func:`normbook.lab.bench.runner.run_plan`).

Adding a case to the GPU day is one line in :data:`PLAN`, after its ``Case`` exists in
:data:`normbook.lab.bench.cases.CASES`::

    Entry("swiglu.forward", SWIGLU),

``shapes`` are ``(M, N)`` as the case's builder reads them (rows × hidden size; for
attention, tokens × heads·head_dim; for cross-entropy and sampling, rows × vocabulary).
``compile_at`` picks which of them torch.compile is also timed at (indices into
``shapes``; default the first two). ``smoke`` are the tiny shapes of the CPU dry run
(``--smoke``), in Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

ELEMENTS = 2**27  # M·N of the row shapes: 256 MiB of bf16
HEADLINE_N = (4096, 8192, 32768, 131072)
ROWS = tuple((ELEMENTS // n, n) for n in HEADLINE_N)
DECODE = ((1, 4096), (8, 4096), (64, 4096))  # a few tokens of a 4096-wide model
VOCAB = 151_936  # Qwen's vocabulary
LOGITS = ((1024, VOCAB),)  # a batch of 1,024 tokens' logits
# one causal sequence of 32 heads of 128
ATTENTION = ((1024, 4096), (2048, 4096), (4096, 4096))
SAMPLE = ((1, VOCAB), (64, VOCAB))
SWIGLU = ((8192, 12288), (1, 12288), (64, 12288))  # tokens × Qwen3-8B's MLP width
KV_CACHE = ((1, 4096), (64, 4096), (8, 32768))  # requests × cached tokens

# the dry run: the interpreter runs one program at a time
SMOKE_ROWS = ((16, 256), (1, 256))
SMOKE_LOGITS = ((4, 1000),)
SMOKE_ATTENTION = ((64, 256),)


@dataclass(frozen=True)
class Entry:
    case: str  # a Case.name in normbook.lab.bench.cases.CASES
    shapes: tuple
    compile_at: tuple = (0, 1)  # indices into shapes: torch.compile timed too
    smoke: tuple = SMOKE_ROWS


#: In order of value: what a stop at any moment should already have measured.
PLAN = [
    Entry("rms_norm.forward", ROWS + DECODE),
    Entry("rms_norm.backward", ROWS + DECODE),
    Entry("fused_add_rms_norm.forward", ROWS + DECODE),
    Entry("fused_add_rms_norm.backward", ROWS + DECODE),
    Entry("layer_norm.forward", ROWS + DECODE),
    Entry("layer_norm.backward", ROWS + DECODE),
    Entry("softmax.forward", ROWS),
    Entry("softmax.backward", ROWS),
    Entry("cross_entropy.forward", LOGITS, (0,), SMOKE_LOGITS),
    Entry("cross_entropy.backward", LOGITS, (0,), SMOKE_LOGITS),
    Entry("attention.forward", ATTENTION, (0, 2), SMOKE_ATTENTION),
    Entry("attention.backward", ATTENTION, (0, 2), SMOKE_ATTENTION),
    Entry("sample.forward", SAMPLE, (0, 1), SMOKE_LOGITS),
    Entry("qk_norm_rope.forward", ((4096, 4096),) + DECODE[:1], (0,), SMOKE_ROWS),
    Entry("swiglu.forward", SWIGLU),
    Entry("swiglu.backward", SWIGLU),
    Entry("decode_attention.forward", KV_CACHE, (0, 2), ((1, 256),)),
    # the LM head's loss at Qwen3-8B's (8,192 tokens, d = 4096, V = 151,936): its case
    # reads (M, d); no torch.compile: the budget goes to the rows of every kernel first
    Entry("linear_cross_entropy.backward", ((8192, 4096),), (), ((64, 8),)),
]

PLANS = {"gpu-day": PLAN}


def shapes_of(entry: Entry, smoke: bool) -> tuple:
    return entry.smoke if smoke else entry.shapes


def compile_shapes(entry: Entry, smoke: bool) -> tuple:
    shapes = shapes_of(entry, smoke)
    return tuple(shapes[i] for i in entry.compile_at if i < len(shapes))
