"""`make gpu-check`: everything a CUDA GPU can check, in one command, results into data/bench/.

1. the whole test suite on the GPU (every chapter is executed by tests/test_chapters.py);
2. `python -m kernels.bench`: copy bandwidth, the sweep N = 256 … 262,144 and the decode shapes,
   forward and backward, against eager PyTorch, torch.compile and Liger (when installed);
3. `python -m kernels.inspect --arch <this GPU's>`: what the compiler made of each kernel, to set
   the predictions beside the measurements.

The benchmark writes its JSON/CSV into data/bench/ (where the speed-of-light chapter reads them);
each step's log, the test report, the inspector's table and a summary.json naming the GPU,
torch/triton/CUDA versions, the date, the git commit, and each step's command, exit status and
duration go to data/bench/<date>_<gpu>_gpu-check/. Budget: about 10 minutes on one H100-class GPU (torch.compile, which compiles once per
shape, is timed at a subset of N; see BENCH_ARGS). The exit status is non-zero if any step failed.

On a machine without a CUDA GPU it says so and exits with status 2: nothing here can be measured
on a CPU (the CPU checks are `make test`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "bench"
# torch.compile compiles every shape anew (dynamic=False): time it at these N only, to fit the budget.
BENCH_ARGS = ["--compile-sizes", "1024,4096,16384,65536,262144"]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("make gpu-check needs a CUDA GPU, and this machine has none (torch.cuda.is_available() is "
              "False): nothing was run. On a CPU, `make test` runs every check that does not need a GPU.",
              file=sys.stderr)
        return 2
    import triton

    props = torch.cuda.get_device_properties(0)
    arch = props.major * 10 + props.minor
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", props.name).strip("-").lower()
    out = DATA / f"{date.replace(':', '').replace('-', '').replace('+0000', 'Z')}_{slug}_gpu-check"
    out.mkdir(parents=True, exist_ok=True)

    def git(*args):
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    summary = {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "sm_count": props.multi_processor_count,
               "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
               "python": sys.version.split()[0], "date": date, "git_commit": git("rev-parse", "HEAD"),
               "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")), "steps": []}
    inspect_arch = min((a for a in (90, 80, 75) if a <= arch), default=75, key=lambda a: arch - a)
    steps = [
        ("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={out / 'tests.xml'}"]),
        # Into data/bench/ itself, where the speed-of-light chapter reads recorded runs.
        ("bench", [sys.executable, "-m", "kernels.bench", *BENCH_ARGS]),
        ("inspect", [sys.executable, "-m", "kernels.inspect", "--arch", str(inspect_arch),
                     "--json", str(out / f"inspect_sm{inspect_arch}.json")]),
    ]
    failed = False
    for name, cmd in steps:
        print(f"== gpu-check: {name}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        with (out / f"{name}.log").open("w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            proc.wait()
        seconds = round(time.perf_counter() - t0, 1)
        summary["steps"].append({"step": name, "command": cmd, "returncode": proc.returncode, "seconds": seconds,
                                 "log": f"{name}.log"})
        failed |= proc.returncode != 0
        print(f"== gpu-check: {name} exited {proc.returncode} after {seconds} s", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"gpu-check results in {out.relative_to(ROOT)}" + (" (some steps FAILED)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
