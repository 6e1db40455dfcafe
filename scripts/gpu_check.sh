#!/usr/bin/env bash
# The GPU check of issue 28 for a lent CUDA machine (an H200 with torch 2.11, triton,
# transformers and pytest; no diffusers, nothing installable there). This file is the
# entry point; the Python of its steps is in scripts/gpu_check/. Steps, each under its
# own time limit, all inside 5 minutes; one table last:
#   1. profile   where the host time of one small call goes (scripts/gpu_check/gpu_profile.py)
#   2. tests     pytest -m cuda on the test files that have CUDA tests
#   3. bench     ours vs torch's SDPA, torch's op and its LSE cost, the statistics
#                kernels vs our forward (scripts/gpu_check/gpu_bench.py)
#   4. integrations  BERT, Llama, a viewer session and a diffusers UNet step vs eager
#                (scripts/gpu_check/gpu_integrations.py)
#   5. report    the table; results as JSON (scripts/gpu_check/gpu_report.py)
#
#   bash scripts/gpu_check.sh                 on the device (from the repository root)
#   bash scripts/gpu_check.sh --dry-run       here, on CPU at tiny sizes (or SDPA_GPU_DRY_RUN=1)
#   bash scripts/gpu_check.sh --fetch-wheels  here: the cp312 wheels the device lacks, into .whl/
#
# Wheels: with .whl/*.whl present (carry ".whl" in the device call), they are installed
# into /tmp/sdpa-wheels first, without the network. Results: $SDPA_GPU_RESULTS (default
# benchmarks/results; the run folder for a dry run)/gpu_check.json, and the JSON and the
# step logs into $OUT when set (the device tool brings $OUT back). PYTHON picks the
# interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
PY="${PYTHON:-python3}"
mode=device
case "${1:-}" in
  "") ;;
  --dry-run) mode=dry ;;
  --fetch-wheels) mode=fetch ;;
  *) echo "usage: bash scripts/gpu_check.sh [--dry-run | --fetch-wheels]" >&2; exit 2 ;;
esac
if [ "$mode" = device ] && [ "${SDPA_GPU_DRY_RUN:-0}" = 1 ]; then mode=dry; fi

if [ "$mode" = fetch ]; then  # pure-Python wheels; the device's own packages satisfy their needs
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" diffusers==0.42.1
fi

RUN="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mapfile -t CUDA_TESTS < <(grep -l "mark\.cuda" tests/test_*.py)
if [ "$mode" = dry ]; then
  export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1  # CPU only; the kernels interpreted
  RESULTS="${SDPA_GPU_RESULTS:-$RUN}"
  NAME=gpu_check_dry_run.json
  PROFILE=(--device cpu --calls 50)
  DRY=(--dry-run)
  BUDGET=240
else
  unset TRITON_INTERPRET  # the kernels must run compiled here
  RESULTS="${SDPA_GPU_RESULTS:-benchmarks/results}"
  NAME=gpu_check.json
  PROFILE=(--device cuda --calls 1000)
  DRY=()
  BUDGET=285  # the five minutes, less the report's few seconds
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/sdpa-wheels "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/sdpa-wheels"
  fi
fi
deadline=$((SECONDS + BUDGET))

step() {  # step NAME CAP_SECONDS TAIL_LINES command...: run it, keep its log, note rc and time
  local name=$1 cap=$2 lines=$3
  shift 3
  local left=$((deadline - SECONDS))
  ((left < 10)) && left=10
  local limit=$((cap < left ? cap : left)) start=$SECONDS
  echo "== $name (at most ${limit} s): $*"
  # SIGINT first: pytest and the scripts then still write what they have (junit xml, JSON)
  timeout -s INT -k 5 "$limit" "$@" >"$RUN/$name.log" 2>&1
  local rc=$?
  tail -n "$lines" "$RUN/$name.log"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >>"$RUN/steps.tsv"
}

step profile 25 30 "$PY" scripts/gpu_check/gpu_profile.py "${PROFILE[@]}" --json "$RUN/profile.json"
step tests 100 25 "$PY" -m pytest -q -m cuda -p no:cacheprovider --tb=short -rfE \
  --junitxml="$RUN/pytest.xml" "${CUDA_TESTS[@]}"
step bench 110 4 "$PY" scripts/gpu_check/gpu_bench.py --reps 15 "${DRY[@]}" --json "$RUN/bench.json"
step integrations 50 4 "$PY" scripts/gpu_check/gpu_integrations.py "${DRY[@]}" --json "$RUN/integrations.json"

echo
title="gpu_check$([ "$mode" = dry ] && echo ' DRY RUN (CPU, tiny sizes: the numbers mean nothing)')"
"$PY" scripts/gpu_check/gpu_report.py "$RUN" --out "$RESULTS/$NAME" --title "$title"
rc=$?
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  cp "$RESULTS/$NAME" "$RUN"/*.log "$OUT"/ 2>/dev/null
  [ -f "$RUN/pytest.xml" ] && cp "$RUN/pytest.xml" "$OUT"/
fi
exit $rc
