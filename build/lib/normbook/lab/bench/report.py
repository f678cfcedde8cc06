"""The benchmark's files: CSV/JSON with provenance, and reading recorded GPU runs
back."""

from __future__ import annotations

import csv
import json
import math
import pathlib
import re

from ..paths import REPO as ROOT
from .cases import CASES, DATA_DIR, DO_BENCH, PROVIDERS, TARGET_MIN_N, TARGETS

# ---------------------------------------------------------------- files

CSV_FIELDS = [
    "kernel",
    "direction",
    "provider",
    "regime",
    "M",
    "N",
    "shape",
    "dtype",
    "bytes",
    "ms",
    "GB/s",
    "pct_of_copy",
    "status",
    "check",
    "note",
    "gpu",
    "torch",
    "triton",
    "date",
    "copy_GB/s",
    "smoke",
]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "device"


def write_results(
    out_dir: pathlib.Path,
    prov: dict,
    copy: dict,
    rows: list[dict],
    errors: list[dict] = (),
    complete: bool = True,
    cut: str | None = None,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write (or rewrite) the run's JSON and CSV. Each file is replaced whole (written
    beside, then renamed), so that a process stopped at any moment leaves the last
    complete version. ``complete`` False with ``cut`` says the run was stopped and
    where."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = prov["date"].replace(":", "").replace("-", "").replace("+0000", "Z")
    stem = f"{stamp}_{_slug(prov['gpu'])}" + ("_smoke" if prov["smoke"] else "")
    json_path, csv_path = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    data = {"provenance": prov, "copy": copy, "results": rows, "errors": list(errors)}
    if not complete or cut:
        data.update(complete=complete, cut=cut)
    tmp = json_path.with_name(json_path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(json_path)
    tmp = csv_path.with_name(csv_path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {
                    **r,
                    "dtype": prov["dtype"],
                    "gpu": prov["gpu"],
                    "torch": prov["torch"],
                    "triton": prov["triton"],
                    "date": prov["date"],
                    "copy_GB/s": copy["GB/s"],
                    "smoke": prov["smoke"],
                }
            )
    tmp.replace(csv_path)
    return json_path, csv_path


def load_runs(folder: pathlib.Path | str | None = None) -> list[dict]:
    """Every recorded GPU run in ``folder`` (default data/bench/), oldest first.

    Only files written by a full run on a CUDA GPU count: smoke runs, interpreter runs
    and files without provenance are ignored, so that no figure can come from anything
    but a GPU.
    """
    folder = DATA_DIR if folder is None else pathlib.Path(folder)
    runs = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            run_ = json.loads(path.read_text())
            prov = run_["provenance"]
        except (ValueError, KeyError, TypeError):
            continue
        on_gpu = str(prov.get("device", "")).startswith("cuda")
        if prov.get("smoke") or prov.get("interpreter") or not on_gpu:
            continue
        if prov.get("timer") != DO_BENCH or not run_.get("results"):
            continue
        run_["path"] = str(path)
        runs.append(run_)
    return sorted(runs, key=lambda r: r["provenance"]["date"])


def label(run_: dict) -> str:
    """One line naming where and when a run was measured."""
    p = run_["provenance"]
    cuda = f" · CUDA {p['cuda']}" if p.get("cuda") else ""
    cut = " · stopped by its budget" if run_.get("complete") is False else ""
    return (
        f"{p['gpu']} · torch {p['torch']} · triton {p['triton']}{cuda} · {p['dtype']} "
        "· "
        f"{p['date'][:10]} · copy {run_['copy']['GB/s']:.0f} GB/s{cut}"
    )


def comparison(run_: dict) -> dict | None:
    """The measured-against-predicted table recorded with a run (``tools/gpu_check.py``
    writes it; ``--record`` keeps it in
    ``data/bench/<run>/measured_vs_predicted.json``).
    """
    path = (
        pathlib.Path(run_.get("path", "")).with_suffix("")
        / "measured_vs_predicted.json"
    )
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def recorded_lines(
    kernels: set[str], directions: set[str], run_: dict | None = None
) -> list[str]:
    """What the latest recorded GPU run measured for these kernels (names of
    :data:`CASES` kernels) and directions: one line per shape, our kernel's ms and % of
    the copy bandwidth, the prediction beside it where one was recorded, and the other
    providers' ms. Empty when no run is recorded or it has no such rows."""
    if run_ is None:
        runs = load_runs()
        if not runs:
            return []
        run_ = runs[-1]
    ok = [
        r
        for r in run_["results"]
        if r["status"] == "ok"
        and r["kernel"] in kernels
        and r["direction"] in directions
    ]
    if not ok:
        return []
    table = comparison(run_) or {"rows": []}
    predicted = {(r["case"], r["M"], r["N"]): r["predicted"] for r in table["rows"]}
    shown = [
        p for p in PROVIDERS if p != "normbook" and any(r["provider"] == p for r in ok)
    ]
    short = {"torch eager": "eager", "torch.compile": "compile"}
    prov, path = run_["provenance"], pathlib.Path(run_.get("path", ""))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    lines = [
        f"Measured on {prov['gpu']} by `make gpu-check`, {prov['date'][:10]}"
        f"{' (stopped by its budget)' if run_.get('complete') is False else ''}:",
        f"  torch {prov['torch']}, triton {prov['triton']}, CUDA {prov.get('cuda')}, "
        f"{prov['dtype']}; copy {run_['copy']['GB/s']:.0f} GB/s",
        f"  not measured in this session: recorded in {where}",
        f"{'case':<24}{'M':>6}{'N':>8}{'ms':>9}{'% copy':>8}{'pred.':>7}"
        + "".join(f"{short.get(p, p) + ' ms':>12}" for p in shown),
    ]
    keys = dict.fromkeys((r["kernel"], r["direction"], r["M"], r["N"]) for r in ok)
    for kernel, direction, M, N in keys:
        mine = {
            r["provider"]: r
            for r in ok
            if (r["kernel"], r["direction"], r["M"], r["N"])
            == (kernel, direction, M, N)
        }
        ours = mine.get("normbook")
        case = f"{kernel}.{direction}"
        pred = predicted.get((case, M, N))
        cells = [
            f"{case:<24}{M:>6}{N:>8}",
            (
                f"{ours['ms']:>9.4f}{ours['pct_of_copy']:>7.1f}%"
                if ours
                else f"{'-':>9}{'-':>8}"
            ),
            f"{100 * pred:>6.0f}%" if pred is not None else f"{'-':>7}",
        ]
        cells += [
            f"{mine[p]['ms']:>12.4f}" if p in mine else f"{'-':>12}" for p in shown
        ]
        lines.append("".join(cells))
    return lines


def summary(run_: dict) -> list[dict]:
    """Per case and provider: the lowest % of copy bandwidth for N >= TARGET_MIN_N, and
    whether the Triton kernel is at least as fast as torch.compile on every shape."""
    # The sweep's rows (many rows per shape); decode shapes are read separately.
    ok = [
        r
        for r in run_["results"]
        if r["status"] == "ok" and r.get("regime", "sweep") in ("sweep", "")
    ]
    out = []
    for kernel, direction in dict.fromkeys((r["kernel"], r["direction"]) for r in ok):
        case = next(
            (c for c in CASES if c.kernel == kernel and c.direction == direction), None
        )
        target = TARGETS.get(case.target) if case else None
        rows = [r for r in ok if (r["kernel"], r["direction"]) == (kernel, direction)]
        compiled = {r["N"]: r["ms"] for r in rows if r["provider"] == "torch.compile"}
        for provider in dict.fromkeys(r["provider"] for r in rows):
            mine = [r for r in rows if r["provider"] == provider]
            big = [
                r["pct_of_copy"]
                for r in mine
                if r["N"] >= TARGET_MIN_N and r["pct_of_copy"] is not None
            ]
            entry = {
                "kernel": kernel,
                "direction": direction,
                "provider": provider,
                "min % of copy (N >= 4096)": min(big) if big else None,
                "target %": 100 * target if target and provider == "normbook" else None,
            }
            if provider == "normbook" and compiled:
                entry["as fast as torch.compile on every N"] = all(
                    r["ms"] <= compiled[r["N"]] for r in mine if r["N"] in compiled
                )
            out.append(entry)
    return out


def plot_run(run_: dict):
    """One panel per case: GB/s against N for every provider, the copy bandwidth as a
    line."""
    import matplotlib.pyplot as plt

    ok = [
        r
        for r in run_["results"]
        if r["status"] == "ok" and r.get("regime", "sweep") in ("sweep", "")
    ]
    cases = list(dict.fromkeys((r["kernel"], r["direction"]) for r in ok))
    # one panel per row: legible on a phone (see normbook.lab.notebook._sharp_figures)
    cols = 1
    rows_ = math.ceil(len(cases) / cols) if cases else 1
    fig, axes = plt.subplots(rows_, cols, figsize=(6.4, 3.6 * rows_), squeeze=False)
    copy = run_["copy"]["GB/s"]
    for ax, (kernel, direction) in zip(axes.flat, cases):
        for provider in PROVIDERS:
            pts = sorted(
                (r["N"], r["GB/s"])
                for r in ok
                if (r["kernel"], r["direction"], r["provider"])
                == (kernel, direction, provider)
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=provider)
        ax.axhline(copy, color="k", ls="--", lw=1, label="copy (measured)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{kernel} {direction}")
        ax.set_xlabel("hidden size N")
        ax.set_ylabel("GB/s")
        ax.set_ylim(0, copy * 1.15)
    for ax in list(axes.flat)[len(cases) :]:
        ax.axis("off")
    if cases:
        axes.flat[0].legend()
    fig.suptitle(label(run_))
    fig.tight_layout()
    return fig
