"""Execute every chapter once per test run, then build the HTML from the executed copies.

The chapters run in place (working directory ``book/``, as in ``make book``; which chapters and
how each runs is tools/chapters.py's); the executed notebooks are written to
``_build/test-book/`` together with the book's configuration, with execution switched off there,
and Jupyter Book renders them. Chapter tests read the execution results; browser tests read the
HTML. So each chapter runs once in the whole suite, whichever xdist worker asks first
(run_once.py); the plugin scheduling.py starts this in a background process at collection.

Only the standard library at import (the book's packages are imported where used): the plugin
imports this where they are missing.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field

import chapters
import run_once

ROOT = pathlib.Path(__file__).resolve().parents[1]
# $BOOK_TEST_DIR lets two test runs in one checkout use separate folders (each deletes its own).
OUT = pathlib.Path(
    os.environ.get("BOOK_TEST_DIR", ROOT / "_build" / "test-book")
).resolve()


LAST_RUN: dict = {}  # the latest execute_all() results, for the test summary

#: What executing the chapters, building the HTML and the browser tests need beyond the kernels'
#: packages (the import names of requirements.txt's book and test lines).
BOOK_PACKAGES = (
    "nbformat",
    "nbclient",
    "ipykernel",
    "jupyter_book",
    "plotly",
    "playwright",
)


def missing_packages(names=BOOK_PACKAGES) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def require(names=BOOK_PACKAGES) -> None:
    """Skip the calling test (or module) where the book's packages are missing, with one reason
    for all of them; where the run promised them ($REQUIRE_BOOK, set by `make test`, or
    $REQUIRE_BROWSER, set by CI) a missing package is an error instead, never a silent skip."""
    if not missing_packages(names):
        return
    reason = (
        f"the book's packages are not installed (missing: {', '.join(missing_packages())}): "
        "pip install -r requirements.txt"
    )
    if os.environ.get("REQUIRE_BOOK") or os.environ.get("REQUIRE_BROWSER"):
        raise RuntimeError(reason + " ($REQUIRE_BOOK or $REQUIRE_BROWSER is set)")
    import pytest

    pytest.skip(reason, allow_module_level=True)


@dataclass
class ChapterResult:
    """What the tests read of a chapter's execution (JSON, shared by the run's processes)."""

    path: pathlib.Path
    seconds: float = 0.0
    #: What failed, naming the chapter and the cell; None when every cell ran.
    error: str | None = None
    #: Code cells that wrote to stderr (a warning shows in the book as a red box).
    stderr_cells: list[int] = field(default_factory=list)


def execute(path: pathlib.Path) -> ChapterResult:
    """Execute one chapter; its executed notebook is written under OUT for the HTML."""
    import nbformat

    done = chapters.execute(path, root=ROOT)
    dest = OUT / path.relative_to(ROOT)
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(done.nb, dest)
    return ChapterResult(path, done.seconds, done.error, done.stderr_cells)


def execute_all(workers: int | None = None) -> dict[str, ChapterResult]:
    """Execute every chapter (or only those named in $CHAPTERS, comma-separated, while writing one:
    the others are copied unexecuted so that the HTML still builds)."""
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    notebooks = chapters.notebooks(ROOT)
    only = [c for c in os.environ.get("CHAPTERS", "").split(",") if c]
    if only:
        for p in notebooks:
            if p.stem not in only:
                dest = OUT / p.relative_to(ROOT)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(p, dest)
        notebooks = [p for p in notebooks if p.stem in only]
    workers = workers or min(2, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(execute, chapters.longest_first(notebooks)))
    order = {p: i for i, p in enumerate(notebooks)}  # reported in the book's order
    results.sort(key=lambda r: order.get(r.path, len(order)))
    LAST_RUN.clear()
    LAST_RUN.update({r.path.stem: r for r in results})
    return dict(LAST_RUN)


def reuse() -> dict[str, ChapterResult]:
    """``pytest --reuse-book`` (a developer's shortcut, never CI): the executed notebooks and
    HTML of the previous run in OUT, for iterating on tests that only read them. Chapters with no outputs there
    (not executed last time) are left out, as if not selected."""
    import nbformat

    found = {}
    for path in chapters.notebooks(ROOT):
        done = OUT / path.relative_to(ROOT)
        if not done.exists():
            continue
        nb = nbformat.read(done, as_version=4)
        if any(c.get("outputs") for c in nb.cells if c.cell_type == "code"):
            result = ChapterResult(path)
            result.stderr_cells = [
                i
                for i, c in enumerate(nb.cells)
                if c.cell_type == "code"
                and any(o.get("name") == "stderr" for o in c.get("outputs", []))
            ]
            found[path.stem] = result
    LAST_RUN.clear()
    LAST_RUN.update(found)
    return found


def _to_json(results: dict[str, ChapterResult]) -> dict:
    return {k: {**asdict(r), "path": str(r.path)} for k, r in results.items()}


def _from_json(data: dict) -> dict[str, ChapterResult]:
    return {
        k: ChapterResult(**{**v, "path": pathlib.Path(v["path"])})
        for k, v in data.items()
    }


def executed() -> dict[str, ChapterResult]:
    """Every chapter executed, once per test run however many workers ask (run_once.py)."""
    results = _from_json(
        run_once.once(OUT.parent, OUT.name, lambda: _to_json(execute_all()))
    )
    LAST_RUN.clear()
    LAST_RUN.update(results)
    return results


def html() -> tuple[int, str, pathlib.Path]:
    """The executed chapters rendered, once per test run: (code, log, html dir)."""

    def compute():
        executed()
        code, log, _ = build_html()
        return {"code": code, "log": log}

    r = run_once.once(OUT.parent, OUT.name + "-html", compute)
    return r["code"], r["log"], OUT / "_build" / "html"


def last_run() -> dict[str, ChapterResult]:
    """This run's chapter results, wherever they were computed (for the test summary)."""
    data = run_once.stored(OUT.parent, OUT.name)
    return _from_json(data) if data is not None else dict(LAST_RUN)


def start_background(with_html: bool) -> None:
    """Begin executing the chapters (and building the HTML) in a background process."""
    run_once.start(
        OUT.parent, OUT.name, "book_build:html" if with_html else "book_build:executed"
    )


def build_html() -> tuple[int, str, pathlib.Path]:
    """Render the executed copies with Jupyter Book (execution off). Returns (code, log, html dir)."""
    for name in ("_toc.yml", "references.bib"):
        shutil.copy(ROOT / name, OUT / name)
    shutil.copytree(ROOT / "_ext", OUT / "_ext", dirs_exist_ok=True)
    for f in chapters.toc_files(
        ROOT
    ):  # pages that are not notebooks: copied as they are
        src = ROOT / f"{f}.md"
        if src.exists():
            (OUT / src.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, OUT / src.relative_to(ROOT))
    import yaml

    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    cfg["execute"]["execute_notebooks"] = "off"
    (OUT / "_config.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    jb = pathlib.Path(sys.executable).parent / "jupyter-book"
    only = [c for c in os.environ.get("CHAPTERS", "").split(",") if c]
    # With $CHAPTERS the other chapters are unexecuted (their glue keys are missing): warnings are
    # then errors only when they name a selected chapter.
    strict = [] if only else ["-W"]
    proc = subprocess.run(
        [
            str(jb),
            "build",
            str(OUT),
            *strict,
            "-n",
            "--keep-going",
            "--builder",
            "html",
        ],
        capture_output=True,
        text=True,
    )
    log = proc.stdout + proc.stderr
    code = proc.returncode
    if only:
        ours = [
            line
            for line in log.splitlines()
            if "WARNING" in line and any(f"/{c}." in line for c in only)
        ]
        code = code or (1 if ours else 0)
        log += "\nwarnings in the selected chapters:\n" + "\n".join(ours)
    return code, log, OUT / "_build" / "html"
