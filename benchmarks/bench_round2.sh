#!/usr/bin/env bash
# Round-two rerun (after the manager split, burst sharing, KV events, the small-batch path, the LRU log and the CPU
# tier): the pagedkv suite, every workload side by side with each anchor, the batch-size sweep and single-call
# benchmarks, and the cost of KV events. The ablation is unchanged from round one (benchmarks/run_all.sh runs all).
set -uo pipefail
cd "$(dirname "$0")/.."
T=${PER_RUN_TIMEOUT:-900}
REPEATS=${REPEATS:-5}
.venv/bin/python -m pagedkv.bench --repeats "$REPEATS" --plot benchmarks/results/plots --no-progress
for anchor in vllm_v2 vllm_v1 nanovllm; do
  case $anchor in vllm_v2) venv=.venv-anchor-v2;; vllm_v1) venv=.venv-anchor-v1;; nanovllm) venv=.venv-anchor-nano;; esac
  [ -x "$venv/bin/python" ] || { echo "skip $anchor: $venv missing (bash scripts/install_anchors.sh)"; continue; }
  for wl in seed constrained-recompute constrained-swap prefix-shared prefix-none parallel-n4 spec-decode sliding-window; do
    timeout "$T" "$venv/bin/python" -m pagedkv.bench --impl pagedkv "$anchor" --workload "$wl" --repeats "$REPEATS" \
      --no-progress || echo "$anchor/$wl: did not finish within ${T}s or failed (exit $?)"
  done
done
sweeps=()
for anchor in nanovllm vllm_v2 vllm_v1; do
  case $anchor in vllm_v2) venv=.venv-anchor-v2;; vllm_v1) venv=.venv-anchor-v1;; nanovllm) venv=.venv-anchor-nano;; esac
  before=$(ls benchmarks/results/sweep-*.json 2>/dev/null)
  timeout "$T" "$venv/bin/python" -m pagedkv.bench sweep --impl pagedkv "$anchor" --repeats "$REPEATS" \
    || echo "sweep $anchor: failed (exit $?)"
  for f in benchmarks/results/sweep-*.json; do grep -qxF "$f" <<<"$before" || sweeps+=("$f"); done
  timeout "$T" "$venv/bin/python" -m pagedkv.bench single --impl pagedkv "$anchor" --repeats "$REPEATS" \
    || echo "single $anchor: failed (exit $?)"
done
[ ${#sweeps[@]} -gt 0 ] && .venv/bin/python -m pagedkv.bench sweep report "${sweeps[@]}" --plot benchmarks/results/plots
PYTHONPATH=src .venv/bin/python benchmarks/events_cost.py
