"""What each public call of ``normbook`` launches, per phase, at one shape and dtype:
the calls the inspector makes on uninitialized CPU tensors (nothing runs; the captured
launches are compiled, not run)."""

from __future__ import annotations

from .capture import _INPUTS


def _calls(label: str, M: int, N: int, dtype: str, which: set[str] | None):
    """(name, phase → callable) for every public function of the package at one
    shape."""
    import torch

    import normbook
    from normbook.lab.bench import cases

    dt = {
        "fp32": torch.float32,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp64": torch.float64,
    }[dtype]

    def empty(*shape, grad=False):
        # Uninitialized and never touched: nothing runs, so a 2**26-element input costs
        # no time.
        t = torch.empty(*shape, dtype=dt).requires_grad_(grad)
        if len(shape) >= 2:
            _INPUTS.add(t.data_ptr())
        return t

    def pair(fn, make_inputs, grad_args=()):
        """(forward, backward): the call without gradients, and, when the function is
        differentiable here, the call with ``grad_args`` requiring grad followed by its
        backward (a generator: the forward's launches, ``yield``, the backward's
        launches)."""

        def forward():
            fn(*make_inputs(()))

        def backward():
            try:
                outs = fn(*make_inputs(grad_args))
            except (TypeError, ValueError, NotImplementedError) as exc:
                if "grad" not in str(exc):
                    raise
                return  # refuses inputs that require grad: no backward to inspect
            outs = [
                o
                for o in (outs if isinstance(outs, tuple) else (outs,))
                if o.grad_fn is not None
            ]
            yield
            if outs:
                # dy: an input of the backward
                grads = [torch.empty_like(o) for o in outs]
                _INPUTS.update(g.data_ptr() for g in grads)
                torch.autograd.backward(outs, grads)

        return forward, backward

    def rows_and(vectors):
        return lambda g: (
            [empty(M, N, grad=0 in g)]
            + [empty(N, grad=i + 1 in g) for i in range(vectors)]
        )

    def qk_inputs(g):
        hq = max(1, N // cases.HEAD_DIM)
        hk = max(1, hq // cases.GQA_GROUP)
        d = cases.HEAD_DIM
        return [
            empty(1, M, hq, d, grad=0 in g),
            empty(1, M, hk, d, grad=1 in g),
            empty(d, grad=2 in g),
            empty(d, grad=3 in g),
            empty(1, M, d),
            empty(1, M, d),
        ]

    def attention_inputs(g):
        # one sequence of M tokens; N // HEAD_DIM query heads, grouped as in the
        # benchmark
        hq = max(1, N // cases.HEAD_DIM)
        hk = max(1, hq // cases.GQA_GROUP)
        d = cases.HEAD_DIM
        return [
            empty(1, hq, M, d, grad=0 in g),
            empty(1, hk, M, d, grad=1 in g),
            empty(1, hk, M, d, grad=2 in g),
        ]

    out = {
        "rms_norm": pair(normbook.rms_norm, rows_and(1), (0, 1)),
        "layer_norm": pair(normbook.layer_norm, rows_and(2), (0, 1, 2)),
        "fused_add_rms_norm": pair(
            normbook.fused_add_rms_norm,
            lambda g: [
                empty(M, N, grad=0 in g),
                empty(M, N, grad=1 in g),
                empty(N, grad=2 in g),
            ],
            (0, 1, 2),
        ),
        "qk_norm_rope": pair(normbook.qk_norm_rope, qk_inputs, (0, 1, 2, 3)),
        "softmax": pair(normbook.softmax, rows_and(0), (0,)),
        "cross_entropy": pair(
            normbook.cross_entropy,
            lambda g: [empty(M, N, grad=0 in g), torch.zeros(M, dtype=torch.int64)],
            (0,),
        ),
        "attention": pair(
            lambda q, k, v: normbook.attention(q, k, v, causal=True),
            attention_inputs,
            (0, 1, 2),
        ),
        "sample": (
            lambda: normbook.sample(
                torch.zeros(M, N, dtype=dt),
                temperature=0.8,
                top_k=50,
                top_p=0.9,
                generator=0,
            ),
            None,
        ),
        # swiglu: gate and up of the MLP, (M, N) each (N: the intermediate size's
        # stand-in). linear_cross_entropy launches cross_entropy's two kernels
        # (inspected above) between cuBLAS products, which the inspector cannot lower:
        # not listed.
        "swiglu": pair(
            normbook.swiglu,
            lambda g: [empty(M, N, grad=0 in g), empty(M, N, grad=1 in g)],
            (0, 1),
        ),
    }

    # decode_attention: M requests (at most 64: the cache is what is read,
    # and a bench-sized batch of 4096-token caches would not even fit in memory) of
    # DECODE_CACHE cached tokens, N // HEAD_DIM query heads grouped as above; contiguous
    # and paged.
    def decode_inputs(paged):
        hq = max(1, N // cases.HEAD_DIM)
        hk = max(1, hq // cases.GQA_GROUP)
        d, b, s, page = (
            cases.HEAD_DIM,
            min(M, 64),
            cases.DECODE_CACHE,
            cases.DECODE_PAGE,
        )
        lens = torch.full((b,), s, dtype=torch.int32)
        if not paged:
            return [
                empty(b, hq, 1, d),
                empty(b, hk, s, d),
                empty(b, hk, s, d),
                lens,
                None,
            ]
        table = torch.arange(b * (s // page), dtype=torch.int32).view(b, s // page)
        return [
            empty(b, hq, 1, d),
            empty(b * (s // page), hk, page, d),
            empty(b * (s // page), hk, page, d),
            lens,
            table,
        ]

    for name, paged in (("decode_attention", False), ("decode_attention.paged", True)):
        if label == "bench":
            break  # decode shapes (and the odd ones) only
        out[name] = (
            lambda p=paged: (
                lambda q, k, v, n, t: normbook.decode_attention(
                    q, k, v, n, block_table=t
                )
            )(*decode_inputs(p)),
            None,
        )
    for method in ("two_pass", "one_pass", "welford"):
        out[f"row_variance.{method}"] = (
            lambda m=method: normbook.row_variance(empty(M, N), method=m),
            None,
        )
        # the variance chapter's experiment: statistics accumulated in bf16
        if dtype == "fp32":
            out[f"row_variance.{method}.bf16acc"] = (
                lambda m=method: normbook.row_variance(
                    empty(M, N), method=m, acc_dtype=torch.bfloat16
                ),
                None,
            )
    if dtype == "fp64":
        # fp32/fp16/bf16 only: it refuses fp64 (no gradient checks to serve)
        out.pop("attention")
        out.pop("decode_attention", None)  # the same
        out.pop("decode_attention.paged", None)
    return [(k, v) for k, v in out.items() if which is None or k in which]
