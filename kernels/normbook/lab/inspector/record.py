"""Writing the recorded table from what the inspector's cache (or the table already
recorded) holds for every variant of a survey."""

from __future__ import annotations

import json
import os
import pathlib

from . import compiler, table
from .paths import RECORDED
from .table import _NOT_RECORDED, analysis_version, recorded


def write_recorded(
    rows: list[dict], path: pathlib.Path | None = None, use_recorded: bool = True
) -> int:
    """Record what the compiler reported for every variant of ``rows`` (from the
    inspector's cache, or, with ``use_recorded``, the table already recorded): one
    JSON line per variant, sorted by key, after a header naming Triton's version and
    the reader's (:func:`analysis_version`). Returns the count."""
    import triton

    path = path or RECORDED
    entries, missing = {}, []
    for r in rows:
        key = r["variant"]
        if "error" in r or key in entries:
            continue
        # read at each call: --record --from-scratch points the cache elsewhere
        info = compiler._cached(compiler.CACHE / f"{key}.json", triton.__version__) or (
            recorded(path).get(key) if use_recorded else None
        )
        if info is None:
            missing.append(key)
            continue
        entries[key] = {k: v for k, v in info.items() if k not in _NOT_RECORDED}
    if missing:
        raise RuntimeError(
            f"{len(missing)} variants neither cached nor recorded "
            f"(first: {missing[0]}): inspect them first"
        )
    header = {
        "triton": triton.__version__,
        "analysis": analysis_version(),
        "variants": len(entries),
        "note": "what Triton's compiler and ptxas reported for every variant "
        "of the test suite's table (normbook.lab.inspector.survey), by variant "
        "key; written by python -m normbook.lab.inspector --record",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(header) + "\n")
        for key in sorted(entries):
            f.write(
                json.dumps(
                    {"key": key, **entries[key]}, sort_keys=True, separators=(",", ":")
                )
                + "\n"
            )
    tmp.replace(path)
    table.forget(path)
    return len(entries)
