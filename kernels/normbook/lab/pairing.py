"""Which of the inspector's predictions is for the work a benchmark row measured.

The benchmark and the inspector build a kernel's call from one spec
(:mod:`normbook.lab.specs`): the same inputs at (M, N), the same keywords. So a
benchmark row (kernel, direction, M, N, and the ``params`` its call passed) pairs with
the inspector's launch of that spec at the same (M, N) (:func:`inspector_work`), unless
the spec is not inspected or the row's call passed other parameters than the spec's.

The GPU day (tools/gpu_check.py) inspects exactly the work that pairs, cheap calls
first (:func:`inspect_measured`, the command below), and :func:`measured_vs_predicted`
pairs a measured row only with a prediction of the same call, phase, shape, dtype and
parameters; every other measured row is listed as unpaired, with the reason::

    python -m normbook.lab.pairing BENCH.json --arch 90 --json inspect_sm90.json \\
        [--timeout-s S] [--calls rms_norm,...] [--bandwidth-gbps G --sms N --gpu-name X]

Only the standard library is imported at the top, with the specs: tools/gpu_check.py
loads the lab's folder as a package of its own, without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from .specs import BY_NAME

#: The shape label of the inspector's rows for measured work.
LABEL = "plan"
_SHORT_DTYPE = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "float64": "fp64",
}


def inspector_work(
    kernel: str, direction: str, M: int, N: int, params: dict | None = None
) -> tuple[str, str, int, int] | str:
    """The inspector's (call, phase, M, N) that does the work the benchmark's case
    ``kernel.direction`` measured at (M, N) with ``params``, or, as a string, why no
    inspector call does."""
    spec = BY_NAME.get(kernel)
    if spec is None:
        return f"no spec named {kernel!r}"
    if not spec.inspected:
        return f"not inspected: {spec.inspect}"
    if (params or {}) != spec.kwargs:
        return (
            f"measured with {params or 'no parameters'}, the inspector's call passes "
            f"{spec.kwargs or 'none'}: different work"
        )
    # the benchmark's fewest rows for this direction (spec.min_rows) are what it ran
    return kernel, direction, max(M, spec.min_rows.get(direction, 1)), N


def bench_dtype(bench: dict) -> str | None:
    dtype = bench.get("provenance", {}).get("dtype")
    return _SHORT_DTYPE.get(dtype, dtype)


def measured_rows(bench: dict):
    """The benchmark's rows of our kernels with a fraction of the copy bandwidth."""
    for b in bench.get("results", []):
        if (
            b.get("provider") == "normbook"
            and b.get("status") == "ok"
            and b.get("pct_of_copy") is not None
        ):
            yield b


def units(bench: dict, calls=None) -> list[tuple[str, int, int]]:
    """(call, M, N) of every inspector unit that pairs with a measured row (forward and
    backward of one shape are one unit), cheap calls first (each spec's ``inspect_s``),
    each call's shapes in the order measured. ``calls``: only these."""
    out: list[tuple[str, int, int]] = []
    for b in measured_rows(bench):
        work = inspector_work(
            b["kernel"], b["direction"], b["M"], b["N"], b.get("params")
        )
        if isinstance(work, str) or (calls and work[0] not in calls):
            continue
        unit = (work[0], work[2], work[3])
        if unit not in out:
            out.append(unit)
    return sorted(out, key=lambda u: BY_NAME[u[0]].inspect_s)


def inspect_measured(
    bench: dict,
    arch: int,
    timeout: float,
    calls=None,
    gpu: dict | None = None,
    jobs=None,
    env=None,
) -> dict:
    """The inspector's rows for the work ``bench`` measured (:func:`units`), for
    ``arch``, in the benchmark's dtype. Past ``timeout`` seconds the units not finished
    are dropped; ``meta.units`` says of each whether it is "ok" (its rows kept) or "cut"
    (none)."""
    from normbook.lab import inspector

    todo = units(bench, calls)
    dtype = bench_dtype(bench)
    result = inspector.run_inspector(
        units=[(arch, dtype, call, [(LABEL, M, N)]) for call, M, N in todo],
        timeout=timeout,
        partial=True,
        **(gpu or {}),
        jobs=jobs,
        env=env,
    )
    done = {(r["call"], r["M"], r["N"]) for r in result["rows"]}
    cut = bool(result["meta"].get("units_not_finished"))
    result["meta"]["units"] = [
        {
            "call": call,
            "M": M,
            "N": N,
            "status": "ok" if (call, M, N) in done else ("cut" if cut else "no rows"),
            "rows": sum(
                1 for r in result["rows"] if (r["call"], r["M"], r["N"]) == (call, M, N)
            ),
        }
        for call, M, N in todo
    ]
    result["meta"]["dtype"] = dtype
    return result


# ---------------------------------------------------------------- the table


def measured_vs_predicted(bench: dict, inspected: dict) -> dict:
    """Per measured row of our kernels (the benchmark's ``pct_of_copy`` / 100), the
    inspector's ``predicted`` for the same work: the same call, phase, shape (as
    :func:`inspector_work` translates it), dtype and parameters, the smallest over the
    phase's launches, each launch listed. ``rows``: the pairs; ``unpaired``: every
    other measured row, with the reason.

    ``bench`` is a benchmark JSON (``python -m normbook.lab.bench``), ``inspected`` the
    inspector's JSON for the same GPU, ideally run with the measured copy bandwidth so
    that both fractions have the same denominator (``meta.same_denominator``).
    """
    prov = bench.get("provenance", {})
    dtype = bench_dtype(bench)
    copy = bench.get("copy", {}).get("GB/s")
    launches: dict = {}
    failed: dict = {}
    for r in inspected.get("rows", []):
        key = (r.get("call"), r.get("phase"), r.get("M"), r.get("N"), r.get("dtype"))
        if "error" in r:
            failed.setdefault(key, r["error"])
        else:
            launches.setdefault(key, []).append(r)
    # what inspect_measured was asked, and how each unit ended
    asked = {
        (u["call"], u["M"], u["N"]): u["status"]
        for u in inspected.get("meta", {}).get("units", [])
    }
    rows, unpaired = [], []
    for b in measured_rows(bench):
        params = b.get("params") or {}
        measured = b["pct_of_copy"] / 100
        head = {
            "case": f"{b['kernel']}.{b['direction']}",
            "regime": b.get("regime", ""),
            "M": b["M"],
            "N": b["N"],
            "dtype": dtype,
            "params": params,
            "ms": b["ms"],
            "GB/s": b["GB/s"],
            "measured": round(measured, 4),
        }
        work = inspector_work(b["kernel"], b["direction"], b["M"], b["N"], params)
        if isinstance(work, str):
            unpaired.append({**head, "reason": work})
            continue
        key = (*work, dtype)
        found = [r for r in launches.get(key, []) if r.get("predicted") is not None]
        if not found:
            status = asked.get((work[0], work[2], work[3]))
            if key in failed:
                why = f"the inspector failed to compile it: {failed[key]}"
            elif status == "cut":
                why = "not inspected: the inspector's deadline came first"
            elif status is None and asked:
                why = "not inspected: not asked of the inspector"
            else:
                why = "not inspected"
            unpaired.append({**head, "reason": why})
            continue
        predicted = min(r["predicted"] for r in found)
        rows.append(
            {
                **head,
                "predicted": predicted,
                "measured / predicted": round(measured / predicted, 3)
                if predicted
                else None,
                "inspected_as": {"call": work[0], "M": work[2], "N": work[3]},
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
        )
    meta = inspected.get("meta", {})
    bandwidths = [v.get("bandwidth") for v in meta.get("gpus", {}).values()]
    same = bool(copy) and any(bw and abs(bw / 1e9 - copy) <= 0.5 for bw in bandwidths)
    return {
        "meta": {
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
            "paired_on": "call, phase, shape, dtype and parameters "
            "(normbook.lab.pairing.inspector_work)",
            "note": "measured: GB/s over the measured copy GB/s; predicted: the "
            "inspector's model (Little's law and waves), not a measurement",
        },
        "rows": rows,
        "unpaired": unpaired,
    }


def comparison_markdown(table: dict) -> str:
    """:func:`measured_vs_predicted` as Markdown: the pairs, then the unpaired rows."""
    m = table["meta"]
    copy = f"{m['copy_GB/s']:.0f} GB/s" if m.get("copy_GB/s") else "unknown"
    out = [
        f"Measured on {m['gpu']} ({m['date']}; torch {m['torch']}, triton "
        f"{m['triton']}, CUDA {m['cuda']}; {m['dtype']}; copy {copy}) against the "
        f"inspector's prediction for the same work (triton {m['inspector_triton']}, "
        f"{m['latency_ns']} ns assumed latency).",
        "",
        "| case | M | N | ms | measured % of copy | predicted % | measured / predicted "
        "| launches |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def pct(v):
        return "-" if v is None else f"{100 * v:.0f}"

    for r in table["rows"]:
        each = ", ".join(f"{x['kernel']} {pct(x['predicted'])}" for x in r["launches"])
        ratio = r["measured / predicted"]
        out.append(
            f"| {r['case']} | {r['M']} | {r['N']} | {r['ms']:.4f} | "
            f"{pct(r['measured'])} | {pct(r['predicted'])} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} | {each} |"
        )
    if table.get("unpaired"):
        out += [
            "",
            "Measured, with no prediction for the same work:",
            "",
            "| case | M | N | measured % of copy | why unpaired |",
            "|---|---|---|---|---|",
        ]
        for r in table["unpaired"]:
            reason = str(r["reason"]).replace("|", "/")
            out.append(
                f"| {r['case']} | {r['M']} | {r['N']} | {pct(r['measured'])} | "
                f"{reason} |"
            )
    return "\n".join(out)


def write_json(path: pathlib.Path, data) -> None:
    """Replace ``path`` whole: a process stopped mid-write leaves the previous file (or
    none) and a ``.tmp`` beside it, never half a file."""
    path = pathlib.Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m normbook.lab.pairing",
        description="inspect the work a benchmark JSON measured",
    )
    p.add_argument("bench", help="a benchmark JSON (python -m normbook.lab.bench)")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--json", required=True, metavar="FILE")
    p.add_argument("--timeout-s", type=float, default=4 * 3600)
    p.add_argument("--calls", default="", help="only these, comma-separated")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--bandwidth-gbps", type=float)
    p.add_argument("--sms", type=int)
    p.add_argument("--gpu-name")
    a = p.parse_args(argv)
    bench = json.loads(pathlib.Path(a.bench).read_text())
    # the GPU measured, in place of the datasheet's (InspectOptions)
    gpu = {"bandwidth_gbps": a.bandwidth_gbps, "sms": a.sms, "gpu_name": a.gpu_name}
    calls = {c for c in a.calls.split(",") if c} or None
    print(
        "inspecting, cheap first: "
        + ", ".join(f"{c} {M}x{N}" for c, M, N in units(bench, calls)),
        flush=True,
    )
    result = inspect_measured(bench, a.arch, a.timeout_s, calls, gpu, a.jobs)
    write_json(pathlib.Path(a.json), result)
    for u in result["meta"]["units"]:
        print(f"{u['call']} {u['M']}x{u['N']}: {u['status']} ({u['rows']} launches)")
    errors = [r for r in result["rows"] if "error" in r]
    for r in errors:
        print(
            f"{r['call']} {r['kernel']}: compile error: {r['error']}", file=sys.stderr
        )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
