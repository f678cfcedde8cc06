"""Lowering one variant: Triton's pipeline to PTX, ``ptxas -v``, the PTX read; and the
on-disk cache of what each variant gave (``NORMBOOK_INSPECT_CACHE``), with a lock per
group of keys so that two processes compile a variant once."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time

from .ptx import _ptx_sha, analyze_ptx
from .ptxas import _PTXAS_LOGS, _ptxas, parse_ptxas_log
from .table import recorded

#: The on-disk cache, read at each use as this module's global: ``--record
#: --from-scratch`` and the tests point it elsewhere.
CACHE = pathlib.Path(
    os.environ.get(
        "NORMBOOK_INSPECT_CACHE", pathlib.Path.home() / ".cache" / "normbook-inspect"
    )
)


def _compile_and_read(
    fn, signature, constexprs, attrs, options, target, key: str, need_ptx: bool = False
) -> dict:
    """Lower one specialized variant to PTX (Triton's pipeline), run ptxas -v, read the
    PTX; cached. Unless the PTX itself is asked for, a variant of the recorded table is
    read from there."""
    import triton

    # The recorded table first: it is what the tests check (verify_recorded compares it
    # with a fresh compile), and a local entry of the same key says the same.
    if not need_ptx and key in recorded():
        return dict(recorded()[key])
    path = CACHE / f"{key}.json"
    cached = _cached(path, triton.__version__)
    if cached is not None:
        return cached
    # Two processes that need the same variant at once (a chapter's inspector cell and
    # the test suite's, both cold) compile it once: the second waits for the first's
    # entry. (A variant that fails to compile is not cached: each compiles it again.)
    # One lock per first two hex digits of the key: 256 small files, and two different
    # variants rarely wait for each other with a few compilers running.
    with _compile_lock(key):
        cached = _cached(path, triton.__version__)
        return (
            cached
            if cached is not None
            else _compile(fn, signature, constexprs, attrs, options, target, path)
        )


def _cached(path: pathlib.Path, version: str) -> dict | None:
    if not path.exists():
        return None
    try:
        cached = json.loads(path.read_text())
    except ValueError:
        return None
    # Another Triton compiles the same source differently: its entry does not count
    # (an entry that names no version is taken as it is).
    if cached.get("triton", version) != version:
        return None
    try:  # read now: a cache kept between CI runs drops what no run reads any more
        os.utime(path)
    except OSError:
        pass
    if "ptx" in cached:  # the hash as _ptx_sha computes it, whoever wrote the entry
        cached["ptx_sha"] = _ptx_sha(cached["ptx"])
    return cached


@contextlib.contextmanager
def _compile_lock(key: str):
    import fcntl

    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"compile-{key[:2]}.lock", "a") as f:
        try:  # released when the holder exits, however it does
            fcntl.flock(f, fcntl.LOCK_EX)
            locked = True
        except OSError:  # a file system without flock (a network one): compile anyway
            locked = False
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


def _compile(fn, signature, constexprs, attrs, options, target, path) -> dict:
    import triton
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    _PTXAS_LOGS.clear()
    try:
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=target,
            options=options.__dict__,
        )
    # a variant that does not compile is a result, reported per row
    except Exception as exc:
        last = " | ".join(str(exc).strip().splitlines()[-4:])
        return {"error": f"{type(exc).__name__}: " + last}
    ptx = compiled.asm["ptx"]
    names = [p.name for p in fn.params]
    # PTX parameters are the kernel's non-constexpr arguments, in order.
    runtime = [n for n in names if signature[n] != "constexpr"]
    pointers = {
        i: n for i, n in enumerate(runtime) if str(signature[n]).startswith("*")
    }
    info = {
        "ptx_sha": _ptx_sha(ptx),
        "num_warps": compiled.metadata.num_warps,
        "shared": compiled.metadata.shared,
        **(
            parse_ptxas_log(_PTXAS_LOGS[-1])
            if _PTXAS_LOGS
            else _ptxas(ptx, target.arch, options.enable_fp_fusion)
        ),
        **analyze_ptx(ptx, pointers),
        "compile_s": round(time.perf_counter() - t0, 3),
        "triton": triton.__version__,
    }
    info["ptx"] = ptx
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)
    return info
