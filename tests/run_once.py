"""Work done once per test run and shared by every pytest-xdist worker: executing the chapters,
building their HTML, compiling the inspector's table.

The plugin ``scheduling.py`` gives each run an id (``$TEST_RUN_ID``), made by the process that
starts the run before any worker exists, so every worker inherits the same one. A *step* stores its JSON result
in ``<directory>/<name>.<run id>.json``; ``once()`` computes it under a file lock, so the first
caller computes and every later caller (another worker, a background process) waits for the lock
and reads the result. ``start()`` begins a step in a background process as soon as collection
shows that a test will need it (the kernel tests run meanwhile); if that process dies, the first
test that needs the step computes it itself, and its error is reported there.

Only the standard library: the kernel tests import this where the book's packages are missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN_VAR = "TEST_RUN_ID"
_STARTED: list[subprocess.Popen] = []  # background steps this process started


def run_id() -> str:
    rid = os.environ.get(RUN_VAR)
    if not rid:  # outside pytest (a step run by hand): a run of its own
        rid = os.environ[RUN_VAR] = f"{os.getpid()}-{time.time_ns()}"
    return rid


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(
            f, fcntl.LOCK_EX
        )  # released when the holder exits, however it exits
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def result_path(directory: pathlib.Path, name: str) -> pathlib.Path:
    return pathlib.Path(directory) / f"{name}.{run_id()}.json"


def once(directory: pathlib.Path, name: str, compute):
    """``compute()`` (a JSON-able value), computed once per run across processes."""
    out = result_path(directory, name)
    with _locked(pathlib.Path(directory) / f"{name}.lock"):
        if out.exists():
            return json.loads(out.read_text())
        value = compute()
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(out)
        _forget_other_runs(pathlib.Path(directory), name)
        return value


def stored(directory: pathlib.Path, name: str):
    """This run's result of a step, or None if it was not computed (yet)."""
    out = result_path(directory, name)
    return json.loads(out.read_text()) if out.exists() else None


def _forget_other_runs(directory: pathlib.Path, name: str) -> None:
    for p in directory.glob(f"{name}.*"):
        if p.suffix != ".lock" and run_id() not in p.name:
            with contextlib.suppress(OSError):
                p.unlink()


def start(directory: pathlib.Path, name: str, target: str, nice: int = 0) -> None:
    """Start ``target`` ("module:function", a module of tests/, a function that calls ``once()``
    for this step) in a background process, unless this run already started it. ``nice`` lowers its
    priority: a step needed only at the end of the run yields the cores to the tests."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / f"{name}.{run_id()}.started"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # another worker of this run started it
    log = open(directory / f"{name}.{run_id()}.log", "w")
    # Its own process group, so that finish() stops its children too (the inspector's compilers);
    # and it stops itself when the process that started it is gone (a killed worker).
    _STARTED.append(
        subprocess.Popen(
            [sys.executable, __file__, target, str(os.getpid())],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
    )


def finish(interrupted: bool) -> None:
    """At the end of the session of the process that started them: wait for the background steps
    (another worker may still be waiting for one), or stop them when the run was cut short."""
    for proc in _STARTED:
        if interrupted:
            _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30 if interrupted else None)
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGKILL)
    _STARTED.clear()


def _signal_group(pgid: int, sig) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(2)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:  # the run is gone: stop this step and its children
            _signal_group(os.getpgid(0), signal.SIGTERM)


if __name__ == "__main__":  # python tests/run_once.py module:function parent-pid
    # What pytest imports from (pyproject.toml's pythonpath): this is a plain Python process.
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tools")]
    threading.Thread(
        target=_watch_parent, args=(int(sys.argv[2]),), daemon=True
    ).start()
    module, function = sys.argv[1].split(":")
    getattr(importlib.import_module(module), function)()
