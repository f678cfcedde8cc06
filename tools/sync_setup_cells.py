"""Write the canonical set-up cell into every chapter notebook (and check it with --check).

The repository URL lives once, in _config.yml; each chapter's first code cell (tagged "setup",
removed from the HTML) is generated from it, so that a chapter opened alone in Colab can install
this project. Run after changing the URL or the template; tests run it with --check.
"""

import json
import pathlib
import re
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Removed from the site: its one printed line ("Kernels run on ...") would open every page;
# the intro says once where the book's kernels ran. Notebooks (Colab, Jupyter) still show it.
TAGS = ["setup", "remove-cell"]


def book_modules() -> list[str]:
    """What a chapter imports beyond the standard library: ``normbook`` and the ``book`` extra of
    pyproject.toml (distribution names that are also the module names)."""
    text = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^book\s*=\s*\[(.*?)\]", text, re.M | re.S).group(1)
    names = [
        re.match(r"[A-Za-z0-9_.-]+", d).group(0)
        for d in re.findall(r'"([^"]+)"', extra)
    ]
    return ["normbook"] + [n.lower().replace("-", "_") for n in names]


def pip_target() -> str:
    """The install line for this repository at the configured branch (pinned, not the default)."""
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    url = cfg["repository"]["url"].rstrip("/")
    branch = cfg["repository"].get("branch", "main")
    return f"normbook[book] @ git+{url}@{branch}"


# The cell runs before `normbook` can be imported, so its checks live here, not in kernels/.
# It stays within 88 columns, like every chapter cell.
TEMPLATE = """\
# Set-up. In Colab it installs this book's `normbook` package. Anywhere, it checks that
# what the chapter imports is installed, else stops with the command that installs it.
# Then it picks the device (a CUDA GPU, else Triton's interpreter) and a dtype.
import importlib.util, subprocess, sys
_PIP = ("{pip_a}"
        "{pip_b}")
_NEEDS = {needs}
def _missing():
    importlib.invalidate_caches()
    return [m for m in _NEEDS if importlib.util.find_spec(m) is None]
if "google.colab" in sys.modules and _missing():
    _run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", _PIP],
                          capture_output=True, text=True)
    if _run.returncode != 0:
        raise RuntimeError(
            f"Installing this book's packages failed (pip said, last lines):\\n"
            f"{{_run.stderr[-2000:]}}\\nFix the cause above, then run in a cell:\\n"
            f'  %pip install "{{_PIP}}"\\nand run this cell again.')
if _missing():
    raise ModuleNotFoundError(
        f"This chapter needs {{', '.join(_missing())}}, not installed. Install with\\n"
        f'  Colab or Jupyter (in a cell):  %pip install "{{_PIP}}"\\n'
        "  a clone of the repository:    pip install -e '.[book]'\\n"
        "(no GPU? first the small CPU torch: pip install torch --index-url "
        "https://download.pytorch.org/whl/cpu)\\n"
        "then restart the kernel and run this cell again.")
from normbook.lab.notebook import setup
DEVICE, DTYPE = setup()"""


def setup_source() -> str:
    pip = pip_target()
    cut = pip.index("git+") + len(
        "git+"
    )  # two string pieces keep the cell within 88 columns
    return TEMPLATE.format(
        pip_a=pip[:cut], pip_b=pip[cut:], needs=json.dumps(book_modules())
    )


def chapters():
    return sorted((ROOT / "book").glob("*.ipynb"))


FIRST_LINE = "# Set-up."  # also matches the older cells ("# Set-up. In Colab: ...")


def setup_indices(nb) -> list[int]:
    """Cells that are (or were) the set-up cell: tagged "setup", or starting with its first line
    (a jupytext round trip can drop the tag and comment out the indented %pip line)."""
    return [
        i
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code"
        and (
            "setup" in c.get("metadata", {}).get("tags", [])
            or "".join(c["source"]).startswith(FIRST_LINE)
        )
    ]


def sync(path: pathlib.Path, check: bool) -> bool:
    nb = json.loads(path.read_text())
    want = setup_source()
    found = setup_indices(nb)
    i = found[0] if found else None
    ok = (
        len(found) == 1
        and "".join(nb["cells"][i]["source"]) == want
        and nb["cells"][i]["metadata"].get("tags") == TAGS
    )
    if ok:
        return True
    if check:
        return False
    for j in reversed(found[1:]):  # stale copies
        del nb["cells"][j]
    cell = {
        "cell_type": "code",
        "execution_count": None,
        "id": "setup",
        "metadata": {"tags": TAGS},
        "outputs": [],
        "source": want.splitlines(keepends=True),
    }
    if i is None:
        first_md = next(
            (j for j, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"), -1
        )
        nb["cells"].insert(first_md + 1, cell)
    else:
        cell["id"] = nb["cells"][i].get(
            "id", "setup"
        )  # keep the id: smaller diffs, fewer conflicts
        nb["cells"][i] = cell
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return True


if __name__ == "__main__":
    check = "--check" in sys.argv
    bad = [p.name for p in chapters() if not sync(p, check)]
    if bad:
        print(
            "set-up cell out of date in:",
            ", ".join(bad),
            "(run python tools/sync_setup_cells.py)",
        )
        sys.exit(1)
