#!/usr/bin/env bash
# Create the virtualenvs of the engine-speed anchors (benchmarks/engine_speed.py), never needed by pagedkv itself:
#
#   .venv-hf        HF transformers' generate: transformers, accelerate (transformers refuses GGUF without it),
#                   gguf and the CPU torch wheel
#   .venv-llamacpp  llama.cpp through llama-cpp-python, built from source for this CPU (GGML_NATIVE=ON);
#                   the build compiles llama.cpp: ~30 min on 2 busy cores, so it runs under nice
#
# usage: bash scripts/install_engine_anchors.sh [hf] [llamacpp]      (no argument: both)
#   FORCE=1   delete and recreate the named virtualenvs
#   PYTHON=   interpreter to build them with (default python3.11)
#   JOBS=     parallel compile jobs of the llama.cpp build (default 1: the machine is shared)
# Idempotent: a virtualenv whose packages import is left as it is.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3.11}
HF_PKGS=(torch==2.13.0 transformers==5.24.0 accelerate==1.15.0 gguf==0.19.0 numpy==2.4.6 xxhash==4.1.0)
LLAMACPP_PKGS=(llama-cpp-python==0.3.36 numpy==2.4.6 xxhash==4.1.0)

say() { printf '[install_engine_anchors] %s\n' "$*"; }

make_venv() {  # make_venv DIR: (re)create it when FORCE=1 or missing
    local venv=$1
    if [[ ${FORCE:-0} == 1 && -d $venv ]]; then
        say "FORCE=1: removing $venv"
        rm -rf "$venv"
    fi
    [[ -x $venv/bin/python ]] || { say "creating $venv with $($PYTHON --version 2>&1)"; "$PYTHON" -m venv "$venv"; }
}

install_hf() {
    local venv=$ROOT/.venv-hf
    make_venv "$venv"
    if "$venv/bin/python" -c 'import transformers, accelerate, gguf, torch, xxhash; assert torch.version.cuda is None' 2>/dev/null; then
        say "hf: $venv is ready; nothing to do"
        return 0
    fi
    say "hf: installing ${HF_PKGS[*]}"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${HF_PKGS[@]}"
    "$venv/bin/python" -c 'import transformers, torch; print("hf: ready: transformers", transformers.__version__, "torch", torch.__version__)'
}

install_llamacpp() {
    local venv=$ROOT/.venv-llamacpp
    make_venv "$venv"
    if "$venv/bin/python" -c 'import llama_cpp, xxhash' 2>/dev/null; then
        say "llamacpp: $venv is ready; nothing to do"
        return 0
    fi
    command -v cmake >/dev/null && command -v g++ >/dev/null || { say "llamacpp: needs cmake and g++ (apt-get install cmake g++)"; return 1; }
    say "llamacpp: building ${LLAMACPP_PKGS[*]} from source (GGML_NATIVE=ON, ${JOBS:-1} job(s), nice 10)"
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-1} \
        nice -n 10 "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
        --no-binary llama-cpp-python "${LLAMACPP_PKGS[@]}"
    "$venv/bin/python" -c 'import llama_cpp; print("llamacpp: ready: llama-cpp-python", llama_cpp.__version__)'
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(hf llamacpp)
for t in "${targets[@]}"; do
    case $t in
        hf) install_hf ;;
        llamacpp) install_llamacpp ;;
        *) say "unknown target '$t' (use hf, llamacpp)"; exit 2 ;;
    esac
done
