"""pytest plugin of tools/gpu_check.py: past ``$GPU_CHECK_DEADLINE`` (a Unix time), every test
not yet started is skipped with the reason "gpu-check budget", so that pytest finishes, prints its
summary and writes its report itself instead of being killed by the step's hard stop.

Loaded with ``-p pytest_budget`` (tools/ on PYTHONPATH); with pytest-xdist each worker loads it.
"""

import os
import time

import pytest


def pytest_runtest_setup(item):
    deadline = os.environ.get("GPU_CHECK_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip("gpu-check budget reached: not run")
