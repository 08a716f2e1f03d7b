#!/usr/bin/env bash
# One command for a GPU machine (<= 8 minutes on one H100/H200):
#   1. optional installs (triton, liger-kernel; skipped quietly when offline),
#   2. the runtime's GPU checks (bench/gpu_check.py),
#   3. every Triton kernel vs its reference in fp32 and bf16, then fwd+bwd time and peak memory vs
#      eager, torch.compile and Liger-Kernel on LLM shapes (bench/gpu_kernels.py).
# Writes bench/results/gpu_kernels.json (override: OUT=...); exit 1 when a check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-bench/results/gpu_kernels.json}

for pkg in triton liger-kernel; do
  "$PY" -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null \
    || timeout 90 "$PY" -m pip install -q "$pkg" 2>/dev/null \
    || echo "gpu_check: $pkg not installed (offline?); continuing without it" >&2
done

status=0
timeout 120 "$PY" bench/gpu_check.py > "${OUT%.json}_runtime.json" || status=1
timeout 420 "$PY" bench/gpu_kernels.py --out "$OUT" "$@" || status=1
exit $status
