"""A unit's rows: every launch of its calls at its shapes, captured, compiled (or read),
and turned into a row of the table with the model's columns."""

from __future__ import annotations

import math

from .capture import _INPUTS
from .compiler import _compile_and_read
from .gpus import GPU, littles_law_bytes, occupancy
from .launches import _calls
from .shapes import read


def unit_rows(capture, gpu: GPU, unit: tuple, options) -> list[dict]:
    """One unit's rows: every launch of its calls (all when none is named) at each of
    its shapes. ``unit``: (arch, dtype, calls, shapes) as a child reads it; ``options``:
    an :class:`InspectOptions`."""
    arch, dtype, calls, shapes = unit
    which = set(calls.split(",")) if calls else None
    rows = []
    for label, M, N in read(shapes):
        for call, (forward, backward) in _calls(label, M, N, dtype, which):
            at = dict(arch=arch, call=call, shape=label, M=M, N=N, dtype=dtype)
            seen = set()
            for phase, fn in (("forward", forward), ("backward", backward)):
                if fn is None or phase not in options.phases:
                    continue
                for launch in _phase_launches(capture, phase, fn):
                    ident = (launch["phase"], launch["key"], tuple(launch["grid"]))
                    if ident in seen:  # the forward of a backward case: already listed
                        continue
                    seen.add(ident)
                    info = _compile_and_read(
                        *launch["_compile"],
                        capture.target,
                        launch["key"],
                        need_ptx=options.ptx,
                    )
                    row = _row(launch, info, at, gpu, options.latency_ns)
                    if options.ptx and "ptx" in info:
                        row["ptx"] = info["ptx"]
                    rows.append(row)
    return rows


def _phase_launches(capture, phase: str, fn) -> list[dict]:
    """The launches one phase of a call makes: a forward's, or a backward case's
    forward then backward launches."""
    import torch

    _INPUTS.clear()
    capture.launches, capture.phase = [], "forward"
    grad_mode = torch.no_grad if phase == "forward" else torch.enable_grad
    with grad_mode():
        gen = fn()
        # A backward is a generator: forward launches, then backward ones (it stops at
        # once when the function refuses inputs requiring grad).
        started = phase == "backward" and (
            next(gen, StopIteration) is not StopIteration
        )
        if started:
            capture.phase = "backward"
            next(gen, None)
    return capture.launches


def _row(launch: dict, info: dict, at: dict, gpu: GPU, latency_ns: float) -> dict:
    """One launch's row: where it was made (``at``: arch, call, shape, M, N, dtype),
    what the compiler reported (``info``), and the model's columns."""
    row = {
        "arch": at["arch"],
        "call": at["call"],
        "phase": launch["phase"],
        "kernel": launch["kernel"],
        "shape": at["shape"],
        "M": at["M"],
        "N": at["N"],
        "dtype": at["dtype"],
        "grid": int(math.prod(launch["grid"])),
        "constexprs": launch["constexprs"],
        "variant": launch["key"],
    }
    if "error" in info:
        row["error"] = info["error"]
        return row
    smem = info["shared"] + info["static_smem"]
    tensors = launch["tensors"]
    rows_like = {k for k, t in tensors.items() if len(t["shape"]) >= 2}
    loads, stores = {}, {}
    for a in info["accesses"]:
        for arg in a["args"] or ["?"]:
            d = loads if a["op"] == "ld" else stores
            d.setdefault(arg, set()).add(a["bits"])
    row.update(
        {
            "num_warps": info["num_warps"],
            "registers": info["registers"],
            "spill_stores": info["spill_stores"],
            "spill_loads": info["spill_loads"],
            "smem": smem,
            "loads": {k: sorted(v) for k, v in sorted(loads.items())},
            "stores": {k: sorted(v) for k, v in sorted(stores.items())},
            # The row-sized inputs of the public call (x, dy, a residual, q, k, cos,
            # sin), as passed: the tensors whose load width the tests check (not the
            # kernels' own buffers).
            "row_args": sorted(k for k in rows_like if tensors[k].get("input")),
            "math": info["math"],
            **_model(info, rows_like, smem, row["grid"], gpu, latency_ns),
            "ptx_sha": info["ptx_sha"],
        }
    )
    return row


def _model(
    info: dict, rows_like: set, smem: int, grid: int, gpu: GPU, latency_ns: float
) -> dict:
    """The model's columns: CTAs per SM and their limit, waves, the bytes of row loads
    a SM keeps in flight against what Little's law needs, and ``predicted``."""
    warps = info["num_warps"]
    ctas, limiter = occupancy(gpu, info["registers"], warps, smem)
    # Bytes a CTA can have in flight: the row-sized loads issued together (same
    # innermost loop, or the straight-line code), per thread, times the threads.
    groups: dict = {}
    for a in info["accesses"]:
        if a["op"] == "ld" and set(a["args"]) & rows_like:
            key = tuple(a["loop"]) if a["loop"] else None
            groups[key] = groups.get(key, 0) + a["bits"] // 8
    per_cta = max(groups.values(), default=0) * 32 * warps
    # CTAs per SM, on average, at once
    resident = min(ctas, grid / gpu.sms)
    in_flight = resident * per_cta
    need = littles_law_bytes(gpu, latency_ns)
    waves = grid / (gpu.sms * max(ctas, 1))
    # The last wave's idle SMs (tail effect); under one wave ``resident`` already counts
    # them.
    wave_eff = waves / math.ceil(waves) if waves > 1 else 1.0
    return {
        "ctas_per_sm": ctas,
        "occupancy_limit": limiter,
        "waves": round(waves, 3),
        "in_flight_per_sm": round(in_flight),
        "littles_per_sm": round(need),
        "predicted": round(min(1.0, in_flight / need) * wave_eff, 3) if need else None,
    }
