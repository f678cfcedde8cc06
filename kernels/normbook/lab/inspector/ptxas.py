"""Registers, spills, stack and shared memory, as ``ptxas -v`` reports them: from the
log of Triton's own ptxas run, kept, or from a run of ours."""

from __future__ import annotations

import pathlib
import re
import subprocess
import tempfile


def _ptxas(ptx: str, arch: int, fp_fusion: bool) -> dict:
    """Registers, spills, stack and shared memory from ``ptxas -v``, run as Triton's
    make_cubin runs it."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "k.ptx"
        src.write_text(ptx)
        fmad = [] if fp_fusion else ["--fmad=false"]
        cmd = [
            get_ptxas(arch).path,
            "-lineinfo",
            *fmad,
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={sm_arch_from_capability(arch)}",
            str(src),
            "-o",
            str(src) + ".o",
        ]
        return parse_ptxas_log(
            subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        )


def parse_ptxas_log(log: str) -> dict:
    def num(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        "registers": num(r"Used (\d+) registers"),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
        "stack": num(r"(\d+) bytes stack frame"),
        "static_smem": num(r"(\d+) bytes smem"),
    }


_PTXAS_LOGS: list[str] = []


def _keep_ptxas_logs() -> None:
    """Triton's make_cubin already runs ``ptxas -v`` and throws the log away: keep it
    (saves a second ptxas run per variant). Falls back to our own run when Triton's
    cache skipped ptxas."""
    import triton.backends.nvidia.compiler as nv

    real = nv.subprocess

    class Shim:
        def __getattr__(self, name):
            return getattr(real, name)

        def run(self, cmd, *args, **kwargs):
            result = real.run(cmd, *args, **kwargs)
            log = kwargs.get("stderr")
            if "-v" in cmd and hasattr(log, "name"):
                with open(log.name) as f:
                    _PTXAS_LOGS.append(f.read())
            return result

    nv.subprocess = Shim()
