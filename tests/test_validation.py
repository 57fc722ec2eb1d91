"""``pagedkv.server.validation`` without a model or a web server: the hostile table's 4xx rows are refused by the
parser itself, naming the field at fault in OpenAI's style, and good bodies keep their meaning."""

from __future__ import annotations

import json

import pytest

from hostile_inputs import HOSTILE
from pagedkv.server.validation import (GREEDY_TEMPERATURE, APIError, Limits, check_content_type, parse_chat,
                                       parse_completion)

LIMITS = Limits(max_model_len=8192, vocab_size=49152, max_prompt_chars=8192 * 48, max_n=16)


@pytest.mark.parametrize("row", [r for r in HOSTILE if r[4] in (400, 415)], ids=lambda r: r[0])
def test_hostile_rows_are_refused_by_the_parser(row):
    name, route, body, ctype, status, param = row
    parse = parse_chat if route == "chat" else parse_completion
    with pytest.raises(APIError) as info:
        check_content_type(ctype)
        parse(body, LIMITS)
    e = info.value
    assert e.status == status and e.param == param, (e.status, e.param, e.message)
    assert e.type == "invalid_request_error" and e.message
    for internal in ("SamplingParams", "pydantic", "Traceback", "str]", "ValidationError"):
        assert internal not in e.message, e.message


def test_good_bodies_keep_their_meaning():
    r = parse_completion(json.dumps({"prompt": "hi", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                                     "top_k": 40, "seed": 2**64 - 1, "n": 2, "stop": ["a", "b"],
                                     "stream": True, "stream_options": {"include_usage": True},
                                     "cache_salt": "t", "user": "u", "ignore_eos": True}).encode(), LIMITS)
    kw = r.sampling_kwargs(16)
    assert kw == dict(n=2, temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1, max_tokens=5, ignore_eos=True,
                      stop=("a", "b"), stop_token_ids=())
    assert r.stream and r.include_usage and r.cache_salt == "t" and r.prompt_input() == "hi"
    assert parse_completion(b'{"prompt": [[1, 2, 3]]}', LIMITS).prompt_input() == {"prompt_token_ids": [1, 2, 3]}
    assert parse_completion(b'{"prompt": "x", "temperature": 1e-6}', LIMITS).sampling_kwargs(1)["temperature"] == 0
    assert parse_completion(b'{"prompt": "x", "temperature": 2}', LIMITS).sampling_kwargs(1)["temperature"] == 2
    assert GREEDY_TEMPERATURE == 1e-5
    c = parse_chat(json.dumps({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                {"type": "text", "text": "b"}]},
                                            {"role": "user", "content": "hi", "name": "bob"}],
                               "max_completion_tokens": 7, "response_format": {"type": "text"},
                               "metadata": {"k": "v"}, "store": False}).encode(), LIMITS)
    assert c.conversation() == [{"role": "system", "content": "ab"}, {"role": "user", "content": "hi"}]
    assert c.max_tokens == 7 and c.sampling_kwargs(99)["max_tokens"] == 7


def test_content_types():
    for ok in (None, "", "application/json", "application/json; charset=utf-8", "application/vnd.api+json"):
        check_content_type(ok)
    for bad in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        with pytest.raises(APIError) as info:
            check_content_type(bad)
        assert info.value.status == 415


def test_limits_are_configurable():
    small = Limits(max_stop=1, max_cache_salt_chars=3, max_n=2, max_model_len=10, vocab_size=5)
    for body, param in ((b'{"prompt": "x", "stop": ["a", "b"]}', "stop"),
                        (b'{"prompt": "x", "cache_salt": "abcd"}', "cache_salt"),
                        (b'{"prompt": "x", "n": 3}', "n"),
                        (b'{"prompt": "x", "max_tokens": 11}', "max_tokens"),
                        (b'{"prompt": [5]}', "prompt"),
                        (b'{"prompt": [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]}', "prompt")):
        with pytest.raises(APIError) as info:
            parse_completion(body, small)
        assert info.value.param == param, body
    assert parse_completion(b'{"prompt": [4], "n": 2, "cache_salt": "abc"}', small).n == 2


def test_priority_field():
    """vLLM's request ``priority``: an int, 0 by default, lower is more urgent; anything else is a clear 400."""
    assert parse_completion(b'{"prompt": "x"}', LIMITS).priority == 0
    assert parse_completion(b'{"prompt": "x", "priority": -3}', LIMITS).priority == -3
    assert parse_chat(b'{"messages": [{"role": "user", "content": "x"}], "priority": 7}', LIMITS).priority == 7
    for bad in (b'"high"', b"1.5", b"true", b"null", str(2**40).encode()):
        with pytest.raises(APIError) as e:
            parse_completion(b'{"prompt": "x", "priority": ' + bad + b"}", LIMITS)
        assert e.value.status == 400 and "priority" in str(e.value.message if hasattr(e.value, "message") else e.value)
