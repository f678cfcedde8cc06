"""The Colab edition: every chapter of _toc.yml as a plain-Jupyter-Markdown notebook.

Colab (and plain Jupyter) render CommonMark, not MyST. This module rewrites each chapter's markdown:

- glued values (``{glue:text}`key:fmt```, ``{glue}`key```) are written in, taken from the executed
  notebook of the build (``--executed DIR``: its glue outputs, or myst-nb's ``<chapter>.glue.json``
  beside it); a note at the top says so and names the run;
- ``{doc}`` and ``{ref}`` become absolute links to the published book, ``{cite}`` becomes
  "Author (year)" linking to the bibliography page, ``{eq}``/``{numref}``/other roles plain text;
- ``exercise`` blocks become headings ("Exercise N: title"); ``solution`` blocks fold into
  ``<details>``; gated solutions (``solution-start`` … ``solution-end``) get a "Solution" heading,
  their text folded into ``<details>`` and their code cells, which still run, hidden until opened
  (Colab's form view, Jupyter's ``source_hidden``);
- admonitions (note, warning, …) become block quotes; math is kept as it is.

Two users: ``tools/colab_edition.py`` (the command line, which the pages workflow runs:
``python tools/colab_edition.py --executed _build/jupyter_execute --out _build/colab``, published to
the ``colab`` branch that the book's Colab button opens), and ``_ext/book_pages.py``, which writes
each chapter's Colab edition as the file of the page's download button. The result mirrors the
book's paths (``book/rms_norm.ipynb``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import pathlib
import re
import sys

import yaml

# The repository (this file is _ext/colab_edition.py); a build passes its own source folder.
ROOT = pathlib.Path(__file__).resolve().parents[1]

ADMONITIONS = {
    "note",
    "warning",
    "tip",
    "important",
    "caution",
    "attention",
    "danger",
    "error",
    "hint",
    "seealso",
    "admonition",
    "margin",
    "sidebar",
    "topic",
}
FENCE = re.compile(r"^(\s*)(`{3,}|:{3,})\{([\w:.-]+)\}\s*(.*)$")
CODE_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
ROLE = re.compile(r"\{([\w:.-]+)\}`([^`]*)`")
TARGET = re.compile(r"^\(([\w:.-]+)\)=\s*$")
# Where a gated solution starts and ends in a converted cell (convert() folds what lies between).
SOLUTION_START = "<!-- solution-start "
SOLUTION_END = "<!-- solution-end -->"
SOLUTION_MARK = re.compile(r"<!-- solution-start (\d*) -->|<!-- solution-end -->")


# ------------------------------------------------------------------ configuration and inputs
def config(root: pathlib.Path = ROOT) -> dict:
    return yaml.safe_load((root / "_config.yml").read_text())


def book_url(cfg: dict) -> str:
    """The published book: html.baseurl if set, else the repository's GitHub Pages address."""
    base = (cfg.get("html") or {}).get("baseurl") or ""
    if not base:
        owner, repo = cfg["repository"]["url"].rstrip("/").split("/")[-2:]
        base = f"https://{owner}.github.io/{repo}/"
    return base.rstrip("/") + "/"


def toc_files(root: pathlib.Path = ROOT) -> list[str]:
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", [{"chapters": toc.get("chapters", [])}]):
        files.extend(entry["file"] for entry in part.get("chapters", []))
    return files


def bibliography(root: pathlib.Path = ROOT) -> dict[str, str]:
    """BibTeX key -> "Author (year)" (first author's surname; "et al." beyond two)."""
    path = root / "references.bib"
    text = path.read_text() if path.exists() else ""
    out = {}
    for m in re.finditer(r"@\w+\s*\{\s*([^,\s]+)\s*,(.*?)\n\}", text, re.S):
        key, body = m.group(1), m.group(2)

        def field(name, body=body):
            f = re.search(
                rf"\b{name}\s*=\s*[{{\"](.*?)[}}\"]\s*,?\s*$", body, re.M | re.I | re.S
            )
            return f.group(1) if f else ""

        authors = [
            a.strip() for a in re.split(r"\s+and\s+", field("author")) if a.strip()
        ]
        names = [
            (a.split(",")[0] if "," in a else a.split()[-1]).strip("{} ")
            for a in authors
        ]
        who = (
            names[0]
            if len(names) == 1
            else (
                f"{names[0]} and {names[1]}"
                if len(names) == 2
                else f"{names[0]} et al."
            )
            if names
            else key
        )
        year = re.sub(r"\D", "", field("year"))[:4]
        out[key] = f"{who} ({year})" if year else who
    return out


def page_titles_and_labels(
    files: list[str], root: pathlib.Path = ROOT
) -> tuple[dict, dict]:
    """Each page's title (first '# ' heading) and each label -> (page, text, anchor)."""
    titles, labels = {}, {}
    for f in files:
        path = next(
            (
                root / f"{f}{s}"
                for s in (".ipynb", ".md")
                if (root / f"{f}{s}").exists()
            ),
            None,
        )
        if path is None:
            continue
        if path.suffix == ".ipynb":
            cells = json.loads(path.read_text())["cells"]
            md = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
        else:
            md = [path.read_text()]
        text = "\n".join(md)
        t = re.search(r"^# (.+)$", text, re.M)
        titles[f] = t.group(1).strip() if t else f.split("/")[-1]
        lines = text.splitlines()
        n_ex = 0
        for i, line in enumerate(lines):
            m = TARGET.match(line.strip())
            if m:  # (label)= before a heading
                nxt = next((ln for ln in lines[i + 1 :] if ln.strip()), "")
                labels[m.group(1)] = (f, nxt.lstrip("#").strip(), _anchor(m.group(1)))
            fm = FENCE.match(line)
            if fm and fm.group(3) == "exercise":
                n_ex += 1
                for opt in lines[i + 1 : i + 6]:
                    om = re.match(r"\s*:label:\s*(\S+)", opt)
                    if om:
                        labels[om.group(1)] = (f, f"Exercise {n_ex}", om.group(1))
    return titles, labels


def _anchor(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def glue_values(executed: pathlib.Path | None) -> dict[str, str]:
    """key -> text/plain of every value glued in an executed chapter, from both places a build
    keeps them: the notebook's own glue outputs (an executed copy made by nbclient: the key is
    ``application/papermill.record/text/plain`` for ``glue(..., display=False)``), and the
    ``<chapter>.glue.json`` beside it, where myst-nb moves them when it executes the chapter
    itself (``make book``: ``_build/jupyter_execute/``, key ``text/plain``; the notebook there
    has lost the display=False outputs)."""
    values: dict[str, str] = {}
    if executed is None:
        return values

    def plain(v):
        return "".join(v) if isinstance(v, list) else v

    if executed.exists():
        for cell in json.loads(executed.read_text())["cells"]:
            for out in cell.get("outputs", []):
                sb = out.get("metadata", {}).get("scrapbook")
                # glue(..., display=False) stores its data under a prefix
                key = (sb or {}).get("mime_prefix", "") + "text/plain"
                if sb and key in out.get("data", {}):
                    values[sb["name"]] = plain(out["data"][key])
    store = executed.with_name(executed.stem + ".glue.json")
    if store.exists():
        for name, out in json.loads(store.read_text()).items():
            data = out.get("data", {})
            sb = out.get("metadata", {}).get("scrapbook") or {}
            for key in ("text/plain", sb.get("mime_prefix", "") + "text/plain"):
                if key in data:
                    values[name] = plain(data[key])
                    break
    return values


def format_plain_text(text: str, fmt: str) -> str:
    """As myst-nb formats ``{glue:text}`key:fmt``` (myst_nb.core.variables.format_plain_text)."""
    try:
        value = ast.literal_eval(text)
    except (SyntaxError, ValueError):
        value = text
    if fmt == "":
        return str(value)
    kind = fmt[-1]
    if kind == "s":
        value = str(value)
    elif kind in "bcdoxX":
        value = int(value)
    elif kind in "eEfFgGn%":
        value = float(value)
    return f"{value:{fmt}}"


# ------------------------------------------------------------------ the rewrite
class Unresolved(Exception):
    pass


class Converter:
    def __init__(
        self,
        page: str,
        glue: dict,
        titles: dict,
        labels: dict,
        bib: dict,
        base: str,
        allow_missing: bool = False,
    ):
        self.page, self.glue, self.titles, self.labels = page, glue, titles, labels
        self.bib, self.base, self.allow_missing = bib, base, allow_missing
        self.exercises: dict[str, int] = {}
        self.missing: list[str] = []

    # roles -------------------------------------------------------------
    def role(self, m: re.Match) -> str:
        name, content = m.group(1), m.group(2)
        title, target = self._split_title(content)
        if name.startswith("glue"):
            key, _, fmt = target.rpartition(":") if ":" in target else (target, "", "")
            key = key or target
            if key not in self.glue:
                self.missing.append(key)
                if not self.allow_missing:
                    raise Unresolved(f"{self.page}: no glued value for {key!r}")
                return f"*(the value `{key}` is printed when you run the cells)*"
            return (
                format_plain_text(self.glue[key], fmt)
                if name in ("glue:text", "glue:") or fmt
                else format_plain_text(self.glue[key], "")
            )
        if name == "doc":
            here = self.page.rsplit("/", 1)[0] if "/" in self.page else ""
            path = (
                target.lstrip("/")
                if target.startswith("/")
                else str(pathlib.PurePosixPath(here, target))
                if here
                else target
            )
            path = path.removesuffix(".md").removesuffix(".ipynb")
            text = title or self.titles.get(path, path.split("/")[-1])
            return f"[{text}]({self.base}{path}.html)"
        if name in ("ref", "numref"):
            page, text, anchor = self.labels.get(
                target, (None, target, _anchor(target))
            )
            if page is None:
                return title or target
            return f"[{title or text}]({self.base}{page}.html#{anchor})"
        if name.startswith("cite"):
            keys = [k.strip() for k in target.split(",") if k.strip()]
            refs = [self.bib.get(k, k) for k in keys]
            link = f"{self.base}book/bibliography.html"
            if name == "cite:p":
                return (
                    "("
                    + "; ".join(
                        f"[{r.replace(' (', ' ').rstrip(')')}]({link})" for r in refs
                    )
                    + ")"
                )
            return "; ".join(f"[{r}]({link})" for r in refs)
        if name == "math":
            return f"${content}$"
        if name in ("sub", "sup"):
            return f"<{name}>{content}</{name}>"
        if name == "eq":
            return f"({content})"
        return title or target  # term, abbr, kbd, …: their text

    @staticmethod
    def _split_title(content: str) -> tuple[str, str]:
        m = re.match(r"^(.*?)\s*<([^<>]+)>$", content, re.S)
        return (m.group(1).strip(), m.group(2).strip()) if m else ("", content.strip())

    def roles(self, text: str) -> str:
        return ROLE.sub(self.role, text)

    # directives --------------------------------------------------------
    def markdown(self, text: str) -> str:
        lines, out, i = text.splitlines(), [], 0
        while i < len(lines):
            line = lines[i]
            if TARGET.match(line.strip()) or re.match(
                r"^\s*%", line
            ):  # targets, MyST comments
                i += 1
                continue
            d = FENCE.match(line)
            c = CODE_FENCE.match(line) if not d else None
            if d:
                indent, fence, name, arg = d.groups()
                body, i = self._block(lines, i + 1, fence)
                out.extend(self.directive(name, arg.strip(), body).splitlines())
                continue
            if c:  # a plain code block: copied as it is
                body, i = self._block(lines, i + 1, c.group(2))
                out.extend([line, *body, c.group(1) + c.group(2)])
                continue
            out.append(self.roles(line))
            i += 1
        return "\n".join(out)

    @staticmethod
    def _block(lines, i, fence):
        body = []
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        while i < len(lines) and not closing.match(lines[i]):
            body.append(lines[i])
            i += 1
        return body, i + 1

    @staticmethod
    def _options(body):
        opts = {}
        while body and re.match(r"^\s*:[\w-]+:", body[0]):
            k, _, v = body.pop(0).strip()[1:].partition(":")
            opts[k] = v.strip()
        if body and body[0].strip() == "---":  # YAML options block
            end = body.index("---", 1) if "---" in body[1:] else 0
            opts.update(yaml.safe_load("\n".join(body[1:end])) or {})
            del body[: end + 1]
        return opts

    def directive(self, name: str, arg: str, body: list[str]) -> str:
        body = list(body)
        opts = self._options(body)
        inner = self.markdown("\n".join(body)).strip()
        if name == "exercise":
            n = len(self.exercises) + 1
            if "label" in opts:
                self.exercises[opts["label"]] = n
            title = self.roles(arg)
            return (
                f"### Exercise {n}" + (f": {title}" if title else "") + f"\n\n{inner}"
            )
        if name == "solution":
            n = self.exercises.get(arg)
            head = f"Solution to exercise {n}" if n else "Solution"
            return f"<details>\n<summary>{head} (click to open)</summary>\n\n{inner}\n\n</details>"
        if name == "solution-start":  # convert() folds what follows, up to solution-end
            mark = f"{SOLUTION_START}{self.exercises.get(arg) or ''} -->"
            return mark + (f"\n\n{inner}" if inner else "")
        if name == "solution-end":
            return (f"{inner}\n\n" if inner else "") + SOLUTION_END
        if name in ADMONITIONS or name.startswith("admonition"):
            title = self.roles(arg) or name.capitalize()
            quoted = "\n".join("> " + ln if ln else ">" for ln in inner.splitlines())
            return f"> **{title}**\n>\n{quoted}"
        if name in ("math",):
            return f"$$\n{inner}\n$$"
        if name in ("figure", "image"):
            alt = opts.get("alt", "")
            return f"![{alt}]({arg})" + (f"\n\n{inner}" if inner else "")
        if name == "code-block" or name == "code":
            return f"```{arg}\n" + "\n".join(body) + "\n```"
        # any other directive: its title in bold, then its body
        return (f"**{self.roles(arg)}**\n\n" if arg else "") + inner


def _fold(text: str, n: str, part: int) -> str:
    head = f"Solution to exercise {n}" if n else "Solution"
    head += ", continued" if part else ""
    return (
        f"<details>\n<summary>{head} (click to open)</summary>\n\n{text}\n\n</details>"
    )


def _solution_heading(n: str) -> str:
    head = f"Solution to exercise {n}" if n else "Solution"
    return (
        f"#### {head}\n\nTry the exercise first. The solution's text is folded below "
        "(*click to open*), its code cells are hidden: open them to read, run them to check."
    )


def _folded_title(cell: dict, src: str) -> str | None:
    """The title of a code cell that the site folds or removes (tools/tidy_cells.py's
    convention), folded in Colab too; None for a cell shown as it is."""
    tags = set(cell.get("metadata", {}).get("tags", []))
    if "setup" in tags:
        return None
    if "remove-cell" in tags:
        return "Numbers for the text (open to read, run as it is)"
    if tags & {"hide-input", "hide-cell"}:
        first = src.lstrip().split("\n", 1)[0]
        what = (
            first.lstrip("# ").rstrip(".:") if first.startswith("#") else "Helper code"
        )
        return f"{what[:70]} (open to read)"
    return None


def convert(nb: dict, page: str, conv: Converter, note: str) -> dict:
    """The chapter as plain Jupyter: markdown converted, outputs cleared, and every gated
    solution (solution-start … solution-end) folded: its text in ``<details>`` (a fold cannot
    span cells, so each of its markdown pieces gets one), its code cells hidden (Colab's form
    view with a title, Jupyter's ``source_hidden``), still there to run. Cells left empty by the
    conversion (a cell holding only ``solution-end``) are dropped."""
    out = copy.deepcopy(nb)
    cells = []
    solution: str | None = None  # the exercise number while inside a gated solution
    part = 0  # folded pieces of the current solution so far
    for cell in out["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            pieces, at = [], 0
            text = conv.markdown(src)
            for m in [*SOLUTION_MARK.finditer(text), None]:
                chunk = text[at : m.start() if m else len(text)].strip()
                if chunk and solution is not None:
                    pieces.append(_fold(chunk, solution, part))
                    part += 1
                elif chunk:
                    pieces.append(chunk)
                if m is None:
                    break
                at = m.end()
                if m.group(0) == SOLUTION_END:
                    solution = None
                else:
                    solution, part = m.group(1), 0
                    pieces.append(_solution_heading(solution))
            cell["source"] = "\n\n".join(pieces)
            if not cell["source"].strip():
                continue
        else:
            cell["outputs"], cell["execution_count"] = [], None
            if solution is not None and cell["cell_type"] == "code":
                head = f"Solution to exercise {solution}" if solution else "Solution"
                cell["source"] = (
                    f"# @title {head}: code (open to read, run to check)\n" + src
                )
                cell["metadata"].setdefault("jupyter", {})["source_hidden"] = True
                cell["metadata"]["cellView"] = (
                    "form"  # Colab: the title shows, the code folds
                )
            elif cell["cell_type"] == "code" and (title := _folded_title(cell, src)):
                cell["source"] = f"# @title {title}\n" + src
                cell["metadata"].setdefault("jupyter", {})["source_hidden"] = True
                cell["metadata"]["cellView"] = "form"
        cells.append(cell)
    # the note goes right after the title cell
    title_at = next(
        (i for i, c in enumerate(cells) if c["cell_type"] == "markdown"), -1
    )
    cells.insert(
        title_at + 1,
        {
            "cell_type": "markdown",
            "id": "colab-edition-note",
            "metadata": {},
            "source": note,
        },
    )
    for c in cells:
        if isinstance(c["source"], str):
            c["source"] = c["source"].splitlines(keepends=True)
    out["cells"] = cells
    out["metadata"].setdefault("colab", {})["provenance"] = []
    return out


def run_note(executed: dict | None) -> str:
    """Where the numbers in the text came from: the set-up cell's line of the build's run."""
    if not executed:
        return "an earlier run"
    for cell in executed["cells"]:
        if "setup" in cell.get("metadata", {}).get("tags", []):
            text = "".join(
                "".join(o.get("text", ""))
                for o in cell.get("outputs", [])
                if o.get("output_type") == "stream"
            )
            if text.strip():
                return (
                    "the run that built the website (" + text.strip().rstrip(".") + ")"
                )
    return "the run that built the website"


def build(
    out_dir: pathlib.Path,
    executed_dir: pathlib.Path | None,
    allow_missing: bool = False,
    only: list[str] | None = None,
    root: pathlib.Path = ROOT,
) -> list[pathlib.Path]:
    """Write the Colab edition of every chapter of ``root``'s _toc.yml (or those named in
    ``only``) under ``out_dir``, glued values taken from ``executed_dir``."""
    cfg = config(root)
    base = book_url(cfg)
    files = toc_files(root)
    titles, labels = page_titles_and_labels(files, root)
    bib = bibliography(root)
    written = []
    for f in files:
        src = root / f"{f}.ipynb"
        if not src.exists() or (only and pathlib.PurePath(f).name not in only):
            continue
        ex_path = executed_dir / f"{f}.ipynb" if executed_dir else None
        executed = (
            json.loads(ex_path.read_text()) if ex_path and ex_path.exists() else None
        )
        glue = glue_values(ex_path)
        conv = Converter(f, glue, titles, labels, bib, base, allow_missing)
        note = (
            f"> **Colab edition** of [{titles.get(f, f)}]({base}{f}.html), generated from "
            f"`{f}.ipynb` by `tools/colab_edition.py`. The numbers in the text were written in "
            f"from {run_note(executed)}; running the cells recomputes and prints them. Links go "
            "to the published book; exercises' solutions are folded: open them after trying."
        )
        nb = convert(json.loads(src.read_text()), f, conv, note)
        dest = out_dir / f"{f}.ipynb"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        written.append(dest)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--executed", type=pathlib.Path, help="folder of the build's executed notebooks"
    )
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument(
        "--allow-missing",
        action="store_true",
        help="write a pointer to the output instead of failing on a missing glued value",
    )
    args = ap.parse_args(argv)
    try:
        written = build(args.out, args.executed, args.allow_missing)
    except Unresolved as exc:
        print(
            f"error: {exc} (pass --executed with the build's executed notebooks)",
            file=sys.stderr,
        )
        return 1
    print(f"Colab edition: {len(written)} notebooks in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
