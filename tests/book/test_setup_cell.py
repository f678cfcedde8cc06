"""The chapters' set-up cell, run as a reader runs it: by a Jupyter kernel (nbclient), in a folder
outside the repository. A missing package or a failed install stops the cell with one clear error
that names the command to run; with everything installed it picks the device and says so.

A missing package is simulated without a second environment: ``sys.modules[name] = None`` makes
``importlib.util.find_spec`` (and ``import``) report it missing; a failing pip is simulated by
pointing ``sys.executable`` at ``false``.
"""

import pathlib
import shutil
import sys

import chapters
import pytest
import sync_setup_cells
import yaml
from book_build import ROOT, require

require(("nbformat", "nbclient", "ipykernel"))
import nbformat  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

pytestmark = pytest.mark.slow  # a Jupyter kernel per test: left out of --quick

CFG = yaml.safe_load((ROOT / "_config.yml").read_text())
PIP = f"normbook[book] @ git+{CFG['repository']['url'].rstrip('/')}@{CFG['repository']['branch']}"


def run_setup(tmp_path, before: str = ""):
    """Execute [before, set-up cell] in a kernel started in tmp_path; return the set-up cell."""
    assert not tmp_path.resolve().is_relative_to(ROOT)
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(before or "pass"),
        nbformat.v4.new_code_cell(sync_setup_cells.setup_source()),
    ]
    NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    assert not [o for o in nb.cells[0].outputs if o.output_type == "error"]
    return nb.cells[1]


def error_of(cell):
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert len(errors) == 1, f"expected one error, got outputs {cell.outputs}"
    return errors[0]


def test_every_chapter_carries_the_generated_cell():
    want = sync_setup_cells.setup_source()
    for path in chapters.notebooks():
        nb = nbformat.read(path, as_version=4)
        assert sum(want == c.source for c in nb.cells) == 1, (
            f"{path.name}: run tools/sync_setup_cells.py"
        )


def test_the_website_shows_neither_the_cell_nor_its_line():
    """The line the cell prints (where the kernels run) is the same on every page: the
    introduction says it once, and the set-up cell is removed from the website whole.
    Jupyter and Colab, which ignore the tag, still show both."""
    assert sync_setup_cells.TAGS == ["setup", "remove-cell"]
    for path in chapters.notebooks():
        nb = nbformat.read(path, as_version=4)
        (cell,) = [c for c in nb.cells if "setup" in c.metadata.get("tags", [])]
        assert cell.metadata.tags == ["setup", "remove-cell"], path.name


def test_setup_cell_fits_88_columns_and_pins_the_configured_branch():
    src = sync_setup_cells.setup_source()
    assert max(len(line) for line in src.splitlines()) <= 88
    assert PIP.split(" @ ")[1] in src.replace('"\n        "', "")


def test_setup_cell_runs_outside_the_repository(tmp_path):
    cell = run_setup(tmp_path)
    assert not [o for o in cell.outputs if o.output_type == "error"], cell.outputs
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    assert "Kernels run on" in text
    assert not [o for o in cell.outputs if o.get("name") == "stderr"], cell.outputs


@pytest.mark.parametrize("missing", [["normbook"], ["matplotlib", "plotly"]])
def test_missing_package_names_the_commands(tmp_path, missing):
    block = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in missing)
    err = error_of(run_setup(tmp_path, block))
    assert err.ename == "ModuleNotFoundError"
    msg = err.evalue
    assert f"needs {', '.join(missing)}," in msg
    assert (
        f'%pip install "{PIP}"' in msg
    )  # Colab or any Jupyter, this repository at its branch
    assert "pip install -e '.[book]'" in msg  # a clone
    assert "download.pytorch.org/whl/cpu" in msg  # the small CPU torch first
    assert "restart the kernel" in msg


@pytest.mark.skipif(shutil.which("false") is None, reason="needs the `false` command")
def test_failed_install_in_colab_is_reported_as_such(tmp_path):
    fake_colab = (
        "import sys, types, shutil\n"
        "sys.modules['google'] = types.ModuleType('google')\n"
        "sys.modules['google.colab'] = types.ModuleType('google.colab')\n"
        "sys.modules['normbook'] = None\n"
        "_real_executable, sys.executable = sys.executable, shutil.which('false')\n"
    )
    err = error_of(run_setup(tmp_path, fake_colab))
    assert err.ename == "RuntimeError"
    assert "Installing this book's packages failed" in err.evalue
    assert f'%pip install "{PIP}"' in err.evalue
    # not the bare ImportError, which names no command
    assert "No module named 'normbook'" not in err.evalue


def test_missing_book_extra_is_listed_from_pyproject():
    assert sync_setup_cells.book_modules()[:1] == ["normbook"]
    assert {"sympy", "matplotlib", "transformers", "plotly"} <= set(
        sync_setup_cells.book_modules()
    )


def test_the_wheel_holds_every_package():
    """A Colab reader gets the package from a wheel built from pyproject.toml: a subpackage
    missing there is missing in Colab only. The wheel holds
    every package under kernels/ and nothing else at the top level than ``normbook`` (no
    ``kernels``, the name of Hugging Face's package)."""
    import subprocess
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                out,
                str(ROOT),
            ],
            check=True,
            capture_output=True,
        )
        (wheel,) = pathlib.Path(out).glob("*.whl")
        names = zipfile.ZipFile(wheel).namelist()
    packages = {
        ".".join(pathlib.PurePath(n).parent.parts)
        for n in names
        if n.endswith("/__init__.py")
    }
    present = {
        ".".join(p.parent.relative_to(ROOT / "kernels").parts)
        for p in (ROOT / "kernels").rglob("__init__.py")
    }
    assert packages == present, (
        f"the wheel's packages {sorted(packages)} != {sorted(present)}"
    )
    tops = {pathlib.PurePath(n).parts[0] for n in names if ".dist-info" not in n}
    assert tops == {"normbook"}, tops
