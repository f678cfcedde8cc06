"""The formatter and the linter, as `make test` runs them: `ruff format --check` and
`ruff check` (rules in pyproject.toml) over the package, the tests, the tools and the
book's Sphinx extensions. Fix with `ruff format` and `ruff check --fix`."""

import pathlib
import shutil
import subprocess
import sys

import pytest

#: seconds: the edit loop runs them too (tests/scheduling.py)
pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ["kernels", "tests", "tools", "_ext"]


def _ruff():
    exe = pathlib.Path(sys.executable).with_name("ruff")
    found = str(exe) if exe.exists() else shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (requirements.txt installs it)")
    return found


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff(command):
    done = subprocess.run(
        [_ruff(), *command, *FOLDERS], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
