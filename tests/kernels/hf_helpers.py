"""What the tests of normbook.hf share: a tiny model's sizes, and counting which kernels
a patched model calls."""

import normbook.hf as hf

#: A tiny decoder's sizes (2 layers, GQA 4:2, head_dim 16), for any family's config; the
#: vocabulary is each test file's own.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)

#: The kernels normbook.hf's forwards call, by the names they call them.
KERNELS = (
    "rms_norm",
    "fused_add_rms_norm",
    "qk_norm_rope",
    "attention",
    "swiglu",
    "_linear_cross_entropy",
)


def count_kernels(monkeypatch) -> dict:
    """{kernel name: calls}, counted from now on (each kernel wrapped, through
    ``monkeypatch``, in every module of normbook.hf that calls it)."""
    calls = dict.fromkeys(KERNELS, 0)
    for module in (hf._forwards, hf._attention, hf._families):
        for name in KERNELS:
            real = getattr(module, name, None)
            if real is None:
                continue

            def counted(*a, _real=real, _name=name, **k):
                calls[_name] += 1
                return _real(*a, **k)

            monkeypatch.setattr(module, name, counted)
    return calls
