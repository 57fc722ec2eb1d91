#!/usr/bin/env bash
# Create the virtualenvs of the benchmark anchors (see src/pagedkv/bench/anchors/__init__.py):
#
#   .venv-anchor-v2    vLLM 0.6.3.post1 block manager v2   (SelfAttnBlockSpaceManager)
#   .venv-anchor-v1    vLLM 0.33.0 V1 KVCacheManager
#   .venv-anchor-nano  nano-vllm-fork BlockManager
#
# usage: bash scripts/install_anchors.sh [v2] [v1] [nano]      (no argument: all three)
#   FORCE=1   delete and recreate the named virtualenvs
#   PYTHON=   interpreter to build them with (default python3.11)
#
# The engines are installed with --no-deps: only the few packages their block-manager modules import
# are added, and torch is the CPU build (torch==2.13.0+cpu: a local version that only a CPU wheel
# carries, so pip can never substitute a CUDA build for it).  Each virtualenv also gets numpy, xxhash
# and this repository in editable mode (--no-deps), so `import pagedkv` works there.  Idempotent: a
# virtualenv whose pinned packages are in place and whose anchor loads is left as it is.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3.11}

COMMON=(numpy==2.4.6 xxhash==4.1.0)
TORCH=(torch==2.13.0+cpu)
# imported at module level by the vLLM modules both anchors load (vllm.utils, vllm.sequence or
# vllm.v1.request, vllm.sampling_params)
VLLM_BASE=("${TORCH[@]}" msgspec==0.23.0 pydantic==2.14.4 psutil==7.2.2 packaging==26.4 typing_extensions==4.16.0)
# vLLM 0.6.3: vllm.utils also imports yaml
V2_DEPS=("${VLLM_BASE[@]}" PyYAML==6.0.4)
V2_ENGINE=(vllm==0.6.3.post1)
# vLLM 0.33: vllm.distributed.kv_events (zmq), vllm.utils.* (regex, cbor2, requests/urllib3),
# vllm.v1.utils (uvloop, cloudpickle, cpuinfo via vllm.usage), vllm.v1.metrics (prometheus_client)
V1_DEPS=("${VLLM_BASE[@]}" pyzmq==27.3.0 regex==2026.11.19 cbor2==6.3.0 cloudpickle==3.1.3 uvloop==0.23.0
         py-cpuinfo==9.0.0 requests==2.34.2 prometheus_client==0.26.0)
V1_ENGINE=(vllm==0.33.0)
# nanovllm.engine.block_manager needs numpy and xxhash only (no torch: its package __init__ is skipped)
NANO_DEPS=()
NANO_ENGINE=(nano-vllm-fork==20260210)

say() { printf '[install_anchors] %s\n' "$*"; }

# pip, with the dependency-conflict report about the engines' deliberately missing dependencies
# (installed with --no-deps) filtered out; pip's exit status is kept.
pip_q() {
    local venv=$1; shift
    local rc=0
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
        | grep -vE "which is not installed|but you have .* which is incompatible|dependency resolver does not currently|dependency conflicts|^WARNING: Location .* is ignored" \
        || true
    rc=${PIPESTATUS[0]}
    return "$rc"
}

# true when every "name==version" of the arguments is installed in the venv
pins_ok() {
    local venv=$1; shift
    "$venv/bin/python" "$ROOT/scripts/check_pins.py" "$@"
}

anchor_ok() {  # the anchor loads and pagedkv is the one of this checkout
    local venv=$1 anchor=$2
    (cd / && "$venv/bin/python" - "$anchor" "$ROOT" <<'EOF'
import os, sys
import pagedkv
root = os.path.realpath(sys.argv[2])
if not os.path.realpath(pagedkv.__file__).startswith(root + os.sep):
    sys.exit(f"pagedkv comes from {pagedkv.__file__}, not {root}")
from pagedkv.bench.anchors import load_anchor
A = load_anchor(sys.argv[1])
print(A.name)
EOF
    )
}

no_cuda_torch() {
    local venv=$1
    if "$venv/bin/python" -m pip list 2>/dev/null | grep -qiE '^nvidia-|^triton '; then
        say "ERROR: $venv holds CUDA packages (nvidia-*/triton); recreate it with FORCE=1"
        return 1
    fi
    if "$venv/bin/python" -c 'import importlib.util,sys; sys.exit(0 if importlib.util.find_spec("torch") is None else 1)'; then
        return 0
    fi
    "$venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else "torch is a CUDA build")'
}

install_one() {
    local target=$1 venv anchor
    local -a deps engine
    case $target in
        v2) venv=$ROOT/.venv-anchor-v2; anchor=vllm_v2; deps=("${V2_DEPS[@]}"); engine=("${V2_ENGINE[@]}") ;;
        v1) venv=$ROOT/.venv-anchor-v1; anchor=vllm_v1; deps=("${V1_DEPS[@]}"); engine=("${V1_ENGINE[@]}") ;;
        nano) venv=$ROOT/.venv-anchor-nano; anchor=nanovllm; deps=(${NANO_DEPS[@]+"${NANO_DEPS[@]}"}); engine=("${NANO_ENGINE[@]}") ;;
        *) say "unknown target '$target' (use v2, v1, nano)"; return 2 ;;
    esac
    local -a pins=("${COMMON[@]}" ${deps[@]+"${deps[@]}"} "${engine[@]}")

    if [[ ${FORCE:-0} == 1 && -d $venv ]]; then
        say "$target: FORCE=1, removing $venv"
        rm -rf "$venv"
    fi
    if [[ -x $venv/bin/python ]]; then
        local why
        if why=$(pins_ok "$venv" "${pins[@]}") && name=$(anchor_ok "$venv" "$anchor" 2>&1) && no_cuda_torch "$venv"; then
            say "$target: $venv is up to date ($name); nothing to do"
            return 0
        fi
        say "$target: $venv exists but needs work: ${why:-anchor does not load}"
    else
        say "$target: creating $venv with $($PYTHON --version 2>&1)"
        "$PYTHON" -m venv "$venv"
    fi

    say "$target: installing ${COMMON[*]} ${deps[*]-}"
    pip_q "$venv" "${COMMON[@]}" ${deps[@]+"${deps[@]}"}
    say "$target: installing ${engine[*]} with --no-deps"
    pip_q "$venv" --no-deps "${engine[@]}"
    say "$target: installing pagedkv from $ROOT (editable, --no-deps)"
    pip_q "$venv" --no-deps -e "$ROOT"

    no_cuda_torch "$venv"
    local why
    if ! why=$(pins_ok "$venv" "${pins[@]}"); then
        say "ERROR: $target: pinned packages not in place: $why"
        return 1
    fi
    local name
    if ! name=$(anchor_ok "$venv" "$anchor" 2>&1); then
        say "ERROR: $target: the anchor does not load:"
        printf '%s\n' "$name" >&2
        return 1
    fi
    say "$target: ready: $name in $venv ($(du -sh "$venv" | cut -f1))"
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(v2 v1 nano)
for t in "${targets[@]}"; do
    install_one "$t"
done
