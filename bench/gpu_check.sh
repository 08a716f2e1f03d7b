#!/usr/bin/env bash
# One command for a GPU machine (at most ~8.5 minutes on one H100/H200):
#   1. the runtime's GPU checks (bench/gpu_check.py) -> ${OUT%.json}_runtime.json;
#   2. what routing costs on CUDA, per call and per step (bench/gpu_dispatch.py) -> ${OUT%.json}_dispatch.json;
#   3. every Triton kernel vs its reference in fp32 and bf16, then fwd+bwd time and peak memory vs
#      eager, Liger-Kernel (when importable) and torch.compile on LLM shapes (bench/gpu_kernels.py),
#      written row by row, so a run cut short keeps the rows it measured.
# A machine without rtxops' dependencies (an offline GPU image with its own torch and triton):
# WHEELS=DIR installs DIR's wheels (no index, no dependencies) into a temporary folder first.
# Writes bench/results/gpu_kernels.json (override: OUT=...); exit 1 when a check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-bench/results/gpu_kernels.json}

path="$PWD"
if [ -n "${WHEELS:-}" ]; then
  site=$(mktemp -d)
  trap 'rm -rf "$site"' EXIT
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$WHEELS"/*.whl || exit 1
  path="$site:$path"
fi
export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# without a GPU the runs below would replace the saved GPU results with "no CUDA device"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check.sh: no CUDA device here: nothing run, nothing written" >&2
  exit 2
fi

status=0
timeout "${CHECK_TIMEOUT_S:-180}" "$PY" bench/gpu_check.py --compile-budget-s 45 \
  > "${OUT%.json}_runtime.json" || status=1
timeout "${DISPATCH_TIMEOUT_S:-120}" "$PY" bench/gpu_dispatch.py > "${OUT%.json}_dispatch.json" || status=1
timeout "${KERNELS_TIMEOUT_S:-330}" "$PY" bench/gpu_kernels.py --out "$OUT" "$@" || status=1
exit $status
