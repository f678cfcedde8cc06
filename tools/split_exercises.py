"""Turn a chapter's exercises into executed form (one-off migration tool).

Each ``{solution}`` directive whose body holds ```python blocks becomes sphinx-exercise's gated
form, so that the solution's code runs when the book is built and when the chapter is tested:

    [markdown] the exercise directive, as it was
    [markdown] ```{solution-start} <label>  :class: dropdown  + the solution's prose before the code
    [code]     each ```python block, as a code cell
    [markdown] prose after the code (if any) + ```{solution-end}

Usage: python tools/split_exercises.py book/<chapter>.ipynb   (rewrites it in place)
The code cells then need asserts that check the answer: the tool only moves text.
"""

import json
import re
import sys

OPEN = re.compile(r"^(`{3,}|:{3,})\{(exercise|solution)\}\s*(.*)$")


def _blocks(text):
    """Split markdown into ('text'|'exercise'|'solution', lines, header) blocks."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if not m:
            out.append(("text", [lines[i]], None))
            i += 1
            continue
        fence, kind = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != fence:
            j += 1
        out.append((kind, lines[i + 1 : j], m.group(3)))
        i = j + 1
    return out


def _cell(kind, source):
    c = {
        "cell_type": kind,
        "metadata": {},
        "source": source.strip("\n").splitlines(keepends=True),
    }
    if kind == "code":
        c.update(execution_count=None, outputs=[])
    return c


def _solution_cells(body, label):
    options = [l for l in body if re.match(r"^:[\w-]+:", l)]
    rest = [l for l in body if l not in options]
    if not any(o.startswith(":class:") for o in options):
        options.append(":class: dropdown")
    cells, prose, code, in_code = [], [], [], False
    head = "```{solution-start} " + label + "\n" + "\n".join(options) + "\n```\n"
    pending = head
    for line in rest:
        if not in_code and line.strip().startswith("```python"):
            in_code, code = True, []
            if prose or pending:
                cells.append(_cell("markdown", pending + "\n".join(prose)))
                pending, prose = "", []
            continue
        if in_code and line.strip() == "```":
            in_code = False
            cells.append(_cell("code", "\n".join(code)))
            continue
        (code if in_code else prose).append(line)
    cells.append(
        _cell(
            "markdown",
            pending + "\n".join(prose).strip("\n") + "\n\n```{solution-end}\n```",
        )
    )
    return cells


def split(path):
    nb = json.load(open(path))
    new = []
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or "{solution}" not in src:
            new.append(cell)
            continue
        text = []
        for kind, lines, header in _blocks(src):
            if kind == "text":
                text.extend(lines)
                continue
            if text and "".join(text).strip():
                new.append(_cell("markdown", "\n".join(text)))
            text = []
            if kind == "exercise":
                new.append(
                    _cell(
                        "markdown",
                        "```{exercise} " + header + "\n" + "\n".join(lines) + "\n```",
                    )
                )
            else:
                new.extend(_solution_cells(lines, header.strip()))
        if text and "".join(text).strip():
            new.append(_cell("markdown", "\n".join(text)))
    nb["cells"] = new
    with open(path, "w") as f:
        f.write(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        split(p)
