"""vLLM's tokenizer routes' bodies (:mod:`pagedkv.server.tokenization`) and the chat field vLLM prefers
(``max_completion_tokens`` over ``max_tokens``), without a model: a small fake tokenizer stands in for the GGUF
one (the routes over the real model and the router: tests/engine/test_serve_vllm_compat.py)."""

from __future__ import annotations

import json

import pytest

from pagedkv.server.tokenization import detokenize, parse_detokenize, parse_tokenize, tokenize
from pagedkv.server.validation import APIError, Limits, parse_chat

LIMITS = Limits(max_model_len=64, vocab_size=300, max_prompt_chars=10)


class ByteTokenizer:
    """One id per byte, BOS 256 added with the special tokens; a ChatML-like template."""

    vocab_size = 300
    has_chat_template = True

    def encode(self, text, *, add_special_tokens=False):
        ids = list(text.encode())
        return [256, *ids] if add_special_tokens else ids

    def decode(self, ids, *, skip_special_tokens=False):
        return "".join("<s>" if i == 256 else chr(i) for i in ids)

    def id_to_token(self, i):
        return "<s>" if i == 256 else chr(i)

    def render_chat(self, messages, *, add_generation_prompt=True):
        out = "".join(f"<{m['role']}>{m['content']}</end>\n" for m in messages)
        return out + ("<assistant>" if add_generation_prompt else "")


def bad(parse, body, limits=LIMITS):
    with pytest.raises(APIError) as info:
        parse(json.dumps(body).encode(), limits)
    assert info.value.status == 400
    return info.value


def test_a_completion_with_vllm_defaults_and_flags():
    tok = ByteTokenizer()
    r = parse_tokenize(b'{"model": "m", "prompt": "hi"}', LIMITS)
    assert (r.model, r.prompt, r.add_special_tokens, r.return_token_strs) == ("m", "hi", True, False)
    assert tokenize(r, tok, 64) == {"count": 3, "max_model_len": 64, "tokens": [256, 104, 105], "token_strs": None}
    r = parse_tokenize(b'{"prompt": "hi", "add_special_tokens": false, "return_token_strs": true}', LIMITS)
    assert tokenize(r, tok, 64) == {"count": 2, "max_model_len": 64, "tokens": [104, 105], "token_strs": ["h", "i"]}
    # as in vLLM, a prompt past the context (or past max_prompt_chars) is tokenized: count tells the client
    r = parse_tokenize(json.dumps({"prompt": "x" * 100}).encode(), LIMITS)
    assert tokenize(r, tok, 64)["count"] == 101
    assert tokenize(parse_tokenize(b'{"prompt": ""}', LIMITS), tok, 64)["tokens"] == [256]


def test_a_chat_renders_the_template_without_special_tokens_by_default():
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there  "}]
    r = parse_tokenize(json.dumps({"messages": msgs}).encode(), LIMITS)
    assert r.add_generation_prompt and not r.continue_final_message and not r.add_special_tokens
    text = "<user>hi</end>\n<assistant>Hello there  </end>\n"
    assert detokenize(parse_detokenize(json.dumps({"tokens": tokenize(r, tok, 64)["tokens"]}).encode(), LIMITS),
                      tok) == {"prompt": text + "<assistant>"}
    r = parse_tokenize(json.dumps({"messages": msgs, "add_generation_prompt": False,
                                   "add_special_tokens": True}).encode(), LIMITS)
    assert tokenize(r, tok, 64)["tokens"] == [256, *text.encode()]
    # continue_final_message: the rendering stops right after the final message's text (its trailing spaces too)
    r = parse_tokenize(json.dumps({"messages": msgs, "continue_final_message": True,
                                   "add_generation_prompt": False}).encode(), LIMITS)
    assert tok.decode(tokenize(r, tok, 64)["tokens"]) == "<user>hi</end>\n<assistant>Hello there  "
    # neutral values of the fields not implemented are accepted
    r = parse_tokenize(json.dumps({"messages": msgs, "tools": [], "chat_template_kwargs": {},
                                   "chat_template": None, "mm_processor_kwargs": None}).encode(), LIMITS)
    assert tokenize(r, tok, 64)["count"] == len(text) + len("<assistant>")


def test_a_template_that_does_not_render_the_final_text_cannot_be_continued():
    class Upper(ByteTokenizer):
        def render_chat(self, messages, *, add_generation_prompt=True):
            return super().render_chat([{**m, "content": m["content"].upper()} for m in messages],
                                       add_generation_prompt=add_generation_prompt)

    r = parse_tokenize(json.dumps({"messages": [{"role": "user", "content": "go on"}],
                                   "continue_final_message": True, "add_generation_prompt": False}).encode(), LIMITS)
    with pytest.raises(APIError) as info:
        tokenize(r, Upper(), 64)
    assert info.value.status == 400 and info.value.param == "messages"


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ({"prompt": ["a"]}, "prompt"),
    ({"prompt": [1, 2]}, "prompt"),
    ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),  # a chat field on a completion
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
    ({"prompt": "a", "model": 3}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False}},
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "media_io_kwargs": {"image": {}}}, "media_io_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "bogus": 1}, "bogus"),
])
def test_bad_tokenize_bodies_get_a_400_naming_the_field(body, param):
    assert bad(parse_tokenize, body).param == param


@pytest.mark.parametrize("body, param", [
    ({}, "tokens"),
    ({"tokens": "1 2"}, "tokens"),
    ({"tokens": [1, "2"]}, "tokens.[1]"),
    ({"tokens": [1, True]}, "tokens.[1]"),
    ({"tokens": [1, 2.0]}, "tokens.[1]"),
    ({"tokens": [-1]}, "tokens"),
    ({"tokens": [300]}, "tokens"),  # past the vocabulary
    ({"tokens": [1], "prompt": "x"}, "prompt"),
])
def test_bad_detokenize_bodies_get_a_400_naming_the_field(body, param):
    assert bad(parse_detokenize, body).param == param


def test_detokenize_keeps_special_tokens_and_takes_an_empty_list():
    tok = ByteTokenizer()
    assert detokenize(parse_detokenize(b'{"model": "m", "tokens": [256, 104, 105]}', LIMITS), tok) == \
        {"prompt": "<s>hi"}
    assert detokenize(parse_detokenize(b'{"tokens": []}', LIMITS), tok) == {"prompt": ""}
    assert parse_detokenize(b'{"tokens": [1000000]}', Limits()).tokens == (1000000,)  # (a router: no vocabulary)


def test_chat_takes_max_completion_tokens_over_max_tokens_as_vllm_does():
    msgs = [{"role": "user", "content": "hi"}]
    one = parse_chat(json.dumps({"messages": msgs, "max_tokens": 3}).encode(), LIMITS)
    both = parse_chat(json.dumps({"messages": msgs, "max_tokens": 3, "max_completion_tokens": 5}).encode(), LIMITS)
    assert one.max_tokens == 3 and both.max_tokens == 5 and both.sampling_kwargs(16)["max_tokens"] == 5
    # each is still checked for type and range
    assert bad(parse_chat, {"messages": msgs, "max_tokens": 3, "max_completion_tokens": 0}).param == \
        "max_completion_tokens"
    assert bad(parse_chat, {"messages": msgs, "max_tokens": "3", "max_completion_tokens": 5}).param == "max_tokens"
    assert bad(parse_chat, {"messages": msgs, "max_completion_tokens": 65}).param == "max_completion_tokens"
