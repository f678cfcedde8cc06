"""Keep the book's bookkeeping out of the reader's way: the ``glue`` calls of a visible code
cell move into a cell of their own, tagged ``remove-cell``, right after it.

The book's convention for cell tags, which the site (myst-nb), the Colab edition
(_ext/colab_edition.py) and the tests (tests/book/test_cell_tags.py) honour:

- ``remove-cell``: bookkeeping, never shown: the ``glue`` calls that hand numbers to the prose.
  Executed like every cell; in the Colab edition folded (its values are written into the text).
- ``hide-input``: helpers and figure drawing: the output shows, the code folds behind a
  "Show code" button (in Colab a titled form, in Jupyter ``source_hidden``).
- ``remove-input``: the set-up cell and cells whose output is the point (a table).
- no tag: what the reader should read, at most 40 lines (MAX_VISIBLE_LINES).

A ``glue(...)`` statement moves only where moving it cannot change what it glues: it is a
statement of the cell's top level; no later statement of the cell assigns a name its
arguments read, calls a method of it or sets an item of it; and its arguments call nothing
but conversions and reductions (``float``, ``round``, ``len``, ``.item()``, ``.max()``,
``math.log``, ``np.log10`` …: SAFE_CALLS, SAFE_METHODS, SAFE_MODULES), so that no random
number is drawn out of order. A cell made only of ``glue`` calls is tagged ``remove-cell``
itself.

Usage: ``python tools/tidy_cells.py [--check] [CHAPTER ...]``; then ``tools/clean_notebooks.py``.
"""

from __future__ import annotations

import ast
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_VISIBLE_LINES = 40
HIDDEN = {"remove-cell", "remove-input", "hide-input", "hide-cell"}
SAFE_CALLS = {"float", "int", "round", "abs", "min", "max", "len", "str", "sum", "bool"}
#: Methods that read a value and draw nothing (a tensor's reductions and conversions).
SAFE_METHODS = {
    "item",
    "tolist",
    "numpy",
    "cpu",
    "double",
    "float",
    "max",
    "min",
    "mean",
    "sum",
    "abs",
    "norm",
    "std",
    "var",
    "argmax",
    "argmin",
    "all",
    "any",
    "numel",
    "sqrt",
    "log",
    "log2",
    "log10",
    "exp",
    "prod",
    "amax",
    "amin",
    "replace",
    "split",
}
#: Modules whose functions are pure arithmetic.
SAFE_MODULES = {"math", "np"}


def is_glue(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Name)
        and stmt.value.func.id == "glue"
    )


def _calls_are_safe(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and sub is not node:
            f = sub.func
            if isinstance(f, ast.Name) and f.id in SAFE_CALLS:
                continue
            if isinstance(f, ast.Attribute) and f.attr in SAFE_METHODS:
                continue
            if (
                isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name)
                and f.value.id in SAFE_MODULES
                and "rand" not in f.attr
            ):
                continue
            return False
    return True


def _reads(node: ast.AST) -> set[str]:
    return {
        n.id
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }


def _writes(stmts: list[ast.stmt]) -> set[str]:
    """Names the statements may change: assigned, deleted, or reached through a method
    call, an item or an attribute they set (``xs.append(1)``, ``xs[0] = 1``)."""
    out = set()
    for s in stmts:
        for n in ast.walk(s):
            if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                out.add(n.id)
            target = None
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr not in SAFE_METHODS
            ):
                target = n.func.value
            elif isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(
                n.ctx, (ast.Store, ast.Del)
            ):
                target = n.value
            while isinstance(target, (ast.Subscript, ast.Attribute)):
                target = target.value
            if isinstance(target, ast.Name):
                out.add(target.id)
    return out


def split(source: str) -> tuple[str, str] | None:
    """(what stays, the glue calls that move) or None where nothing moves."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics: left alone
        return None
    body = tree.body
    lines = source.split("\n")
    moving = []
    for k, stmt in enumerate(body):
        if not is_glue(stmt):
            continue
        later = _writes([s for s in body[k + 1 :] if not is_glue(s)])
        if _calls_are_safe(stmt.value) and not (_reads(stmt.value) & later):
            moving.append(stmt)
    if not moving:
        return None
    taken = set()
    for stmt in moving:
        first = stmt.lineno - 1
        # the comment lines right above a moved call go with it
        while first > 0 and lines[first - 1].lstrip().startswith("#"):
            first -= 1
        taken.update(range(first, stmt.end_lineno))
    stay = [ln for i, ln in enumerate(lines) if i not in taken]
    move = [ln for i, ln in enumerate(lines) if i in taken]
    return "\n".join(stay).strip("\n"), "\n".join(move).strip("\n")


def _lines(text: str) -> list[str]:
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def tidy(nb: dict) -> tuple[dict, list[str]]:
    """The notebook with its glue calls moved; and what is still in a reader's way."""
    cells, notes = [], []
    for cell in nb["cells"]:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code" or set(tags) & HIDDEN or "setup" in tags:
            cells.append(cell)
            continue
        src = "".join(cell["source"])
        parts = split(src)
        if parts is None:
            cells.append(cell)
        elif not _code(parts[0]):
            cell.setdefault("metadata", {})["tags"] = [*tags, "remove-cell"]
            cells.append(cell)
        else:
            cell["source"] = _lines(parts[0])
            cells.append(cell)
            cells.append(
                {
                    "cell_type": "code",
                    "execution_count": None,
                    "id": "",
                    "metadata": {"tags": ["remove-cell"]},
                    "outputs": [],
                    "source": _lines(parts[1]),
                }
            )
    nb["cells"] = cells
    for i, cell in enumerate(cells):
        tags = set(cell.get("metadata", {}).get("tags", []))
        n = len("".join(cell["source"]).split("\n"))
        if cell["cell_type"] == "code" and not tags & HIDDEN and n > MAX_VISIBLE_LINES:
            notes.append(f"cell {i}: {n} visible lines")
    return nb, notes


def _code(src: str) -> bool:
    return any(ln.strip() and not ln.lstrip().startswith("#") for ln in src.split("\n"))


def main(argv: list[str]) -> int:
    check = "--check" in argv
    names = [a for a in argv if not a.startswith("--")]
    paths = [ROOT / "book" / f"{n}.ipynb" for n in names] or sorted(
        (ROOT / "book").glob("*.ipynb")
    )
    sys.path.insert(0, str(ROOT / "tools"))
    import clean_notebooks

    bad = 0
    for path in paths:
        before = path.read_text()
        nb, notes = tidy(json.loads(before))
        after = clean_notebooks.dumps(clean_notebooks.clean(nb))
        for note in notes:
            print(f"{path.name}: {note}")
        if check and after != before:
            print(f"{path.name}: glue calls to move (run tools/tidy_cells.py)")
            bad += 1
        elif not check:
            path.write_text(after)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
