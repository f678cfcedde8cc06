"""`make gpu-check` is for a CUDA machine: on a CPU it says so and fails, having run nothing."""

import pathlib
import shutil
import subprocess
import sys

import pytest

from kernels import DEVICE

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU, make gpu-check runs for real")
def test_gpu_check_refuses_without_a_gpu():
    before = sorted((ROOT / "data" / "bench").glob("*"))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "nothing was run" in proc.stderr
    assert sorted((ROOT / "data" / "bench").glob("*")) == before


@pytest.mark.skipif(DEVICE.type == "cuda" or shutil.which("make") is None, reason="needs make, and no GPU")
def test_make_gpu_check_target_exists_and_fails_on_a_cpu():
    # -o: take the venv and the browser as given (the test runs in whichever environment pytest has).
    proc = subprocess.run(["make", "-o", ".venv/.installed", "-o", "browser", "gpu-check", f"PY={sys.executable}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert "needs a CUDA GPU" in proc.stderr
