#!/usr/bin/env bash
# Replay every eviction policy (pagedkv.retention) through the Mooncake conversation trace (../shared/data/mooncake,
# or TRACE=...) and a synthetic trace (scripts/synth_trace.py) at 300k, 1M and 3M tokens, with Belady's bound, then
# one table and one chart per trace. Results: benchmarks/results/replay/retention/. Policies: POLICIES=... (default
# all). Each replay runs niced and bounded (LIMIT_S seconds, default 1800).
set -uo pipefail
cd "$(dirname "$0")/.."
TRACE=${TRACE:-../shared/data/mooncake/conversation_trace.jsonl}
OUT=benchmarks/results/replay/retention
POLICIES=${POLICIES:-lru slru session density arc}
LIMIT_S=${LIMIT_S:-1800}
mkdir -p "$OUT"
R="timeout $LIMIT_S nice -n 15 .venv/bin/python -m pagedkv.cli replay"
CAPS="--capacity 300k --capacity 1M --capacity 3M"
TMP=$(mktemp -d)
SYNTH="$TMP/synth.jsonl"  # (the chart is named after the trace's file: replay-synth.png)
trap 'rm -rf "$TMP"' EXIT
.venv/bin/python scripts/synth_trace.py "$SYNTH"  # 6,000 requests: chats, few-shot templates, one-off documents
for pol in $POLICIES; do
  $R "$TRACE" $CAPS --bound --bound-block 512 --eviction-policy "$pol" --no-progress \
    --json "$OUT/conversation-$pol.json"
  $R "$SYNTH" $CAPS --bound --eviction-policy "$pol" --no-progress --json "$OUT/synthetic-$pol.json"
done
.venv/bin/python -m pagedkv.replay.report "$OUT"/conversation-*.json --plot "$OUT"
.venv/bin/python -m pagedkv.replay.report "$OUT"/synthetic-*.json --plot "$OUT"
