#!/usr/bin/env bash
# Install the anchors (scripts/install_anchors.sh: one virtualenv each), run the block-manager suite for pagedkv,
# then side by side with each anchor, then the ablation (SKIP_ABLATION=1 skips it), the batch-size sweep, the
# single-call benchmark and the cost of KV events. Results: benchmarks/results/*.json, charts in
# benchmarks/results/plots. A workload an anchor cannot finish within PER_RUN_TIMEOUT seconds is reported so.
set -uo pipefail
cd "$(dirname "$0")/.."
T=${PER_RUN_TIMEOUT:-900}
[ -x .venv/bin/python ] || bash scripts/setup.sh
bash scripts/install_anchors.sh  # idempotent: creates or checks the three anchor virtualenvs
REPEATS=${REPEATS:-5}
.venv/bin/python -m pagedkv.bench --repeats "$REPEATS" --plot benchmarks/results/plots --no-progress
for anchor in vllm_v2 vllm_v1 nanovllm; do
  case $anchor in vllm_v2) venv=.venv-anchor-v2;; vllm_v1) venv=.venv-anchor-v1;; nanovllm) venv=.venv-anchor-nano;; esac
  if [ ! -x "$venv/bin/python" ]; then echo "skip $anchor: $venv missing (bash scripts/install_anchors.sh)"; continue; fi
  for wl in seed constrained-recompute constrained-swap prefix-shared prefix-none parallel-n4 spec-decode sliding-window; do
    timeout "$T" "$venv/bin/python" -m pagedkv.bench --impl pagedkv "$anchor" --workload "$wl" --repeats "$REPEATS" \
      --no-progress || echo "$anchor/$wl: did not finish within ${T}s or failed (exit $?)"
  done
done
[ "${SKIP_ABLATION:-0}" = 1 ] || .venv/bin/python -m pagedkv.bench.ablation --json benchmarks/results/ablation.json
# batch-size sweep and single-sequence calls: one run per anchor virtualenv (pagedkv in each), then the merged chart
sweeps=()
for anchor in nanovllm vllm_v2 vllm_v1; do
  case $anchor in vllm_v2) venv=.venv-anchor-v2;; vllm_v1) venv=.venv-anchor-v1;; nanovllm) venv=.venv-anchor-nano;; esac
  [ -x "$venv/bin/python" ] || venv=.venv  # the anchor is then reported as skipped
  before=$(ls benchmarks/results/sweep-*.json 2>/dev/null)
  timeout "$T" "$venv/bin/python" -m pagedkv.bench sweep --impl pagedkv "$anchor" --repeats "$REPEATS" \
    || echo "sweep $anchor: did not finish within ${T}s or failed (exit $?)"
  for f in benchmarks/results/sweep-*.json; do grep -qxF "$f" <<<"$before" || sweeps+=("$f"); done
  timeout "$T" "$venv/bin/python" -m pagedkv.bench single --impl pagedkv "$anchor" --repeats "$REPEATS" \
    || echo "single $anchor: did not finish within ${T}s or failed (exit $?)"
done
[ ${#sweeps[@]} -gt 0 ] && .venv/bin/python -m pagedkv.bench sweep report "${sweeps[@]}" --plot benchmarks/results/plots
PYTHONPATH=src .venv/bin/python benchmarks/events_cost.py  # what KV events cost the batched step
