#!/usr/bin/env bash
# Replay the Mooncake conversation trace (../shared/data/mooncake, or TRACE=...) through pagedkv and the anchors:
# GPU-only capacity points with Belady's bound, the CPU tier of the prefix cache (300k GPU tokens + 0.3M..10M CPU),
# the pooled reference for the tier (one GPU pool of the same total), vLLM V1 and nano-vllm side by side.
# Results: benchmarks/results/replay/*.json and the chart replay-conversation_trace.png. About 15 minutes here.
set -uo pipefail
cd "$(dirname "$0")/.."
TRACE=${TRACE:-../shared/data/mooncake/conversation_trace.jsonl}
OUT=benchmarks/results/replay
mkdir -p "$OUT"
R=".venv/bin/python -m pagedkv.cli replay $TRACE --no-progress"
$R --capacity 300k --capacity 1M --capacity 3M --capacity 10M --bound --json "$OUT/conversation-pagedkv.json"
for cpu in 300k 1M 3M 10M; do
  $R --capacity 300k --cpu-capacity "$cpu" --json "$OUT/conversation-pagedkv-tier-300k+$cpu.json"
done
$R --capacity 600k --capacity 1.3M --capacity 3.3M --capacity 10.3M --json "$OUT/conversation-pagedkv-pooled.json"
for anchor in vllm_v1 nanovllm; do
  case $anchor in vllm_v1) venv=.venv-anchor-v1;; nanovllm) venv=.venv-anchor-nano;; esac
  [ -x "$venv/bin/python" ] || { echo "skip $anchor: $venv missing (bash scripts/install_anchors.sh)"; continue; }
  "$venv/bin/python" -m pagedkv.cli replay "$TRACE" --no-progress --impl "$anchor" --capacity 300k --capacity 1M \
    --capacity 3M --capacity 10M --json "$OUT/conversation-$anchor.json"
  # pagedkv in the same virtualenv right after, for times measured side by side
  "$venv/bin/python" -m pagedkv.cli replay "$TRACE" --no-progress --capacity 300k --capacity 1M --capacity 3M \
    --capacity 10M --json "$OUT/conversation-pagedkv-beside-$anchor.json"
done
.venv/bin/python -m pagedkv.replay.report "$OUT"/conversation-pagedkv.json "$OUT"/conversation-pagedkv-tier-*.json \
  "$OUT"/conversation-vllm_v1.json "$OUT"/conversation-nanovllm.json --plot "$OUT"
