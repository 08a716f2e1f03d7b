#!/usr/bin/env bash
# `make demo`: start the daemon, run the example GPT under rtxops, show what happened.
# DEMO_EXIT=1 stops the daemon when the job ends; otherwise it keeps serving until Ctrl-C.
set -euo pipefail
VENV=${1:-.venv}
STEPS=${2:-30}
RTXOPS="$VENV/bin/rtxops"
export RTXOPS_HOME=${RTXOPS_HOME:-$PWD/.rtxops}
PORT=${RTXOPS_PORT:-8765}

started=0
if ! "$RTXOPS" daemon status >/dev/null 2>&1; then
  "$RTXOPS" daemon --detach --port "$PORT"
  started=1
fi
stop_daemon() { if [ "$started" = 1 ]; then "$RTXOPS" daemon stop >/dev/null || true; fi; }
trap stop_daemon EXIT

URL=$(cat "$RTXOPS_HOME/daemon.url")
echo "== rtxops daemon: $URL (API docs: $URL/docs, metrics: $URL/metrics)"
echo "== dashboard: $URL/ (open it in a browser; it follows the job live)"
echo "== the example GPT under 'rtxops run' ($STEPS steps; the evolve loop tunes its hot ops meanwhile)"
"$RTXOPS" run --name demo-gpt -- "$VENV/bin/python" examples/train_gpt.py --steps "$STEPS"
echo
echo "== what the daemon stored"
"$RTXOPS" jobs
"$RTXOPS" telemetry stats
echo
echo "== what the evolve loop did (gate, explore, promote, canary, rollback)"
"$RTXOPS" evolve status
echo
echo "== every published plan is a signed bundle in a hash-chained ledger"
"$RTXOPS" ledger verify || true
if [ "${DEMO_EXIT:-0}" = 1 ]; then exit 0; fi
echo "== the daemon keeps serving $URL; Ctrl-C stops it"
while "$RTXOPS" daemon status >/dev/null 2>&1; do sleep 2; done
