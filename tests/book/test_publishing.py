"""Publishing: the GitHub Actions workflows pass actionlint, run the README's commands, and take
the repository from the workflow's context (tools/configure_repository.py); the pages workflow's
own steps, run on a real (tiny) Jupyter Book build, make the site and the Colab edition."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import page_checks
import pytest
import yaml
from book_build import ROOT

import configure_repository

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
ACTIONLINT = shutil.which("actionlint") or shutil.which(
    "actionlint", path=str(pathlib.Path(sys.executable).parent)
)


@pytest.mark.skipif(
    ACTIONLINT is None,
    reason="actionlint not installed (pip install -r requirements.txt)",
)
def test_workflows_pass_actionlint():
    assert WORKFLOWS
    proc = subprocess.run(
        [ACTIONLINT, *map(str, WORKFLOWS)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_test_workflow_runs_the_readme_command_on_push_and_pull_request():
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "test.yml").read_text())
    on = wf[True] if True in wf else wf["on"]  # YAML reads a bare `on` as True
    assert "push" in on and "pull_request" in on
    runs = [s.get("run", "") for job in wf["jobs"].values() for s in job["steps"]]
    assert "make test" in runs
    assert "make test" in (ROOT / "README.md").read_text()


def test_pages_workflow_builds_book_and_colab_edition_from_the_context():
    text = (ROOT / ".github" / "workflows" / "pages.yml").read_text()
    for needed in (
        "make book",
        "tools/colab_edition.py",
        "tools/configure_repository.py",
        "github.repository",
        "github.ref_name",
        "actions/deploy-pages",
        "actions/upload-pages-artifact",
    ):
        assert needed in text, needed


def test_configure_repository_rewrites_only_the_three_values():
    text = (ROOT / "_config.yml").read_text()
    out = configure_repository.configure(
        text, "https://github.com/me/book", "dev", "https://me.github.io/book"
    )
    cfg = yaml.safe_load(out)
    assert cfg["repository"]["url"] == "https://github.com/me/book"
    assert cfg["repository"]["branch"] == "dev"
    assert cfg["html"]["baseurl"] == "https://me.github.io/book/"
    before = yaml.safe_load(text)
    for key in before:
        if key not in ("repository", "html"):
            assert cfg[key] == before[key], key
    assert out.count("#") == text.count("#")  # comments kept


# ------------------------------------------------------------------ the workflow, run
# The pages workflow's own steps (read from pages.yml, not retyped), run in a miniature copy of
# the repository: the real Makefile, _config.yml, _ext/ and tools/, a _toc.yml of two tiny
# chapters that use what the book's chapters use (glue with and without display, a markdown
# table output, a printed table sent in two stream messages, a gated exercise solution, a
# citation, cross-references). `make book` there is a real Jupyter Book build (chapters
# executed by myst-nb, warnings are errors) in about a minute, where the whole book takes many.

PAGES_YML = ROOT / ".github" / "workflows" / "pages.yml"
CONTEXT = {  # what GitHub would put in the workflow's ${{ }} expressions
    "github.server_url": "https://github.com",
    "github.repository": "someone/tiny-book",
    "github.ref_name": "main",
    "github.sha": "0" * 40,
    "github.token": "not-a-token",
    "steps.pages.outputs.base_url": "https://someone.github.io/tiny-book",
}


def pages_steps() -> list[dict]:
    wf = yaml.safe_load(PAGES_YML.read_text())
    return [s for s in wf["jobs"]["build"]["steps"] if "run" in s]


def step(words: str) -> dict:
    """The one `run` step of pages.yml whose command contains ``words``."""
    found = [s for s in pages_steps() if words in s["run"]]
    assert len(found) == 1, f"pages.yml: {len(found)} steps run {words!r}"
    return found[0]


def expand(text: str) -> str:
    def value(m):
        assert m.group(1) in CONTEXT, (
            f"pages.yml uses ${{{{ {m.group(1)} }}}}: add it to CONTEXT"
        )
        return CONTEXT[m.group(1)]

    return re.sub(r"\$\{\{\s*([\w.]+)\s*\}\}", value, text)


def run_step(s: dict, cwd, path_env, **replace) -> subprocess.CompletedProcess:
    """A workflow step as the runner runs it: `bash -e` on its `run`, with its `env`."""
    script = expand(s["run"])
    for old, new in replace.items():
        assert old in script, old
        script = script.replace(old, new)
    env = {
        **os.environ,
        "PATH": path_env,
        **{k: expand(str(v)) for k, v in s.get("env", {}).items()},
    }
    env.pop("BOOK_TEST_DIR", None)
    return subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def md(text):
    return {"cell_type": "markdown", "metadata": {}, "source": text}


def code(text):
    return {
        "cell_type": "code",
        "metadata": {},
        "source": text,
        "outputs": [],
        "execution_count": None,
    }


TINY_TABLE = "| case | value |\n|---|---|\n| tiny | 0.125 |"
ALPHA = [
    md(
        "# Alpha\n\nA value glued without display, {glue:text}`alpha-x:.3f`, one with, "
        "{glue:text}`alpha-n`; the other chapter, {doc}`beta`; a citation {cite}`williams2009roofline`."
    ),
    code(
        "import time\n\nfrom IPython.display import Markdown, display\n\nfrom normbook.lab.notebook import glue\n\n"
        'glue("alpha-x", 0.125, display=False)\nglue("alpha-n", 7)\n'
        f"display(Markdown({TINY_TABLE!r}))\n"
        'print("first row of a printed table", flush=True)\n'
        "time.sleep(0.6)  # the kernel sends what follows as a second stream message\n"
        'print("second row of a printed table")'
    ),
    md(
        "## Exercises\n\n````{exercise} Double it\n:label: alpha-ex-1\nWhat is twice "
        "{glue:text}`alpha-x:.3f`?\n````\n\n```{solution-start} alpha-ex-1\n:class: dropdown\n```\n"
        "Twice the value, computed and checked:"
    ),
    code("twice = 2 * 0.125\nprint(twice)\nassert twice == 0.25"),
    md("That is the answer.\n\n```{solution-end}\n```"),
    md("## Recap\n\nThe recap is not part of the solution."),
]
BETA = [md("# Beta\n\nBack to {doc}`alpha`."), code('print("beta ran")')]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The miniature repository after the workflow's steps: configure, `make book`, the Colab
    edition, and the publish step pushing to a local bare repository instead of GitHub."""
    venv = ROOT / ".venv"
    if not (venv / "bin" / "jupyter-book").exists():
        pytest.skip("no .venv with jupyter-book (make setup)")
    repo = tmp_path_factory.mktemp("tiny-repo")
    stamp = (venv / ".installed").stat().st_mtime
    for name in (
        "Makefile",
        "requirements.txt",
        "pyproject.toml",
        "_config.yml",
        "references.bib",
    ):
        shutil.copy2(ROOT / name, repo / name)
    for name in (
        "requirements.txt",
        "pyproject.toml",
    ):  # the shared .venv counts as set up here
        os.utime(repo / name, (stamp - 1, stamp - 1))
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "_ext", repo / "_ext", ignore=ignore)
    shutil.copytree(ROOT / "tools", repo / "tools", ignore=ignore)
    (repo / ".venv").symlink_to(venv)
    (repo / "book").mkdir()
    shutil.copy(ROOT / "book" / "bibliography.md", repo / "book")
    (repo / "book" / "intro.md").write_text(
        "# A tiny book\n\n{doc}`alpha` and {doc}`beta`.\n"
    )
    for name, cells in (("alpha", ALPHA), ("beta", BETA)):
        nb = {
            "cells": cells,
            "metadata": {
                "kernelspec": {
                    "name": "python3",
                    "display_name": "Python 3",
                    "language": "python",
                }
            },
            "nbformat": 4,
            "nbformat_minor": 5,
        }
        for i, c in enumerate(cells):
            c["id"] = f"{name}-{i}"
        (repo / "book" / f"{name}.ipynb").write_text(json.dumps(nb, indent=1))
    (repo / "_toc.yml").write_text(
        yaml.safe_dump(
            {
                "format": "jb-book",
                "root": "book/intro",
                "parts": [
                    {
                        "caption": "Tiny",
                        "numbered": True,
                        "chapters": [{"file": "book/alpha"}, {"file": "book/beta"}],
                    },
                    {
                        "caption": "Back matter",
                        "chapters": [{"file": "book/bibliography"}],
                    },
                ],
            }
        )
    )
    bare = tmp_path_factory.mktemp("remote") / "tiny-book.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    path_env = f"{repo / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"  # setup-python's python3
    results = {}
    for words, replace in (
        ("tools/configure_repository.py", {}),
        ("make book", {}),
        ("tools/colab_edition.py", {}),
        (
            "git push",
            {
                f"https://x-access-token:{CONTEXT['github.token']}@github.com/"
                f"{CONTEXT['github.repository']}.git": str(bare)
            },
        ),
    ):
        proc = run_step(step(words), repo, path_env, **replace)
        results[words] = proc
        if proc.returncode != 0:
            break
    return repo, bare, results


def ok(published, words):
    repo, _, results = published
    proc = results.get(words)
    assert proc is not None, (
        f"an earlier step failed: {[(w, p.returncode) for w, p in results.items()]}"
    )
    assert proc.returncode == 0, (
        f"step `{words}` failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    return repo


@pytest.mark.slow  # builds a small book
def test_pages_workflow_steps_run_on_a_real_build(published):
    for words in (
        "tools/configure_repository.py",
        "make book",
        "tools/colab_edition.py",
        "git push",
    ):
        ok(published, words)
    repo, bare, _ = published
    assert (repo / "_build" / "html" / "book" / "alpha.html").exists()
    wf = yaml.safe_load(PAGES_YML.read_text())
    upload = next(
        s
        for s in wf["jobs"]["build"]["steps"]
        if "upload-pages-artifact" in s.get("uses", "")
    )
    assert (repo / upload["with"]["path"] / "index.html").exists(), (
        "the uploaded folder has no site"
    )
    files = subprocess.run(
        ["git", "--git-dir", str(bare), "ls-tree", "-r", "--name-only", "colab"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sorted(files) == ["book/alpha.ipynb", "book/beta.ipynb"], files


def tiny_edition(repo, name) -> dict:
    return json.loads(
        (repo / "_build" / "colab" / "book" / f"{name}.ipynb").read_text()
    )


def test_colab_step_writes_glued_values_from_the_build(published):
    """myst-nb moves display=False glue into <chapter>.glue.json: the Colab step must read it."""
    repo = ok(published, "tools/colab_edition.py")
    assert (repo / "_build" / "jupyter_execute" / "book" / "alpha.glue.json").exists()
    text = "".join("".join(c["source"]) for c in tiny_edition(repo, "alpha")["cells"])
    assert "A value glued without display, 0.125, one with, 7;" in text
    assert "What is twice 0.125?" in text
    assert (
        "https://someone.github.io/tiny-book/book/beta.html" in text
    )  # configured Pages URL


@pytest.mark.slow  # builds a small book
def test_colab_step_folds_the_solution_and_keeps_the_rest_in_view(published):
    repo = ok(published, "tools/colab_edition.py")
    cells = tiny_edition(repo, "alpha")["cells"]
    sources = ["".join(c["source"]) for c in cells]
    assert all(
        s.strip() for s, c in zip(sources, cells) if c["cell_type"] == "markdown"
    ), "an empty markdown cell"
    folded = [s for s in sources if "<details>" in s]
    assert any("Twice the value, computed" in s for s in folded)
    assert any("That is the answer." in s for s in folded)
    assert not any("Recap" in s for s in folded)
    hidden = [
        c
        for c in cells
        if c["cell_type"] == "code" and "twice = 2" in "".join(c["source"])
    ]
    assert hidden and hidden[0]["metadata"]["jupyter"]["source_hidden"] is True
    assert hidden[0]["metadata"]["cellView"] == "form"


def test_download_button_gives_the_colab_edition(published):
    """The page's download (_sources/…ipynb) is the Colab edition the workflow publishes."""
    repo = ok(published, "tools/colab_edition.py")
    html = repo / "_build" / "html"
    page = (html / "book" / "alpha.html").read_text()
    assert "_sources/book/alpha.ipynb" in page
    download = json.loads((html / "_sources" / "book" / "alpha.ipynb").read_text())
    assert download == tiny_edition(repo, "alpha")


def test_tiny_build_renders_markdown_tables_and_merges_streams(published):
    repo = ok(published, "make book")
    page = (repo / "_build" / "html" / "book" / "alpha.html").read_text()
    assert not page_checks.raw_pipe_tables(page), page_checks.raw_pipe_tables(page)
    assert "<table" in page and ">tiny<" in page
    assert not page_checks.split_streams(page), page_checks.split_streams(page)
    assert "first row of a printed table\nsecond row of a printed table" in page
