#!/usr/bin/env bash
# Create .venv-vllm: vLLM 0.33.0 installed without its CUDA dependencies, for the compatibility suite
# (tests/compat/, docs/compat.md), which runs vLLM's own code in it: its KV-event classes and ZmqEventPublisher
# (vllm.distributed.kv_events), its prefix-cache hashing (vllm.v1.core.kv_cache_utils, vllm.utils.hashing) and
# `vllm bench serve`.
#
# usage: bash scripts/setup_vllm_compat.sh
#   FORCE=1   delete and recreate the virtualenv
#   PYTHON=   interpreter to build it with (default python3.11)
#
# vLLM is installed with --no-deps beside the CPU torch (torch==2.13.0+cpu: a local version only the CPU wheel
# carries, so pip never substitutes a CUDA build), plus the packages that importing those modules needs
# (vllm.distributed.kv_events pulls in vllm.config), at pinned versions. xgrammar is installed with --no-deps too
# (its triton dependency is a 1 GB CUDA compiler that nothing here uses). The virtualenv also gets this
# repository in editable mode (--no-deps). Idempotent: a virtualenv whose pins are in place and whose vLLM
# modules import is left as it is. Takes a few minutes on a fresh machine (wheels from the package index).
set -euo pipefail
# this virtualenv has pins of its own: scripts/setup.sh's constraints (exported for the main .venv) do not apply
unset PIP_CONSTRAINT

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3.11}
VENV=$ROOT/.venv-vllm

# what scripts/install_anchors.sh's vLLM 0.33 anchor needs (vllm.utils, vllm.v1.*, zmq, cbor2, xxhash)
BASE=(numpy==2.4.6 xxhash==4.1.0 torch==2.13.0+cpu msgspec==0.23.0 pydantic==2.14.4 psutil==7.2.2 packaging==26.4
      typing_extensions==4.16.0 pyzmq==27.3.0 regex==2026.11.19 cbor2==6.3.0 cloudpickle==3.1.3 uvloop==0.23.0
      py-cpuinfo==9.0.0 requests==2.34.2 prometheus_client==0.26.0)
# vllm.config (imported by vllm.distributed.kv_events) and the modules it loads
CONFIG=(transformers==5.25.0 aiohttp==3.14.5 openai-harmony==0.0.8 openai==3.63.0 pillow==13.0.0 pybase64==1.5.1
        cachetools==8.0.3 fastapi==0.165.0 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1
        apache-tvm-ffi==0.1.15.post2)
# `vllm bench serve` (the vllm command imports its server entry points) and the tokenizer it needs, written from
# the GGUF file's metadata by transformers (gguf)
BENCH=(einops==0.8.2 uvicorn==0.55.0 watchfiles==1.3.0 orjson==3.13.0 gguf==0.19.0)
NODEPS=(xgrammar==0.2.9 vllm==0.33.0)
# the modules the suite runs; their import is the readiness check (about 15-25 s)
CHECK='import vllm.distributed.kv_events, vllm.v1.core.kv_cache_utils, vllm.utils.hashing, vllm.benchmarks.serve, pagedkv; print("vllm", vllm.__version__)'

say() { printf '[setup_vllm_compat] %s\n' "$*"; }

# pip, quiet, with the reports about the deliberately missing dependencies (--no-deps) and the local index's
# notes filtered out; pip's exit status is kept.
pip_q() {
    local rc=0
    nice -n 5 "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
        | grep -vE "which is not installed|but you have .* which is incompatible|dependency resolver does not currently|dependency conflicts|is ignored: it is neither" \
        || true
    rc=${PIPESTATUS[0]}
    return "$rc"
}

pins_ok() {  # every name==version installed: prints what is not and fails
    "$VENV/bin/python" "$ROOT/scripts/check_pins.py" "$@"
}

no_cuda() {
    if "$VENV/bin/python" -m pip list 2>/dev/null | grep -qiE '^nvidia-|^triton '; then
        say "ERROR: $VENV holds CUDA packages (nvidia-*/triton); recreate it with FORCE=1"
        return 1
    fi
    "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else "torch is a CUDA build")'
}

imports_ok() {  # prints the version line, or the import's error output and fails
    local err out rc=0
    err=$(mktemp)
    out=$(cd / && "$VENV/bin/python" -c "$CHECK" 2>"$err") || rc=$?
    if [[ $rc != 0 ]]; then
        cat "$err"
        rm -f "$err"
        return "$rc"
    fi
    rm -f "$err"
    printf '%s\n' "$out" | tail -n 1
}

PINS=("${BASE[@]}" "${CONFIG[@]}" "${BENCH[@]}" "${NODEPS[@]}")
start=$SECONDS
if [[ ${FORCE:-0} == 1 && -d $VENV ]]; then
    say "FORCE=1, removing $VENV"
    rm -rf "$VENV"
fi
if [[ -x $VENV/bin/python ]]; then
    if why=$(pins_ok "${PINS[@]}") && got=$(imports_ok) && no_cuda; then
        say "$VENV is up to date ($got); nothing to do"
        exit 0
    fi
    say "$VENV exists but needs work: ${why:-the vLLM modules do not import}"
else
    say "creating $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
say "installing ${#BASE[@]} + ${#CONFIG[@]} + ${#BENCH[@]} pinned packages"
pip_q "${BASE[@]}" "${CONFIG[@]}" "${BENCH[@]}"
say "installing ${NODEPS[*]} with --no-deps"
pip_q --no-deps "${NODEPS[@]}"
say "installing pagedkv from $ROOT (editable, --no-deps)"
pip_q --no-deps -e "$ROOT"
no_cuda
if ! why=$(pins_ok "${PINS[@]}"); then
    say "ERROR: pinned packages not in place: $why"
    exit 1
fi
if ! got=$(imports_ok); then
    say "ERROR: the vLLM modules do not import:"
    printf '%s\n' "$got" >&2
    exit 1
fi
say "ready: $got in $VENV ($(du -sh "$VENV" | cut -f1), $((SECONDS - start)) s)"
