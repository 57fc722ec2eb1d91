"""The router never imports torch: importing its modules and building its prompt tokenizer from the GGUF file's
metadata (the ``gguf`` package alone) must not even try. Checked in a fresh interpreter with an import hook that
refuses torch, so the check means the same whether torch is installed or not; a control run proves the hook
catches an import of torch that does happen."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

HOOK = textwrap.dedent("""
    import sys

    class RefuseTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                print("TORCH IMPORTED", flush=True)
                raise ImportError("torch is refused in this check")
            return None

    sys.meta_path.insert(0, RefuseTorch())
""")

ROUTER = textwrap.dedent("""
    import pagedkv.cli, pagedkv.router.app, pagedkv.router.cli, pagedkv.router.events, pagedkv.router.health
    import pagedkv.router.metrics, pagedkv.router.proxy, pagedkv.router.state
    from pagedkv.router.prompt import PromptBuilder, load_tokenizer

    builder = PromptBuilder(load_tokenizer(), 16)
    p = builder.build("chat", b'{"messages": [{"role": "user", "content": "Hello there, how are you today?"}]}')
    assert len(p.token_ids) > 16 and p.hashes, p
    assert builder.build("completions", b'{"prompt": "The capital of France is"}').token_ids
    assert "torch" not in sys.modules
    print("OK", flush=True)
""")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HOOK + code], capture_output=True, text=True, timeout=120)


def test_importing_the_router_and_building_its_tokenizer_does_not_import_torch():
    from pagedkv.engine.gguf_loader import ModelNotFoundError, find_default_model

    try:
        find_default_model()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    r = run(ROUTER)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr
    control = run("import pagedkv.engine.model\n")  # the engine does import torch: the hook must catch it
    assert control.returncode != 0 and "TORCH IMPORTED" in control.stdout
