"""What the tests of normbook.hf share: counting which kernels a patched model calls."""

import normbook.hf as hf

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
