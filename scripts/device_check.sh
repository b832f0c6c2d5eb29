#!/usr/bin/env bash
# The device check for a machine with an NVIDIA GPU (not part of `make test`; these machines have
# none): installs the CUDA PJRT plugin, shows what tpuc finds, runs the zoo on the GPU against
# eager CUDA and Inductor CUDA, and writes bench/results/gpu.md (+ gpu.json).
#
#   scripts/device_check.sh [--iters N] [--models NAME...]   (arguments go to bench/bench_gpu.py)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
    echo "device_check: no NVIDIA GPU on this machine (no /dev/nvidia0 ...)" >&2
    exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
./scripts/setup.sh --plugin cuda
.venv/bin/python -m tpuc.cli doctor --plugin cuda
.venv/bin/python bench/bench_gpu.py "$@"
