"""Publishing: the GitHub Actions workflows pass actionlint, run the README's commands, and take
the repository from the workflow's context (tools/configure_repository.py)."""

import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

from book_build import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import configure_repository  # noqa: E402

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
ACTIONLINT = shutil.which("actionlint") or shutil.which("actionlint", path=str(pathlib.Path(sys.executable).parent))


@pytest.mark.skipif(ACTIONLINT is None, reason="actionlint not installed (pip install -r requirements.txt)")
def test_workflows_pass_actionlint():
    assert WORKFLOWS
    proc = subprocess.run([ACTIONLINT, *map(str, WORKFLOWS)], capture_output=True, text=True, cwd=ROOT)
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
    for needed in ("make book", "tools/colab_edition.py", "tools/configure_repository.py",
                   "github.repository", "github.ref_name", "actions/deploy-pages",
                   "actions/upload-pages-artifact"):
        assert needed in text, needed


def test_configure_repository_rewrites_only_the_three_values():
    text = (ROOT / "_config.yml").read_text()
    out = configure_repository.configure(text, "https://github.com/me/book", "dev", "https://me.github.io/book")
    cfg = yaml.safe_load(out)
    assert cfg["repository"]["url"] == "https://github.com/me/book"
    assert cfg["repository"]["branch"] == "dev"
    assert cfg["html"]["baseurl"] == "https://me.github.io/book/"
    before = yaml.safe_load(text)
    for key in before:
        if key not in ("repository", "html"):
            assert cfg[key] == before[key], key
    assert out.count("#") == text.count("#")  # comments kept
