#!/usr/bin/env bash
# The one command for a lent GPU machine (README, "On a GPU"): with the device tool,
#   carry: [".whl"]   command: bash tools/gpu_day.sh   timeout_s: 600
# It runs tools/gpu_check.py with the machine's own python3: the carried wheels are installed
# into /tmp/site (no index), then benchmark, kernel tests, inspector and chapters, each under
# its budget (480 s in all); every file lands in $OUT (at most 8, no subfolders).
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader 2>/dev/null
exec python3 tools/gpu_check.py "$@"
