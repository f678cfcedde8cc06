"""The inspector's survey of every kernel variant, computed once per test run (run_once.py):
the table tests/lab/test_inspect.py checks. The plugin (scheduling.py) starts it in a
background process at collection, niced; the first test that needs it reads it, or computes
it there if that process died."""

import os

import run_once

from normbook.lab import inspector

STEP_DIR, STEP = inspector.ROOT / "_build", "test-inspect"


def _compute_rows():
    rows = inspector.survey()
    # Where the rows were read from the recorded table, a random unit per call is compiled
    # again from nothing, to check that the table still says what the compiler says. The seed
    # is new every run (INSPECT_VERIFY_SEED repeats one).
    verified = None
    if inspector.recorded():
        seed = int(
            os.environ.get("INSPECT_VERIFY_SEED")
            or int.from_bytes(os.urandom(4), "big")
        )
        verified = inspector.verify_recorded(rows, seed)
    return {"rows": rows, "verified": verified}


def rows():
    """Every variant's row, and the check of the recorded table (the background step's
    entry point)."""
    return run_once.once(STEP_DIR, STEP, _compute_rows)


def start() -> None:
    """Begin the survey in a background process, niced: its tests run last, so it takes the
    cores the other tests leave (the chapters, which the browser tests wait for, keep their
    priority)."""
    run_once.start(STEP_DIR, STEP, "inspector_step:rows", nice=10)
