"""The inspector's rows as tables (plain text, Markdown), the measured bandwidth beside
the predicted one, and the lines of PTX a chapter reads.

This module imports nothing but the standard library, and nothing of its package:
tools/gpu_check.py loads it by file path, without importing ``normbook`` (and torch)."""

from __future__ import annotations

import re


def _widths(d: dict, rows_like: list) -> str:
    return (
        " ".join(f"{k}:{'/'.join(map(str, v))}" for k, v in d.items() if k in rows_like)
        or "-"
    )


def _math(m: dict) -> str:
    keep = {
        k: v
        for k, v in m.items()
        if k.startswith(("sqrt", "rsqrt", "div.full", "div.rn", "rcp"))
    }
    return " ".join(f"{k}" for k in sorted(keep)) or "-"


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'call':<22}{'phase':<9}{'kernel':<24}{'dtype':<5}{'shape':<7}"
        f"{'M':>8}{'N':>8} "
        f"{'warps':>5}{'regs':>5}{'spill':>6}{'smem':>7}{'CTA/SM':>7} "
        f"{'limit':<10}{'grid':>7}"
        f"{'waves':>7}{'inflight':>9}{'need':>7}{'pred':>6}  loads(bits)  math"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(
                f"{r['call']:<22}{r['phase']:<9}{r['kernel']:<24}{r['dtype']:<5}"
                f"{r['shape']:<7}{r['M']:>8}{r['N']:>8}  "
                f"COMPILE ERROR: {r['error']}"
            )
            continue
        out.append(
            f"{r['call']:<22}{r['phase']:<9}{r['kernel']:<24}{r['dtype']:<5}"
            f"{r['shape']:<7}{r['M']:>8}{r['N']:>8} "
            f"{r['num_warps']:>5}{r['registers']:>5}{r['spill_stores']:>6}"
            f"{r['smem']:>7}"
            f"{r['ctas_per_sm']:>7} "
            f"{r['occupancy_limit']:<10}{r['grid']:>7}{r['waves']:>7.2f}"
            f"{r['in_flight_per_sm'] / 1024:>8.1f}K"
            f"{r['littles_per_sm'] / 1024:>6.1f}K{r['predicted']:>6.2f}  "
            f"{_widths(r['loads'], r['row_args'])}  {_math(r['math'])}"
        )
    return "\n".join(out)


COLUMNS = {  # column title: how to read it from a row (for markdown_table)
    "kernel": lambda r: r["kernel"],
    "phase": lambda r: r["phase"],
    "M": lambda r: r["M"],
    "N": lambda r: r["N"],
    "warps": lambda r: r["num_warps"],
    "regs": lambda r: r["registers"],
    "spill B": lambda r: r["spill_stores"] + r["spill_loads"],
    "CTA/SM": lambda r: r["ctas_per_sm"],
    "limit": lambda r: r["occupancy_limit"],
    "grid": lambda r: r["grid"],
    "waves": lambda r: f"{r['waves']:.2f}",
    "in flight KiB": lambda r: f"{r['in_flight_per_sm'] / 1024:.1f}",
    "needed KiB": lambda r: f"{r['littles_per_sm'] / 1024:.1f}",
    "predicted": lambda r: f"{r['predicted']:.2f}",
    "row loads": lambda r: _widths(r["loads"], r["row_args"]),
    "sqrt/div": lambda r: _math(r["math"]),
}


def markdown_table(rows: list[dict], columns=tuple(COLUMNS)) -> str:
    """The rows as a Markdown table (a chapter displays it with IPython's Markdown)."""
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['kernel']} | compile error: {r['error']} |")
            continue
        out.append(
            "| "
            + " | ".join(str(COLUMNS[c](r)).replace("|", "/") for c in columns)
            + " |"
        )
    return "\n".join(out)


_SHORT_DTYPE = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "float64": "fp64",
}


def ptx_excerpt(ptx: str, max_lines: int = 14) -> str:
    """The lines of a kernel's PTX that the chapter reads: global loads and stores, the
    square root / division / reciprocal instructions, and the branches that close
    loops."""
    keep = re.compile(r"\b(ld|st)\.global|\b(sqrt|rsqrt|div|rcp)\.|\bbra\b|^\$L__BB")
    lines = [line.strip() for line in ptx.splitlines() if keep.search(line.strip())]
    return "\n".join(lines[:max_lines])
