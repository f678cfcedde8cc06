"""Write the canonical set-up cell into every chapter notebook (and check it with --check).

The repository URL lives once, in _config.yml; each chapter's first code cell (tagged "setup",
removed from the HTML) is generated from it, so that a chapter opened alone in Colab can install
this project. Run after changing the URL or the template; tests run it with --check.
"""

import json
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
TAGS = ["setup", "remove-input"]


def setup_source() -> str:
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    url = cfg["repository"]["url"].rstrip("/")
    return (
        "# Set-up. In Colab: install this book's `kernels` package from its repository.\n"
        "# Everywhere: pick the device (a CUDA GPU, else Triton's interpreter on the CPU) and a dtype it supports.\n"
        "import sys\n"
        "if \"google.colab\" in sys.modules:\n"
        f"    %pip install -q \"llm-norm-kernels[book] @ git+{url}\"\n"
        "from kernels.notebook import setup\n"
        "DEVICE, DTYPE = setup()"
    )


def chapters():
    return sorted((ROOT / "book").glob("*.ipynb"))


FIRST_LINE = "# Set-up. In Colab"


def setup_indices(nb) -> list[int]:
    """Cells that are (or were) the set-up cell: tagged "setup", or starting with its first line
    (a jupytext round trip can drop the tag and comment out the indented %pip line)."""
    return [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and (
        "setup" in c.get("metadata", {}).get("tags", []) or "".join(c["source"]).startswith(FIRST_LINE))]


def sync(path: pathlib.Path, check: bool) -> bool:
    nb = json.loads(path.read_text())
    want = setup_source()
    found = setup_indices(nb)
    i = found[0] if found else None
    ok = len(found) == 1 and "".join(nb["cells"][i]["source"]) == want \
        and nb["cells"][i]["metadata"].get("tags") == TAGS
    if ok:
        return True
    if check:
        return False
    for j in reversed(found[1:]):  # stale copies
        del nb["cells"][j]
    cell = {"cell_type": "code", "execution_count": None, "id": "setup", "metadata": {"tags": TAGS},
            "outputs": [], "source": want.splitlines(keepends=True)}
    if i is None:
        first_md = next((j for j, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"), -1)
        nb["cells"].insert(first_md + 1, cell)
    else:
        nb["cells"][i] = cell
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return True


if __name__ == "__main__":
    check = "--check" in sys.argv
    bad = [p.name for p in chapters() if not sync(p, check)]
    if bad:
        print("set-up cell out of date in:", ", ".join(bad), "(run python tools/sync_setup_cells.py)")
        sys.exit(1)
