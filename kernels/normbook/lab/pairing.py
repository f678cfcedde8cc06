"""Which of the inspector's predictions is for the work a benchmark row measured.

The benchmark (:mod:`normbook.lab.bench.cases`) and the inspector (the ``_calls`` of
:mod:`normbook.lab.inspector`) each build a kernel's inputs from (M, N) in their own
way, and for some kernels the two are different work: decode attention (the
benchmark's N is the cached tokens, with 32 query heads; the inspector's N is the
heads' width, over 4,096 cached tokens) and sampling (greedy measured; temperature,
top-k and top-p inspected). Until both read one spec, :func:`inspector_work` says, for a
benchmark row (kernel, direction, M, N and its ``params``), which inspector call, phase
and (M, N) does the same work, or why none does. tests/test_gpu_check.py checks it
against both builders at every shape of the GPU day's plan.

The GPU day (tools/gpu_check.py) inspects exactly the work that pairs, cheap calls
first (:func:`inspect_measured`, the command below), and :func:`measured_vs_predicted`
pairs a measured row only with a prediction of the same call, phase, shape, dtype and
parameters; every other measured row is listed as unpaired, with the reason::

    python -m normbook.lab.pairing BENCH.json --arch 90 --json inspect_sm90.json \\
        [--timeout-s S] [--calls rms_norm,...] [--bandwidth-gbps G --sms N --gpu-name X]

Only the standard library is imported at the top: tools/gpu_check.py loads this file
by path, without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

# As normbook.lab.bench.cases spells them (the tests check): the inspector builds its
# inputs from these too.
HEAD_DIM = 128
GQA_GROUP = 4
#: Tokens per request of the inspector's decode_attention (cases.DECODE_CACHE).
DECODE_CACHE = 4096
#: Query and key/value heads of the benchmark's decode_attention
#: (cases.DECODE_ATTENTION_HEADS) above 256 cached tokens.
DECODE_HEADS = (32, 8)
#: The benchmark's attention splits more tokens than this into several sequences; the
#: inspector's is always one.
MAX_SEQ = 4096
#: The benchmark's attention backward runs at least this many tokens.
MIN_BACKWARD_SEQ = 64

#: Measured, never inspected: why.
NOT_INSPECTED = {
    "linear_cross_entropy": "its own launches are cross_entropy's kernels between "
    "cuBLAS products, which the inspector cannot lower",
}
#: The arguments beyond its tensors that the inspector's call passes, where they change
#: the work (sample's generator, a seed, changes the draws only). A benchmark row's
#: ``params`` must be the same for the two to pair.
INSPECTOR_PARAMS = {
    "sample": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "attention": {"causal": True},
}
#: A causal mask aligned top-left or bottom-right is one mask when queries and keys are
#: as many, as in both builders' self-attention (normbook.attention's docstring).
_SAME_VALUE = {
    "causal": {True: "causal", "bottom_right": "causal", "top_left": "causal"}
}

#: Seconds each call took to inspect at the GPU day's shapes, compiling from nothing
#: (one child, sm_90, bf16, on a busy 2-core CPU, Triton 3.9; about 8 of them start-up):
#: the order of :func:`units`, cheap first, so that a deadline cuts the costly ones. A
#: call not listed goes last.
INSPECT_SECONDS = {
    "softmax": 11,
    "cross_entropy": 12,
    "layer_norm": 14,
    "decode_attention": 14,
    "rms_norm": 15,
    "swiglu": 16,
    "fused_add_rms_norm": 18,
    "attention": 20,
    "qk_norm_rope": 21,
    "sample": 64,
}
#: The shape label of the inspector's rows for measured work.
LABEL = "plan"
_SHORT_DTYPE = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "float64": "fp64",
}


def _normal(params: dict) -> dict:
    return {
        k: _SAME_VALUE.get(k, {}).get(v, v) if isinstance(v, (bool, str)) else v
        for k, v in params.items()
    }


def inspector_work(
    kernel: str, direction: str, M: int, N: int, params: dict | None = None
) -> tuple[str, str, int, int] | str:
    """The inspector's (call, phase, M, N) that does the work the benchmark's case
    ``kernel.direction`` measured at (M, N) with ``params``, or, as a string, why no
    inspector call does."""
    if kernel in NOT_INSPECTED:
        return f"not inspected: {NOT_INSPECTED[kernel]}"
    theirs = INSPECTOR_PARAMS.get(kernel, {})
    if _normal(params or {}) != _normal(theirs):
        return (
            f"measured with {params or 'no parameters'}, the inspector's call passes "
            f"{theirs or 'none'}: different work"
        )
    if kernel == "attention":
        if M > MAX_SEQ:
            return (
                f"measured as {M // MAX_SEQ} sequences of {MAX_SEQ} tokens; the "
                f"inspector's {M} tokens are one sequence"
            )
        if direction == "backward" and M < MIN_BACKWARD_SEQ:
            return f"measured at {MIN_BACKWARD_SEQ} tokens, not {M}"
    if kernel == "decode_attention":
        if (
            N != DECODE_CACHE
            or M > 64
            or DECODE_HEADS[1] * GQA_GROUP != DECODE_HEADS[0]
        ):
            return (
                f"measured over {N} cached tokens per request; the inspector's "
                f"decode_attention reads {DECODE_CACHE} (at most 64 requests)"
            )
        # the inspector's N is the query heads' width; its cache, DECODE_CACHE tokens
        return kernel, direction, M, DECODE_HEADS[0] * HEAD_DIM
    return kernel, direction, M, N


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
    backward of one shape are one unit), cheap calls first (:data:`INSPECT_SECONDS`),
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
    last = max(INSPECT_SECONDS.values()) + 1
    return sorted(out, key=lambda u: INSPECT_SECONDS.get(u[0], last))


def inspect_measured(
    bench: dict,
    arch: int,
    timeout: float,
    calls=None,
    gpu_args=(),
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
        gpu_args=list(gpu_args),
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
    gpu_args = []
    for flag, value in (
        ("--bandwidth-gbps", a.bandwidth_gbps),
        ("--sms", a.sms),
        ("--gpu-name", a.gpu_name),
    ):
        if value:
            gpu_args += [flag, str(value)]
    calls = {c for c in a.calls.split(",") if c} or None
    print(
        "inspecting, cheap first: "
        + ", ".join(f"{c} {M}x{N}" for c, M, N in units(bench, calls)),
        flush=True,
    )
    result = inspect_measured(bench, a.arch, a.timeout_s, calls, gpu_args, a.jobs)
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
