"""The vLLM side of the compatibility suite: runs in .venv-vllm (scripts/setup_vllm_compat.sh), never in the main
virtualenv, and uses vLLM 0.33's own code only (its KV-event classes, ZmqEventPublisher, hashing functions).

    python vllm_side.py replay REPLAY_ENDPOINT TOPIC   < nothing   > JSON
        asks a pagedkv publisher's replay socket for everything from 0 as a vLLM subscriber does (DEALER,
        [b"", start]), decodes every payload with vLLM's KVEventBatch decoder, publishes the decoded batches
        again through a real vLLM ZmqEventPublisher on the same topic and asks its replay socket the same way:
        prints both answers' frames (hex) and a summary of each decoded event.
    python vllm_side.py hashes                         < JSON cases > JSON
        vLLM's block hashes of each case {tokens, block_size, algo, seed, cache_salt, lora, mm}: its own request
        block hasher (get_request_block_hasher) over a request object carrying those fields.
    python vllm_side.py tokenizer GGUF_FILE OUT_DIR
        writes the GGUF model's tokenizer as a Hugging Face tokenizer directory (for vllm bench serve).
    python vllm_side.py tokenize URL MODEL
        POST /tokenize (a prompt, with token strings, chat messages) and /detokenize to a server at URL, each request
        built with vLLM's own request class and each answer parsed with its response class.
    python vllm_side.py stub PORT PUB_ENDPOINT REPLAY_ENDPOINT BLOCK_SIZE ALGO MODEL
        a vLLM replica stub on 127.0.0.1:PORT: /health, /v1/models, /v1/completions (token-id prompts); each
        completion's prefix-cache hit is computed with vLLM's hashing against the blocks it holds, then its full
        blocks are stored and published as BlockStored through vLLM's ZmqEventPublisher. The answer carries the
        hit in usage.prompt_tokens_details.cached_tokens (as vLLM reports it).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

TIMEOUT_MS = 30000  # (a loaded 2-core machine)


def _dealer_replay(ctx, endpoint: str, start: int = 0) -> list:
    """Every answer frame list of a replay from ``start``, as vLLM's subscribers ask it, until the end marker."""
    import zmq

    from vllm.distributed.kv_events import ZmqEventPublisher

    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    s.connect(endpoint)
    s.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            frames = s.recv_multipart()
            out.append(frames)
            if ZmqEventPublisher.END_SEQ in frames[-2:-1]:
                return out
    finally:
        s.close(0)


def _summary(e) -> dict:
    d = {"type": type(e).__name__}
    for f in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
              "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"):
        if hasattr(e, f):
            v = getattr(e, f)
            if f == "extra_keys" and v is not None:
                v = [None if k is None else list(k) for k in v]
            d[f] = v
    return d


def cmd_replay(endpoint: str, topic: str) -> dict:
    import msgspec
    import zmq

    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    ctx = zmq.Context.instance()
    ours = _dealer_replay(ctx, endpoint)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)  # as vLLM's example subscriber decodes
    batches = [decoder.decode(frames[-1]) for frames in ours[:-1]]
    # the same batches through vLLM's own publisher (PUB on ipc, bound; replay on a free loopback port)
    # (a port found with a plain socket, closed at once; zmq's own close is asynchronous, so a port it held may
    # still be taken when the publisher binds it: a few tries, each on a fresh port)
    for attempt in range(5):
        pub_ep = f"ipc:///tmp/pagedkv-compat-{os.getpid()}-{attempt}-pub"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=f"tcp://127.0.0.1:{port}", topic=topic)
            break
        except zmq.error.ZMQError:
            if attempt == 4:
                raise
            time.sleep(0.2)
    try:
        for b in batches:
            pub.publish(b)
        deadline = time.monotonic() + 60
        while len(pub._buffer) < len(batches) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pub._buffer) == len(batches), f"vLLM's publisher sent {len(pub._buffer)} of {len(batches)}"
        theirs = _dealer_replay(ctx, f"tcp://127.0.0.1:{port}")
    finally:
        pub.shutdown()
    return {"ours": [[f.hex() for f in fr] for fr in ours], "vllm": [[f.hex() for f in fr] for fr in theirs],
            "events": [[_summary(e) for e in b.events] for b in batches],
            "ranks": [b.data_parallel_rank for b in batches]}


def _request(tokens, cache_salt=None, lora=None, mm=()):
    """An object with the fields vLLM's request block hasher reads (vllm.v1.request.Request's)."""
    feats = [SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n)) for i, o, n in mm]
    lreq = None if lora is None else SimpleNamespace(lora_name=lora[0], lora_path=lora[1], name=lora[0],
                                                      adapter_id=1)
    return SimpleNamespace(block_hashes=[], all_token_ids=list(tokens), num_tokens=len(tokens), mm_features=feats,
                           lora_request=lreq, cache_salt=cache_salt, prompt_embeds=None,
                           _prompt_embeds_per_block_hashes={})


def _hasher(block_size: int, algo: str, seed):
    """vLLM's request block hasher for (algo, seed): NONE_HASH set as vLLM sets it at start-up."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as ku

    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = str(seed)
    fn = get_hash_fn_by_name(algo)
    ku.init_none_hash(fn)
    return ku.get_request_block_hasher(block_size, fn)


def cmd_hashes(cases: list) -> list:
    from vllm.v1.core import kv_cache_utils as ku

    out = []
    for c in cases:
        h = _hasher(c["block_size"], c["algo"], c.get("seed"))
        req = _request(c["tokens"], c.get("cache_salt"), c.get("lora"), [tuple(m) for m in c.get("mm", [])])
        digests = h(req)
        out.append({"digests": [bytes(d).hex() for d in digests], "none_hash": bytes(ku.NONE_HASH).hex(),
                    "event_keys": [ku.maybe_convert_block_hash(d) for d in digests]})
    return out


def cmd_stub(port: int, pub_ep: str, replay_ep: str, block_size: int, algo: str, model: str) -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
    from vllm.v1.core import kv_cache_utils as ku

    hasher = _hasher(block_size, algo, os.environ.get("PYTHONHASHSEED"))
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv-events")
    cached: set = set()
    lock = threading.Lock()
    stats = {"requests": 0, "hits": []}

    def complete(body: dict) -> dict:
        tokens = [int(t) for t in body["prompt"]]
        req = _request(tokens, body.get("cache_salt"))
        digests = hasher(req)
        with lock:
            hit = 0
            for d in digests[:max(len(tokens) - 1, 0) // block_size]:  # vLLM computes at least one token
                if d not in cached:
                    break
                hit += 1
            new = [i for i, d in enumerate(digests) if d not in cached]
            cached.update(digests)
            stats["requests"] += 1
            stats["hits"].append(hit * block_size)
            if new:
                a = new[0]
                pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                    block_hashes=[ku.maybe_convert_block_hash(d) for d in digests[a:]],
                    parent_block_hash=ku.maybe_convert_block_hash(digests[a - 1]) if a else None,
                    token_ids=tokens[a * block_size:len(digests) * block_size], block_size=block_size,
                    lora_id=None, medium="GPU", lora_name=None,
                    extra_keys=[(body["cache_salt"],) if i == 0 and body.get("cache_salt") else None
                                for i in range(a, len(digests))] if body.get("cache_salt") else None,
                    group_idx=0)]))
        return {"id": "cmpl-stub", "object": "text_completion", "model": model,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": len(tokens), "completion_tokens": 1, "total_tokens": len(tokens) + 1,
                          "prompt_tokens_details": {"cached_tokens": hit * block_size}}}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code: int, doc) -> None:
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
            elif self.path == "/stub/stats":
                with lock:
                    self._send(200, {**stats, "blocks": len(cached)})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            if self.path != "/v1/completions":
                self._send(404, {"error": "not found"})
                return
            self._send(200, complete(body))

    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    try:
        srv.serve_forever()
    finally:
        pub.shutdown()


def cmd_tokenizer(gguf_path: str, out_dir: str) -> dict:
    """A Hugging Face tokenizer directory (tokenizer.json, its config, the chat template) written by transformers
    from the GGUF file's metadata: what ``vllm bench serve --tokenizer`` loads."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tok.save_pretrained(out_dir)
    return {"vocab": len(tok), "hello": tok("Hello world")["input_ids"]}


def cmd_tokenize(url: str, model: str) -> dict:
    """Requests built with vLLM's own tokenizer-route request classes, sent to ``url``; each answer parsed with
    vLLM's response class, its keys compared with the class's fields."""
    import urllib.error
    import urllib.request

    from vllm.entrypoints.serve.tokenize.protocol import (DetokenizeRequest, DetokenizeResponse,
                                                          TokenizeChatRequest, TokenizeCompletionRequest,
                                                          TokenizeResponse)

    def post(route: str, req, resp_cls) -> dict:
        data = json.dumps(req.model_dump(exclude_unset=True)).encode()
        q = urllib.request.Request(url + route, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(q, timeout=60) as r:
                status, body = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            status, body = e.code, json.loads(e.read() or b"{}")
        parsed = resp_cls.model_validate(body).model_dump() if status == 200 else None
        return {"status": status, "keys": sorted(body), "fields": sorted(resp_cls.model_fields), "parsed": parsed}

    prompt = post("/tokenize", TokenizeCompletionRequest(model=model, prompt="The capital of France is"),
                  TokenizeResponse)
    strs = post("/tokenize", TokenizeCompletionRequest(model=model, prompt="Hello there", return_token_strs=True),
                TokenizeResponse)
    chat = post("/tokenize", TokenizeChatRequest(model=model, messages=[{"role": "user", "content": "Hi!"}]),
                TokenizeResponse)
    detok = post("/detokenize", DetokenizeRequest(model=model, tokens=prompt["parsed"]["tokens"]),
                 DetokenizeResponse)
    return {"prompt": prompt, "strs": strs, "chat": chat, "detok": detok}


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "replay":
        print(json.dumps(cmd_replay(sys.argv[2], sys.argv[3])))
    elif cmd == "tokenizer":
        print(json.dumps(cmd_tokenizer(sys.argv[2], sys.argv[3])))
    elif cmd == "tokenize":
        print(json.dumps(cmd_tokenize(sys.argv[2], sys.argv[3])))
    elif cmd == "hashes":
        print(json.dumps(cmd_hashes(json.load(sys.stdin))))
    elif cmd == "stub":
        p, pub_ep, rep_ep, bs, algo, model = sys.argv[2:8]
        cmd_stub(int(p), pub_ep, rep_ep, int(bs), algo, model)
    else:
        sys.exit(f"unknown command {cmd!r}")
