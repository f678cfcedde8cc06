"""The package as an engineer imports it: ``import normbook`` loads the library only (no
lab module, no transformers); the library never imports its lab, never reads the
repository it was built from, and has no import cycle; no module is named like a module of
the standard library (such as ``inspect``); no module is over 700 lines."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kernels" / "normbook"


def _modules():
    """{dotted name: path} of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module of the package that ``name`` imports, at its top or in a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = node.module or ""
            if node.level:
                module = f"{base}.{module}" if module else base
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}
    modules = _modules()
    return {m for m in found if m in modules and m != name}


def test_import_loads_the_library_only():
    code = (
        "import sys, normbook; "
        "print(sorted(m for m in sys.modules if m.startswith('normbook.lab') "
        "or m.split('.')[0] in ('transformers', 'kernels')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_library_imports_nothing_of_the_lab_and_reads_no_file():
    for name, path in _modules().items():
        if name.startswith("normbook.lab"):
            continue
        lab = {m for m in _imports(name, path) if m.startswith("normbook.lab")}
        assert not lab, f"{name} imports {lab}"
        assert "__file__" not in path.read_text(), f"{name} reads its own checkout"


def test_no_import_cycle():
    graph = {name: _imports(name, path) for name, path in _modules().items()}
    # A package imports its own submodules by design (__init__ exports them), so the
    # edges from a package to its children are not cycles of concern; every other edge
    # counts, function-level imports too.
    edges = {
        n: {m for m in ms if not (m.startswith(n + ".") and _is_package(n))}
        for n, ms in graph.items()
    }
    state: dict = {}

    def visit(n, stack):
        state[n] = "open"
        for m in edges.get(n, ()):
            if state.get(m) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack + [n, m]))
            if m not in state:
                visit(m, stack + [n])
        state[n] = "done"

    for n in edges:
        if n not in state:
            visit(n, [])


def _is_package(name: str) -> bool:
    return _modules()[name].name == "__init__.py"


def test_module_names_and_sizes():
    for name, path in _modules().items():
        leaf = name.rpartition(".")[2]
        assert leaf not in sys.stdlib_module_names, f"{name} is named like the stdlib's"
        lines = len(path.read_text().splitlines())
        assert lines <= 700, f"{name}: {lines} lines"
