"""Execute the book's chapters for `make book`: in parallel, one Jupyter kernel per core, into the
execution cache that `jupyter-book build` reads (``execute_notebooks: cache`` in _config.yml), so
the build renders every chapter without executing it again. A failing chapter fails this step
(exit 1) with its cell's error, before anything is built.

What is cached is exact: jupyter-cache keys each chapter by its code cells and kernel, and this
script adds a stamp of everything else the chapters' results depend on: ``kernels/`` (the code
the chapters import), ``pyproject.toml``, ``requirements.txt`` and the Python, torch, triton and
numpy versions. When the stamp changes, the whole cache is cleared and every chapter runs again;
an unchanged chapter on unchanged code is not executed twice. ``--force`` clears it regardless.
A chapter executed here has its file's mtime renewed, so that the build renders it again.

Which chapters, and how each is executed (a fresh kernel in the chapter's folder; once more
if the kernel fails outside any cell), is tools/chapters.py's, shared with the tests and
tools/gpu_check.py.

Usage: ``python tools/execute_chapters.py [--force] [--jobs N]`` (from the repository root).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.metadata
import os
import pathlib
import shutil
import sys
import time

import chapters

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = ROOT / "_build" / ".jupyter_cache"  # myst-nb's default: next to _build/html
STAMP = CACHE / "normbook-stamp.txt"


def stamp() -> str:
    h = hashlib.sha256()
    for path in sorted((ROOT / "kernels").rglob("*.py")) + [
        ROOT / "pyproject.toml",
        ROOT / "requirements.txt",
    ]:
        h.update(
            str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0"
        )
    versions = [sys.version]
    for dist in ("torch", "triton", "numpy"):
        try:
            versions.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist} missing")
    h.update("\n".join(versions).encode())
    return h.hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--force", action="store_true", help="clear the cache and execute every chapter"
    )
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    if a.jobs > 1:
        # A kernel per core already: one compute thread each, not one per core each (which
        # only oversubscribes the cores; see tests/scheduling.py). The kernels inherit it.
        os.environ.setdefault("OMP_NUM_THREADS", "1")

    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    want = stamp()
    if a.force or (
        CACHE.exists() and (not STAMP.exists() or STAMP.read_text() != want)
    ):
        print(
            "execute_chapters: kernels/, the requirements or the versions changed: cache cleared"
        )
        shutil.rmtree(CACHE, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    cache = get_cache(str(CACHE))
    STAMP.write_text(want)

    every = chapters.longest_first(chapters.notebooks(ROOT))
    todo = []
    for path in every:
        nb = nbformat.read(path, as_version=4)
        try:
            cache.match_cache_notebook(nb)
        except KeyError:
            todo.append((path, nb))
    print(
        f"execute_chapters: {len(todo)} of {len(every)} chapters to execute, {a.jobs} at a time"
    )

    def run(item):
        path, nb = item
        return chapters.execute(path, nb=nb, root=ROOT)

    failed = []
    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        for result in pool.map(run, todo):
            path = result.path
            rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            if result.error is not None:
                failed.append(result.error)
                print(f"  {rel}: FAILED after {result.seconds:.1f} s")
                continue
            cache.cache_notebook_bundle(
                CacheBundleIn(
                    result.nb, str(path), data={"execution_seconds": result.seconds}
                ),
                check_validity=False,
                overwrite=True,
            )
            # New outputs for an unchanged source: a newer mtime makes Sphinx's incremental build
            # read the chapter again (it compares mtimes), so the HTML shows what just ran.
            os.utime(path)
            print(f"  {rel}: {result.seconds:.1f} s")
    print(f"execute_chapters: done in {time.time() - start:.0f} s")
    for f in failed:
        print(f, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
