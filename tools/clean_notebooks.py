"""Strip outputs and execution counts from the chapter notebooks (they are stored clean).

Cell ids are derived from each cell's content (a jupytext round trip would otherwise give every
cell a fresh random id, and two edits of one chapter would then conflict on every cell). The
set-up cell keeps the id "setup".

Also sets the notebooks' jupytext options so that a round trip through a percent script
(`jupytext --to py:percent` ... `jupytext --to ipynb`) keeps cell tags such as "setup" and "hide-input".
"""

import hashlib
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def clean(nb: dict) -> dict:
    """The stored form of a notebook: no outputs, content-derived ids, the book's metadata."""
    # Colab and Jupyter Book pick the kernel from here; a jupytext round trip drops it.
    nb["metadata"]["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    nb["metadata"]["language_info"] = {"name": "python"}
    nb["metadata"]["jupytext"] = {
        "cell_metadata_filter": "tags,-all",
        "main_language": "python",
        "notebook_metadata_filter": "-all",
    }
    seen = set()
    for c in nb["cells"]:
        if c.get("id") != "setup":
            text = c["cell_type"] + "\n" + "".join(c["source"])
            digest = hashlib.sha1(text.encode()).hexdigest()
            i = 0
            while (
                cid := digest[i : i + 8]
            ) in seen:  # identical cells: take the next 8 hex digits
                i += 1
            c["id"] = cid
        seen.add(c.get("id"))
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
        c.get("metadata", {}).pop("execution", None)
    return nb


def dumps(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        path.write_text(dumps(clean(json.loads(path.read_text()))))
