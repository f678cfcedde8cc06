"""Reading PTX: the width of each global load and store, which kernel argument its
address derives from, the loops, and the square roots and divisions; and the PTX's
hash, less the paths a clone names."""

from __future__ import annotations

import hashlib
import re

_PARAM = re.compile(r"ld\.param\.[bu]64\s+(%rd\d+),\s*\[(\w+)_param_(\d+)\]")
_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[a-z0-9:]+)*)")
_ADDR = re.compile(r"\[\s*(%rd\d+)")
_REG = re.compile(r"%rd\d+")
_LABEL = re.compile(r"^(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
_MATH = re.compile(r"\b((?:sqrt|rsqrt|div|rcp)\.[a-z0-9.]+)")
_TYPE_BITS = re.compile(r"\.[bufs](8|16|32|64)$")


def _access_bits(suffix: str) -> int:
    """Bits moved by one ld/st.global instruction: vector length × element width."""
    parts = suffix.split(".")
    vec = 1
    for p in parts:
        if p in ("v2", "v4", "v8"):
            vec = int(p[1:])
    m = _TYPE_BITS.search("." + parts[-1])
    return vec * (int(m.group(1)) if m else 32)


def analyze_ptx(ptx: str, pointer_params: dict[int, str]) -> dict:
    """Global loads/stores per kernel argument (which pointer each address derives
    from), loops, and the sqrt/div/rsqrt/rcp instructions of one kernel's PTX.

    ``pointer_params`` maps the index of a PTX parameter to the kernel argument's name.
    Addresses are traced back through 64-bit integer arithmetic to the ``ld.param`` of a
    pointer."""
    lines = [line.strip() for line in ptx.splitlines()]
    taint: dict[str, frozenset] = {}
    for line in lines:
        m = _PARAM.search(line)
        if m and int(m.group(3)) in pointer_params:
            taint[m.group(1)] = frozenset([pointer_params[int(m.group(3))]])
    # Propagate through 64-bit registers until nothing changes (loops carry pointers
    # around).
    for _ in range(8):
        changed = False
        for line in lines:
            if (
                not line
                or line.startswith(("//", ".", "$"))
                or _ACCESS.search(line)
                or "ld.param" in line
            ):
                continue
            # "@%p1 op.type dest, src, ...;": only a 64-bit destination can hold an
            # address.
            body = re.sub(r"^@!?%p\d+\s+", "", line.split("//")[0]).rstrip(";")
            parts = body.split(None, 1)
            if len(parts) < 2 or parts[0].startswith(("st.", "bra", "setp", "ret")):
                continue
            operands = parts[1].split(",")
            dest = operands[0].strip()
            sources = _REG.findall(",".join(operands[1:]))
            if not re.fullmatch(r"%rd\d+", dest) or not sources:
                continue
            t = frozenset().union(*(taint.get(r, frozenset()) for r in sources))
            if t and not t <= taint.get(dest, frozenset()):
                taint[dest] = taint.get(dest, frozenset()) | t
                changed = True
        if not changed:
            break
    # Loops: a branch back to a label defined earlier.
    labels, loops = {}, []
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = i
        b = _BRANCH.search(line)
        if b and b.group(1) in labels and labels[b.group(1)] < i:
            loops.append((labels[b.group(1)], i))
    accesses = []
    for i, line in enumerate(lines):
        m = _ACCESS.search(line)
        if not m:
            continue
        a = _ADDR.search(line)
        owners = sorted(taint.get(a.group(1), ())) if a else []
        inner = [lp for lp in loops if lp[0] <= i <= lp[1]]
        loop = min(inner, key=lambda lp: lp[1] - lp[0]) if inner else None
        accesses.append(
            {
                "op": m.group(1),
                "bits": _access_bits(m.group(2)),
                "args": owners,
                "loop": loop,
            }
        )
    math_ops: dict[str, int] = {}
    for line in lines:
        for op in _MATH.findall(line):
            math_ops[op] = math_ops.get(op, 0) + 1
    return {"accesses": accesses, "math": math_ops, "loops": len(loops)}


def _ptx_sha(ptx: str) -> str:
    """The PTX's hash, less what names the checkout's and the virtual environment's
    paths, which differ between two clones of the same source: the ``.file`` lines and
    the DWARF sections after the code (``.section .debug_info`` spells the path in
    bytes)."""
    code = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.M)[0]
    lines = [ln for ln in code.splitlines() if not ln.lstrip().startswith(".file")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
