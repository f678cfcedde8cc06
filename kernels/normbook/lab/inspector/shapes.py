"""The shapes inspected, (label, M, N), and how a unit spells them for its child."""

from __future__ import annotations

#: The odd sizes of the test suite's table: N = 1000 is not a multiple of 16 (no 128-bit
#: specialization), N = 40,000 a row that the kernels loop over.
ODD_SHAPES = [("odd", 6, 1000), ("odd", 6, 40000)]

#: The names of the benchmark's and the decode shapes, as a unit may give them.
NAMED = ("all", "bench", "decode")


def bench_shapes() -> list[tuple[str, int, int]]:
    """(label, M, N): the benchmark's sweep (normbook.lab.specs) and decode shapes."""
    from normbook.lab.specs import DECODE_M, DECODE_N, ELEMENTS, SWEEP

    shapes = [("bench", ELEMENTS // n, n) for n in SWEEP]
    shapes += [("decode", m, n) for n in DECODE_N for m in DECODE_M]
    return shapes


def spell(shapes) -> str:
    """A name of :data:`NAMED`, or a list of (label, M, N) as ``label:M:N,...``."""
    if isinstance(shapes, str):
        return shapes
    return ",".join(f"{lab}:{m}:{n}" for lab, m, n in shapes)


def read(spec: str) -> list[tuple[str, int, int]]:
    """The shapes :func:`spell` spelt: a name of :data:`NAMED` stands for those of
    :func:`bench_shapes` with that label (``all``: every one)."""
    if spec in NAMED:
        return [s for s in bench_shapes() if spec in ("all", s[0])]
    return parse(spec)


def parse(spec: str) -> list[tuple[str, int, int]]:
    """``label:M:N,...`` as [(label, M, N), ...]."""
    return [
        (s.split(":")[0], int(s.split(":")[1]), int(s.split(":")[2]))
        for s in spec.split(",")
    ]
