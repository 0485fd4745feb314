#!/usr/bin/env bash
# The prepared GPU evidence run (issue 6): conformance of every CUDA backend, accumulator bits of
# torch._scaled_mm with fast accumulation on and off, FP8 vs bf16 GEMM and quantization vs the
# device-to-device copy, targets as pass/fail. No network; under 8 minutes on one GPU.
#
# usage: scripts/gpu_check.sh [OUT_DIR] [more python -m fp8ref.gpu_check options]
#   OUT_DIR defaults to out/gpu_check; it receives gpu_check.json and summary.md.
# exit status: 0 all targets passed, 1 a target failed or a step errored, 2 no CUDA device,
#   124 the hard 7m50s limit below was hit (the JSON written after the last finished step stays).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-out/gpu_check}"
[ $# -gt 0 ] && shift
python="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# A fresh, empty selector cache: first-selection times are real, and no stale decision is reused.
FP8REF_CACHE_DIR="$(mktemp -d)"
export FP8REF_CACHE_DIR
mkdir -p "$out"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
    --format=csv >"$out/nvidia-smi.csv" 2>&1 || true
# The Python budget (420 s) leaves time to write results before the hard limit.
status=0
timeout --signal=INT --kill-after=15 470 "$python" -m fp8ref.gpu_check --out "$out" --budget-s 420 "$@" \
    2>&1 | tee "$out/gpu_check.log" || status=${PIPESTATUS[0]}
exit "$status"
