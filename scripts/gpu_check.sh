#!/usr/bin/env bash
# The GPU check for a lent CUDA machine (an H200 with torch, triton and pytest, nothing
# installable): the CUDA tests, then the benchmark, whose table is printed last.
# Runs from the working tree:  bash scripts/gpu_check.sh   (under 4 minutes: each part
# has its own timeout; the bench prints each row as it is measured)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the kernels must run compiled here
PY="${PYTHON:-python3}"

"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")'

# only the files with CUDA tests: the rest of the suite needs extras this machine lacks
timeout 110 "$PY" -m pytest -q -m cuda -p no:cacheprovider --tb=short -rfE \
  tests/test_cuda.py tests/test_backends.py tests/test_distributed.py 2>&1 | tail -40
tests_rc=${PIPESTATUS[0]}

timeout 120 "$PY" scripts/gpu_bench.py --reps 15 --json "${OUT:-/tmp}/gpu_bench.json"
bench_rc=$?

echo "gpu_check: tests rc=${tests_rc} (0 = all passed), bench rc=${bench_rc}"
exit $(( tests_rc != 0 || bench_rc != 0 ))
