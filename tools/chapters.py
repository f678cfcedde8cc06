"""The book's chapters: which they are (``_toc.yml``) and how one is executed.

One reader of the table of contents and one executor, for the three that execute the
chapters: `make book` (tools/execute_chapters.py, into the build's execution cache), the
tests (tests/book_build.py, once per test run) and the GPU day (tools/gpu_check.py, on the
GPU machine's own Python). Each chapter runs in a fresh Jupyter kernel (the notebook's,
python3) working in the chapter's folder, as a reader's does, and stops at its first failing
cell.

A kernel that fails outside any cell (it did not start, or nbclient's clean-up raised: a
known race of kernels started at once under load, jupyter/nbclient#126) is started once more
on the chapter read again from its file; an error in a cell, or a cell past its time, is the
chapter's and final.

Only the standard library at import: PyYAML is imported by the reader, nbformat and nbclient
by the executor, so that tools/gpu_check.py imports this where they are missing.
"""

from __future__ import annotations

import pathlib
import re
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Seconds a cell may take (as _config.yml's execute.timeout).
TIMEOUT = 900


def toc_files(root: pathlib.Path = ROOT) -> list[str]:
    """Every page of ``root``'s _toc.yml in order, as a path relative to ``root`` without
    its suffix (``book/rms_norm``): the root page, then each part's chapters."""
    import yaml

    toc = yaml.safe_load((root / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", [{"chapters": toc.get("chapters", [])}]):
        files.extend(entry["file"] for entry in part.get("chapters", []))
    return files


def notebooks(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The chapters: the pages of _toc.yml that are notebooks, in order."""
    return [
        root / f"{f}.ipynb" for f in toc_files(root) if (root / f"{f}.ipynb").exists()
    ]


#: Seconds each chapter took to execute in the test run on a 2-core CPU, beside the tests
#: (2026-12-07, Triton's interpreter): only their order matters, for longest_first.
SECONDS = {
    "serving": 105, "variance": 74, "qwen3_block": 73, "backward": 50,
    "online_softmax": 43, "qk_norm_rope": 39, "matmul": 39, "rms_norm": 37,
    "sampling": 31, "layer_norm": 29, "decoding": 27, "speed_of_light": 26,
    "why_normalize": 22, "norm_placement": 21, "attention_backward": 21, "fp8": 19,
    "softmax": 18, "causal_masks": 16, "gpu_primer": 15, "speculative_decoding": 9,
}  # fmt: skip


def longest_first(paths: list[pathlib.Path]) -> list[pathlib.Path]:
    """The chapters in the order to hand them to parallel kernels: the longest first, so
    that no core is left with one long chapter at the end while the other idles (a new
    chapter, not in SECONDS, counts as the longest)."""
    return sorted(paths, key=lambda p: -SECONDS.get(p.stem, 10**6))


@dataclass
class Execution:
    """One chapter executed: ``nb`` holds its outputs (up to the failing cell)."""

    path: pathlib.Path
    nb: object = None
    seconds: float = 0.0
    #: What failed, naming the chapter and the cell; None when every cell ran.
    error: str | None = None
    #: The exception nbclient raised (None when every cell ran).
    exception: BaseException | None = None
    #: Code cells that wrote to stderr (a warning shows in the book as a red box).
    stderr_cells: list[int] = field(default_factory=list)


def execute(
    path: pathlib.Path, timeout: float = TIMEOUT, nb=None, root: pathlib.Path = ROOT
) -> Execution:
    """Execute the chapter at ``path`` (``nb``: the notebook already read from it), once
    more from its file if the kernel fails outside any cell (see the module's docstring)."""
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = _read(path) if nb is None else nb
    start = time.perf_counter()
    exc = _run(nb, path, timeout)
    if exc is not None and not isinstance(exc, (CellExecutionError, CellTimeoutError)):
        print(
            f"  {path.name}: the kernel failed outside any cell "
            f"({type(exc).__name__}: {exc}); executing it again",
            flush=True,
        )
        nb = _read(path)
        exc = _run(nb, path, timeout)
    result = Execution(path, nb, time.perf_counter() - start, exception=exc)
    rel = path.relative_to(root) if path.is_relative_to(root) else path
    if isinstance(exc, CellExecutionError):
        failing = next(
            (i for i, c in enumerate(nb.cells) if _outputs(c, "output_type", "error")),
            None,
        )
        where = _cell_label(nb, failing) if failing is not None else "a cell"
        result.error = f"chapter {rel}, {where} failed:\n{_plain(exc)}"
    elif exc is not None:  # a cell past its time, a kernel that died
        result.error = (
            f"chapter {rel} could not be executed: {type(exc).__name__}: {_plain(exc)}"
        )
    result.stderr_cells = [
        i for i, c in enumerate(nb.cells) if _outputs(c, "name", "stderr")
    ]
    return result


def _read(path: pathlib.Path):
    import nbformat

    return nbformat.read(path, as_version=4)


def _run(nb, path: pathlib.Path, timeout: float) -> BaseException | None:
    """Execute ``nb`` in place; the exception that stopped it, or None."""
    from nbclient import NotebookClient

    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=False,
        record_timing=False,  # outputs only, no timestamps in the cells' metadata
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute()
    except Exception as exc:
        return exc
    return None


def _outputs(cell, key: str, value: str) -> bool:
    return cell.cell_type == "code" and any(
        o.get(key) == value for o in cell.get("outputs", [])
    )


def _cell_label(nb, index: int) -> str:
    src = "".join(nb.cells[index].source).strip().splitlines()
    first = src[0] if src else ""
    return f"cell {index} (`{first[:80]}`)"


def _plain(exc: BaseException) -> str:
    """The message without the traceback's terminal colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
