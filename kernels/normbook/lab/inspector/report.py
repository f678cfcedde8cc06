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


def measured_vs_predicted(bench: dict, inspected: dict) -> dict:
    """Per benchmark row of our kernels: the measured fraction of the copy bandwidth
    (the benchmark's ``pct_of_copy`` / 100) beside the inspector's ``predicted`` for the
    same call, phase, shape and dtype (the smallest over the phase's launches; each
    launch listed).

    ``bench`` is a benchmark JSON (``python -m normbook.lab.bench``), ``inspected`` the
    inspector's JSON for the same GPU, ideally run with ``--bandwidth-gbps`` set to the
    measured copy bandwidth so that both fractions have the same denominator
    (``meta.same_denominator``).
    """
    prov = bench.get("provenance", {})
    dtype = _SHORT_DTYPE.get(prov.get("dtype", ""), prov.get("dtype"))
    launches: dict = {}
    for r in inspected.get("rows", []):
        if "error" in r:
            continue
        launches.setdefault(
            (r["call"], r["phase"], r["M"], r["N"], r["dtype"]), []
        ).append(r)
    rows = []
    for b in bench.get("results", []):
        if (
            b.get("provider") != "normbook"
            or b.get("status") != "ok"
            or b.get("pct_of_copy") is None
        ):
            continue
        found = launches.get((b["kernel"], b["direction"], b["M"], b["N"], dtype), [])
        rows.append(_compared(b, found, dtype))
    return {"meta": _comparison_meta(bench, inspected, dtype), "rows": rows}


def _compared(b: dict, found: list[dict], dtype: str) -> dict:
    """One benchmark row beside the inspector's launches for it (``found``)."""
    preds = [r["predicted"] for r in found if r.get("predicted") is not None]
    measured = b["pct_of_copy"] / 100
    predicted = min(preds) if preds else None
    return {
        "case": f"{b['kernel']}.{b['direction']}",
        "regime": b.get("regime", ""),
        "M": b["M"],
        "N": b["N"],
        "dtype": dtype,
        "ms": b["ms"],
        "GB/s": b["GB/s"],
        "measured": round(measured, 4),
        "predicted": predicted,
        "measured / predicted": (round(measured / predicted, 3) if predicted else None),
        "launches": [
            {
                "kernel": r["kernel"],
                "predicted": r["predicted"],
                "grid": r["grid"],
                "ctas_per_sm": r["ctas_per_sm"],
                "registers": r["registers"],
                "spill_bytes": r["spill_stores"] + r["spill_loads"],
            }
            for r in found
        ],
    }


def _comparison_meta(bench: dict, inspected: dict, dtype: str) -> dict:
    """Where and with what the benchmark was measured and the inspector run, and
    whether both fractions have the same denominator."""
    prov = bench.get("provenance", {})
    copy = bench.get("copy", {}).get("GB/s")
    meta = inspected.get("meta", {})
    bandwidths = {k: v.get("bandwidth") for k, v in meta.get("gpus", {}).items()}
    same = bool(copy) and any(
        bw and abs(bw / 1e9 - copy) <= 0.5 for bw in bandwidths.values()
    )
    return {
        "gpu": prov.get("gpu"),
        "date": prov.get("date"),
        "torch": prov.get("torch"),
        "triton": prov.get("triton"),
        "cuda": prov.get("cuda"),
        "dtype": dtype,
        "copy_GB/s": copy,
        "smoke": prov.get("smoke"),
        "latency_ns": meta.get("latency_ns"),
        "inspector_triton": meta.get("triton"),
        "same_denominator": same,
        "note": "measured: GB/s over the measured copy GB/s; predicted: the "
        "inspector's "
        "model (Little's law and waves), not a measurement",
    }


def comparison_markdown(table: dict) -> str:
    """:func:`measured_vs_predicted` as a Markdown table."""
    m = table["meta"]
    copy = f"{m['copy_GB/s']:.0f} GB/s" if m.get("copy_GB/s") else "unknown"
    head = [
        f"Measured on {m['gpu']} ({m['date']}; torch {m['torch']}, triton "
        f"{m['triton']}, "
        f"CUDA {m['cuda']}; {m['dtype']}; copy {copy}) against the inspector's "
        "prediction "
        f"(triton {m['inspector_triton']}, {m['latency_ns']} ns assumed latency).",
        "",
        "| case | M | N | ms | measured % of copy | predicted % | measured / predicted "
        "| launches |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def pct(v):
        return "-" if v is None else f"{100 * v:.0f}"

    for r in table["rows"]:
        each = (
            ", ".join(f"{x['kernel']} {pct(x['predicted'])}" for x in r["launches"])
            or "not inspected"
        )
        ratio = (
            "-"
            if r["measured / predicted"] is None
            else f"{r['measured / predicted']:.2f}"
        )
        head.append(
            f"| {r['case']} | {r['M']} | {r['N']} | {r['ms']:.4f} | "
            f"{pct(r['measured'])} | "
            f"{pct(r['predicted'])} | {ratio} | {each} |"
        )
    return "\n".join(head)


def ptx_excerpt(ptx: str, max_lines: int = 14) -> str:
    """The lines of a kernel's PTX that the chapter reads: global loads and stores, the
    square root / division / reciprocal instructions, and the branches that close
    loops."""
    keep = re.compile(r"\b(ld|st)\.global|\b(sqrt|rsqrt|div|rcp)\.|\bbra\b|^\$L__BB")
    lines = [line.strip() for line in ptx.splitlines() if keep.search(line.strip())]
    return "\n".join(lines[:max_lines])
