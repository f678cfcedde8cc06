"""Reading the recorded table (``data/inspect/variants.jsonl``): what the compiler
reported for every variant of the test suite's table, by variant key, under a header
naming Triton's version and the version of the reader (:func:`analysis_version`)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import threading

from .paths import RECORDED

#: What the recorded table holds of an entry: everything the rows are made from. Not the
#: PTX (90 KB a variant), nor the compile's duration (differs run to run).
_NOT_RECORDED = ("ptx", "compile_s", "triton")
_RECORDED_CACHE: dict = {}


def recorded_path() -> pathlib.Path | None:
    env = os.environ.get("NORMBOOK_INSPECT_RECORDED")
    if env is None:
        return RECORDED
    return pathlib.Path(env) if env else None


#: What analysis_version hashes: the functions and patterns that make an entry,
#: wherever they are defined at the top of a module of this package.
_ANALYSIS = {
    "_access_bits",
    "analyze_ptx",
    "_ptxas",
    "parse_ptxas_log",
    "_ptx_sha",
    "_compile",
    "_PARAM",
    "_ACCESS",
    "_ADDR",
    "_REG",
    "_LABEL",
    "_BRANCH",
    "_MATH",
    "_TYPE_BITS",
}


_ANALYSIS_VERSION: list = []
# The recorded table is loaded, and the reader's version computed, once per process,
# under this lock: CPython 3.11's ast.parse fails when two threads run it at once ("AST
# constructor recursion depth mismatch"), and the inspector's compiles can be threads.
_RECORDED_LOCK = threading.RLock()


def analysis_version() -> str:
    """A hash of the code that turns the compiler's output into an entry (the PTX
    reader, the ptxas log's parser, the PTX's hash), as code (its syntax tree, wherever
    in the package's modules it lives, comments and docstrings aside): an entry
    keeps its variant's key when this code changes, so the recorded table names the
    version it was read with, and another version's table is not read."""
    with _RECORDED_LOCK:
        if not _ANALYSIS_VERSION:
            _ANALYSIS_VERSION.append(_analysis_version())
        return _ANALYSIS_VERSION[0]


def _analysis_version() -> str:
    import ast

    parts = []
    # every module of this package: the reader's code may move between them
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = getattr(node, "targets", [])
            names = (
                {node.name}
                if isinstance(node, ast.FunctionDef)
                else {t.id for t in targets if isinstance(t, ast.Name)}
            )
            if names & _ANALYSIS:
                parts.append(ast.dump(_without_docstring(node)))
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()[:16]


def _without_docstring(node):
    """The node as code, not as text: a docstring, a comment, a line break or the
    module the function lives in do not change what it computes."""
    import ast
    import copy

    body = getattr(node, "body", None)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        node = copy.copy(node)
        node.body = body[1:]
    return node


def recorded_header(path: pathlib.Path | None = None) -> dict:
    """The recorded table's first line (``{"triton": ..., "analysis": ...,
    "variants": ...}``), or ``{}`` where there is none."""
    path = path or recorded_path()
    if path is None or not path.exists():
        return {}
    with open(path) as f:
        return json.loads(f.readline() or "{}")


def recorded(path: pathlib.Path | None = None) -> dict:
    """{variant key: what the compiler reported} from the recorded table, or ``{}``
    where there is none, or it was recorded by another Triton (whose keys would not
    match anyway: a key names Triton's version) or read by another version of this
    package's reader (:func:`analysis_version`). A line that is not an entry (a merge's
    conflict marker) is an error naming the file and the line."""
    path = path or recorded_path()
    if path is None:
        return {}
    with _RECORDED_LOCK:
        if path in _RECORDED_CACHE:
            return _RECORDED_CACHE[path]
        return _load_recorded(path)


def _load_recorded(path: pathlib.Path) -> dict:
    import triton

    table = {}
    header = recorded_header(path)
    if (
        header.get("triton") == triton.__version__
        and header.get("analysis") == analysis_version()
    ):
        with open(path) as f:
            next(f)
            for n, line in enumerate(f, start=2):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    table[entry.pop("key")] = entry
                except (ValueError, KeyError, AttributeError) as exc:
                    raise ValueError(
                        f"{path}, line {n}: not an entry of the recorded "
                        f"table ({exc}): record it again "
                        f"(make inspect-record)"
                    ) from None
    _RECORDED_CACHE[path] = table
    return table


def forget(path: pathlib.Path) -> None:
    """Read ``path`` again at its next use (it was just written)."""
    with _RECORDED_LOCK:
        _RECORDED_CACHE.pop(path, None)
