"""The table of hostile requests of the fault-injection suite (docs/reliability.md lists it with the answers).

Each row: ``(name, route, body bytes, content type, status, param)``. ``route`` is ``"completions"`` or ``"chat"``;
``status`` the answer ``pagedkv serve`` gives (and the router, which validates with the same module); ``param``
the field the error names (None: the body as a whole). Sizes suit a server with the default 2 MiB body limit and
SmolLM2's 8192-token context. Imported by tests/test_validation.py (no model) and tests/engine/test_serve_faults.py.
"""

from __future__ import annotations

import json

JSON = "application/json"


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def completion(**fields) -> bytes:
    return body(prompt="Hello", max_tokens=2, **fields)


def chat(**fields) -> bytes:
    return body(messages=[{"role": "user", "content": "Hi"}], max_tokens=2, **fields)


def _raw(prefix: str, value: str, suffix: str = "}") -> bytes:
    return (prefix + value + suffix).encode()


HOSTILE = [
    # non-finite and overflowing numbers (Python's JSON reads NaN / Infinity; 1e400 overflows to inf)
    ("temperature NaN", "completions", b'{"prompt": "Hello", "temperature": NaN}', JSON, 400, "temperature"),
    ("temperature Infinity", "completions", b'{"prompt": "Hello", "temperature": Infinity}', JSON, 400,
     "temperature"),
    ("top_p -Infinity", "chat", b'{"messages": [{"role": "user", "content": "Hi"}], "top_p": -Infinity}', JSON, 400,
     "top_p"),
    ("temperature 1e400", "completions", b'{"prompt": "Hello", "temperature": 1e400}', JSON, 400, "temperature"),
    ("presence_penalty NaN", "chat", b'{"messages": [{"role": "user", "content": "Hi"}], "presence_penalty": NaN}',
     JSON, 400, "presence_penalty"),
    # denormals: a temperature below 1e-5 samples greedily (documented); a tiny top_p keeps the top token
    ("temperature 1e-45 (greedy)", "completions", completion(temperature=1e-45), JSON, 200, None),
    ("top_p 5e-324", "completions", completion(top_p=5e-324, temperature=1.0), JSON, 200, None),
    # huge integers
    ("seed 2**70", "completions", completion(seed=2**70), JSON, 400, "seed"),
    ("seed -2**64", "completions", completion(seed=-(2**64)), JSON, 400, "seed"),
    ("max_tokens 10**30", "completions", body(prompt="Hello", max_tokens=10**30), JSON, 400, "max_tokens"),
    ("n 10**6", "completions", completion(n=10**6), JSON, 400, "n"),
    ("top_k 10**20", "completions", completion(top_k=10**20), JSON, 400, "top_k"),
    ("token id 2**63", "completions", body(prompt=[1, 2**63], max_tokens=2), JSON, 400, "prompt"),
    ("stop_token_ids -1", "completions", completion(stop_token_ids=[-1]), JSON, 400, "stop_token_ids"),
    ("integer of 5000 digits", "completions", _raw('{"prompt": "Hello", "seed": ', "9" * 5000), JSON, 400, None),
    # wrong types
    ("temperature as a string", "completions", completion(temperature="0.5"), JSON, 400, "temperature"),
    ("max_tokens as a float", "completions", body(prompt="Hello", max_tokens=8.0), JSON, 400, "max_tokens"),
    ("stream as a string", "completions", completion(stream="yes"), JSON, 400, "stream"),
    ("n as a boolean", "completions", completion(n=True), JSON, 400, "n"),
    ("prompt as an object", "completions", body(prompt={"text": "hi"}), JSON, 400, "prompt"),
    ("stop as a number", "completions", completion(stop=5), JSON, 400, "stop"),
    ("messages as a string", "chat", body(messages="hi"), JSON, 400, "messages"),
    ("user content null", "chat", body(messages=[{"role": "user", "content": None}]), JSON, 400,
     "messages.[0].content"),
    ("unknown role", "chat", body(messages=[{"role": "robot", "content": "x"}]), JSON, 400, "messages.[0].role"),
    ("image content part", "chat", body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), JSON,
     400, "messages.[0].content.[0]"),
    ("a body that is an array", "completions", b"[1, 2]", JSON, 400, None),
    ("not JSON at all", "completions", b"{not json", JSON, 400, None),
    # unknown and unsupported fields (OpenAI refuses unknown ones)
    ("unknown field", "completions", completion(frobnicate=1), JSON, 400, "frobnicate"),
    ("unknown message field", "chat", body(messages=[{"role": "user", "content": "x", "mood": "sad"}]), JSON, 400,
     "messages.[0].mood"),
    ("logprobs 5", "completions", completion(logprobs=5), JSON, 400, "logprobs"),
    ("tools", "chat", chat(tools=[{"type": "function", "function": {"name": "f"}}]), JSON, 400, "tools"),
    ("stream_options without stream", "completions", completion(stream_options={"include_usage": True}), JSON,
     400, "stream_options"),
    # sizes
    ("a 3 MiB body", "completions", completion(user="x" * (3 * 2**20)), JSON, 413, None),
    ("a million token ids", "completions", body(prompt=[1] * 1_000_000), JSON, 413, None),
    ("100k token ids", "completions", json.dumps({"prompt": [1] * 100_000}, separators=(",", ":")).encode(), JSON,
     400, "prompt"),
    ("a 1.5 MB prompt", "completions", body(prompt="ab " * 500_000), JSON, 400, "prompt"),
    ("5000 stop strings", "completions", completion(stop=[f"s{i}" for i in range(5000)]), JSON, 400, "stop"),
    ("a 100 kB stop string", "completions", completion(stop="z" * 100_000), JSON, 400, "stop"),
    ("a 10 kB cache_salt", "completions", completion(cache_salt="s" * 10_000), JSON, 400, "cache_salt"),
    ("5000 messages", "chat", body(messages=[{"role": "user", "content": "x"}] * 5000), JSON, 400, "messages"),
    ("nested 100k deep", "completions", b"[" * 100_000 + b"]" * 100_000, JSON, 400, None),
    ("nested 50k deep in a field", "completions", _raw('{"prompt": "Hello", "stop": ', "[" * 50_000 + "]" * 50_000),
     JSON, 400, None),
    # encodings
    ("invalid UTF-8", "completions", b'{"prompt": "\xff\xfe\xfd"}', JSON, 400, None),
    ("lone surrogate prompt", "completions", b'{"prompt": "\\ud800 hi"}', JSON, 400, "prompt"),
    ("lone surrogate cache_salt", "completions", b'{"prompt": "hi", "cache_salt": "\\udfff"}', JSON, 400,
     "cache_salt"),
    ("lone surrogate model", "completions", b'{"prompt": "hi", "model": "\\ud800"}', JSON, 400, "model"),
    ("Content-Type text/plain", "completions", completion(), "text/plain", 415, None),
]
