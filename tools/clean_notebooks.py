"""Strip outputs and execution counts from the chapter notebooks (they are stored clean).

Also sets the notebooks' jupytext options so that a round trip through a percent script
(`jupytext --to py:percent` ... `jupytext --to ipynb`) keeps cell tags such as "setup" and "hide-input".
"""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

for path in sorted((ROOT / "book").glob("*.ipynb")):
    nb = json.loads(path.read_text())
    # Colab and Jupyter Book pick the kernel from here; a jupytext round trip drops it.
    nb["metadata"]["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb["metadata"]["language_info"] = {"name": "python"}
    nb["metadata"]["jupytext"] = {"cell_metadata_filter": "tags,-all", "main_language": "python",
                                  "notebook_metadata_filter": "-all"}
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
        c.get("metadata", {}).pop("execution", None)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
