"""pytest plugin of tools/gpu_check.py, so that the tests step's counts survive its budget.

Loaded with ``-p pytest_budget`` (tools/ on PYTHONPATH); under pytest-xdist every worker
loads it too. Its settings come from the environment, all optional:

``GPU_CHECK_DEADLINE``
    a Unix time: no test starts after it, a test still running then is stopped, and the
    session ends, so that pytest writes its JUnit XML and summary before the step's hard
    stop (a few seconds later).
``GPU_CHECK_TEST_LIMIT_S``
    the most seconds one test may take (its setup, call and teardown together): one
    slow test must not eat the budget of all the others.
``GPU_CHECK_TESTS_JSONL``
    a file that gets one JSON line per test as each ends, by the process that receives
    the reports (under xdist, the controller): a first line with the number of tests
    collected, a last one with how the session ended. A run killed at any moment leaves
    a line for every test that finished, which is what gpu_check counts from.

A test stopped by the limit or the deadline is reported skipped with a reason that
starts with :data:`MARK`, and its line says ``"cut": true``: it was cut, it did not fail.
The stop is SIGALRM in the process that runs the test, so it lands when the test next
runs Python code (a single C call, a long compile, finishes first); where it cannot be
armed (a test run outside the main thread), the step's hard stop remains.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

MARK = "gpu-check budget"

_state: dict = {"report": None, "session": None, "start": None, "collected": False}


def _float_env(name: str) -> float | None:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


def _deadline() -> float | None:
    return _float_env("GPU_CHECK_DEADLINE")


def _stop_at() -> float | None:
    """The Unix time at which the running test is stopped: its limit or the deadline."""
    limit = _float_env("GPU_CHECK_TEST_LIMIT_S")
    ends = [t for t in (_deadline(),) if t is not None]
    if limit is not None and _state["start"] is not None:
        ends.append(_state["start"] + limit)
    return min(ends) if ends else None


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _write(line: dict) -> None:
    f = _state["report"]
    if f is None:
        return
    # One write per line, flushed at once: a kill leaves whole lines and at most one
    # partial last line, which the reader drops.
    f.write(json.dumps(line) + "\n")
    f.flush()


# ---------------------------------------------------------------- the report


def pytest_configure(config):
    path = os.environ.get("GPU_CHECK_TESTS_JSONL")
    if path and not _is_worker(config):
        _state["report"] = open(path, "a", buffering=1)


def pytest_sessionstart(session):
    _state["session"] = session


def pytest_collection_finish(session):
    # Under xdist the controller collects nothing (and may call this with no items).
    if session.items and not _is_worker(session.config) and not _state["collected"]:
        _state["collected"] = True
        _write({"event": "collected", "tests": len(session.items), "time": time.time()})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    # Under xdist the controller collects nothing itself; every worker collects the same.
    if not _state["collected"]:
        _state["collected"] = True
        _write({"event": "collected", "tests": len(ids), "time": time.time()})


def pytest_runtest_logreport(report):
    if _state["report"] is None:
        return
    if not (
        report.when == "call"
        or (report.when == "setup" and not report.passed)
        or (report.when == "teardown" and report.failed)
    ):
        return
    cut = report.skipped and MARK in str(report.longrepr)
    _write(
        {
            "test": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "cut": cut,
            "seconds": round(getattr(report, "duration", 0.0), 3),
        }
    )


def pytest_sessionfinish(session, exitstatus):
    deadline = _deadline()
    _write(
        {
            "event": "finished",
            "exitstatus": int(exitstatus),
            "past_deadline": deadline is not None and time.time() > deadline,
            "time": time.time(),
        }
    )


def pytest_unconfigure(config):
    if _state["report"] is not None:
        _state["report"].close()
        _state["report"] = None


# ---------------------------------------------------------------- the limits


class _Stop:
    """Arms SIGALRM for the rest of the running test's time, inside one phase."""

    def __init__(self):
        self.armed = False

    def __enter__(self):
        stop_at = _stop_at()
        if stop_at is None or threading.current_thread() is not threading.main_thread():
            return self
        try:
            self.previous = signal.signal(signal.SIGALRM, _on_alarm)
        except (ValueError, OSError, AttributeError):  # no SIGALRM here
            return self
        signal.setitimer(signal.ITIMER_REAL, max(0.01, stop_at - time.time()))
        self.armed = True
        return self

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


def _on_alarm(signum, frame):
    deadline = _deadline()
    if deadline is not None and time.time() >= deadline - 0.05:
        why = "the tests step's deadline reached"
    else:
        limit = os.environ.get("GPU_CHECK_TEST_LIMIT_S", "?")
        why = f"stopped at the per-test limit of {limit} s"
    # Skipped is no Exception: a test's own ``except Exception`` does not swallow it.
    raise pytest.skip.Exception(f"{MARK}: {why}")


def pytest_runtest_logstart(nodeid, location):
    _state["start"] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    deadline = _deadline()
    if deadline is not None and time.time() > deadline:
        # A test handed to this process before the stop: skipped before its fixtures.
        pytest.skip(f"{MARK}: the tests step's deadline reached, not run")
    with _Stop():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _Stop():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _Stop():
        yield


def pytest_runtest_logfinish(nodeid, location):
    deadline = _deadline()
    session = _state["session"]
    if deadline is not None and session is not None and time.time() > deadline:
        # After this test: pytest (or this xdist worker, and then the controller) stops.
        session.shouldstop = f"{MARK}: the tests step's deadline reached"
