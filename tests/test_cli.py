"""The `pagedkv` command: the block-manager bench needs no torch; the engine commands load the real model."""

import re

import pytest

from pagedkv.cli import main


def test_bench_suite_quick(capsys, tmp_path):
    assert main(["bench", "--quick", "--workload", "seed", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "seed" in out and "pagedkv" in out
    assert list(tmp_path.glob("bench-*.json"))


@pytest.mark.engine
def test_generate_streams_and_throughput_prints_vllm_style_figures(capsys):
    pytest.importorskip("torch")
    from pagedkv.engine.gguf_loader import ModelNotFoundError, find_default_model

    try:
        find_default_model()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    assert main(["generate", "--max-tokens", "8", "What is the capital of France?"]) == 0
    assert "Paris" in capsys.readouterr().out
    assert main(["bench", "throughput", "--input-len", "16", "--output-len", "4", "--num-prompts", "3",
                 "--num-gpu-blocks", "32"]) == 0
    out = capsys.readouterr().out
    assert "Throughput:" in out and "requests/s" in out and "tokens/s" in out
    # the engine-time split: block manager, the rest of the scheduler, model and sampling, each with its share
    split = next(line for line in out.splitlines() if line.startswith("Engine time:"))
    for part in ("block manager", "scheduler (rest)", "model", "sampling"):
        assert re.search(re.escape(part) + r" [0-9.]+% \(", split), (part, split)


def test_generate_reports_a_missing_model_cleanly(capsys, tmp_path):
    pytest.importorskip("torch")
    assert main(["generate", "--model", str(tmp_path / "nope.gguf"), "hi"]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.engine
def test_chat_keeps_the_conversation(capsys, monkeypatch):
    pytest.importorskip("torch")
    from pagedkv.engine.gguf_loader import ModelNotFoundError, find_default_model

    try:
        find_default_model()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    lines = iter(["What is the capital of France?", "And of Italy?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "Rome" in out


def test_the_command_imports_neither_torch_nor_the_server_stack():
    import subprocess
    import sys

    code = ("import sys, pagedkv.cli; bad = [m for m in ('torch', 'fastapi', 'uvicorn', 'zmq') if m in sys.modules];"
            " sys.exit(str(bad) if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**__import__("os").environ, "PYTHONPATH": __import__("os").pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
