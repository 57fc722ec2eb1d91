"""A fake :class:`pagedkv.server.kv_handoff.KVPort`: the engine side of a prefill/decode split without a model.

Blocks hold deterministic bytes derived from the tokens they cover (so a decode side can check that it read the
right blocks), holds have a lease on an injectable clock, and every call is recorded. Used by
tests/test_kv_handoff.py and tests/test_pd_router.py until the engine implements the port (branches extkv and
tierengine).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from typing import NamedTuple


class FakeHold(NamedTuple):
    hold_id: int
    block_ids: tuple
    num_tokens: int
    expires_at: float


def block_payload(tokens, size: int) -> bytes:
    """The fake KV of a block covering ``tokens``: ``size`` bytes derived from them."""
    seed = hashlib.sha256(repr(tuple(tokens)).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class FakePort:
    """Prefill side: a request marked with ``hold_on_finish`` and later ``finish(request)`` gets a hold of its
    whole prompt blocks before the last token; decode side: ``attach_external`` records the payloads."""

    def __init__(self, block_size: int = 4, payload_bytes: int = 64, weights: str = "fake-model") -> None:
        from pagedkv.tiers import ModelFingerprint

        self.block_size = block_size
        self.payload_bytes = payload_bytes
        self.fingerprint = ModelFingerprint(weights, "float32", block_size, f"fake,{payload_bytes}")
        self.now = 0.0
        self._ids = itertools.count(1)
        self._block_ids = itertools.count(100)
        self._lock = threading.Lock()
        self.marked: dict = {}  # request id -> (tokens, lease)
        self.finished: dict = {}  # request id -> hold
        self.holds: dict = {}  # hold id -> (block ids, payloads, expires_at)
        self.released: list = []
        self.expired: list = []
        self.attached: dict = {}  # request id -> payloads
        self.reads = 0

    # prefill side
    def hold_on_finish(self, request, lease_s):
        self.marked[request.request_id] = (tuple(request.prompt_token_ids), lease_s)

    def finish(self, request_id):
        """The engine finished the request: take its hold (as the block manager's free(hold_for=) would)."""
        tokens, lease = self.marked.pop(request_id)
        n = (len(tokens) - 1) // self.block_size
        if n == 0:
            self.finished[request_id] = None
            return
        ids = tuple(next(self._block_ids) for _ in range(n))
        bs = self.block_size
        payloads = [block_payload(tokens[i * bs:(i + 1) * bs], self.payload_bytes) for i in range(n)]
        hid = next(self._ids)
        with self._lock:
            self.holds[hid] = (ids, payloads, self.now + lease)
        self.finished[request_id] = FakeHold(hid, ids, n * bs, self.now + lease)

    def take_hold(self, request_id):
        return self.finished.pop(request_id, None)

    def read_blocks(self, hold_id, block_ids):
        with self._lock:
            h = self.holds.get(hold_id)
            if h is None:
                raise LookupError(hold_id)
            self.reads += 1
            pos = {b: i for i, b in enumerate(h[0])}
            return [h[1][pos[b]] for b in block_ids]

    def release_hold(self, hold_id):
        with self._lock:
            if self.holds.pop(hold_id, None) is None:
                raise LookupError(hold_id)
            self.released.append(hold_id)

    def expire_holds(self):
        with self._lock:
            gone = [h for h, v in self.holds.items() if v[2] <= self.now]
            for h in gone:
                del self.holds[h]
            self.expired += gone
            return gone

    # decode side
    def attach_external(self, request, payloads, num_blocks=None):
        self.attached[request.request_id] = list(payloads)

    def drop_staged(self, request_id):
        self.attached.pop(request_id, None)


# ---------------------------------------------------------------------------------------------- a fake engine
class ByteTokenizer:
    """One token per UTF-8 byte."""

    vocab_size = 256
    has_chat_template = False

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


class FakeLLM:
    def __init__(self, block_size: int = 4) -> None:
        from types import SimpleNamespace

        self.tokenizer = ByteTokenizer()
        self.max_model_len = 4096
        self.max_num_seqs = 8
        # (the manager's surface the server reads: its settings part and the block size)
        self.block_manager = SimpleNamespace(config=SimpleNamespace(num_gpu_blocks=100_000, watermark_blocks=0),
                                             block_size=block_size)


class FakeRequest:
    _ids = itertools.count(1)

    def __init__(self, ids, params, namespace):
        self.request_id = next(self._ids)
        self.prompt_token_ids = tuple(ids)
        self.params = params
        self.namespace = namespace
        self.priority = 0


class FakeStream:
    """A finished request's stream: one Delta per token, then Finished (the server's RequestStream's shape)."""

    def __init__(self, request, tokens, cached):
        from pagedkv.engine.llm import CompletionOutput, RequestOutput
        from pagedkv.server.async_engine import Delta, Finished

        self.request_id = request.request_id
        self.n = 1
        self.finished = self.aborted = False
        text = "".join(f" t{t}" for t in tokens)
        out = CompletionOutput(0, text, tuple(tokens), "length")
        res = RequestOutput(request.request_id, None, request.prompt_token_ids, (out,), cached)
        self._items = [Delta(0, f" t{t}", 1) for t in tokens[:-1]]
        self._items.append(Finished(res, (Delta(0, f" t{tokens[-1]}", 1),)))

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._items:
            self.finished = True
            raise StopAsyncIteration
        import asyncio

        await asyncio.sleep(0)
        return self._items.pop(0)

    def abort(self):
        self.finished = True


class FakeEngine:
    """The AsyncEngine's face to the app: a request finishes at once with ``max_tokens`` tokens; a prefill for a
    remote decode takes its hold in ``port`` (``port.finish``); ``cached`` (usage) counts the external tokens."""

    def __init__(self, port=None, block_size: int = 4) -> None:
        self.llm = FakeLLM(block_size)
        self.port = port
        self.draining = False
        self.alive = True
        self.submitted = []

    def prepare(self, prompt, params, namespace=None):
        return FakeRequest(prompt["prompt_token_ids"], params, namespace)

    def submit(self, request):
        self.submitted.append(request)
        cached = 0
        if self.port is not None:
            if request.request_id in self.port.marked:
                self.port.finish(request.request_id)
            cached = len(self.port.attached.get(request.request_id, ())) * self.port.block_size
        tokens = [sum(request.prompt_token_ids) % 97 + i for i in range(request.params.max_tokens)]
        return FakeStream(request, tokens, cached)


def fake_server(role: str, port=None, *, block_size: int = 4, **kv):
    """``pagedkv serve``'s app over a :class:`FakeEngine`, served on 127.0.0.1 in a thread: ``(url, engine,
    handoff, close)``. Its ``/metrics`` has the handoff's families (the engine's figures all 0)."""
    from pagedkv.server.app import build_app
    from pagedkv.server.kv_handoff import KVHandoff
    from pagedkv.server.launch import serve_in_thread
    from pagedkv.server.metrics import ServerMetrics

    engine = FakeEngine(port, block_size)
    handoff = KVHandoff(role=role, port=port, **kv)
    metrics = ServerMetrics(dict, "fake")
    metrics.add_kv_handoff(handoff)
    app = build_app(engine, model_name="fake", kv=handoff, metrics=metrics)
    server, thread, number = serve_in_thread(app, "127.0.0.1", 0, f"fake-{role}")
    handoff.port_number = number

    def close():
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{number}", engine, handoff, close


class StorePort(FakePort):
    """A :class:`FakePort` whose engine writes its blocks through to a shared store (``store``: a set of chain
    keys, shared by the ports of replicas on the same store): the store path of docs/pd-split.md. The prefill
    side's write-through is the test's: add the keys to ``store`` (or not)."""

    def __init__(self, store: set, name: str = "kvs-fake", block_size: int = 4, known: set | None = None,
                 **kw) -> None:
        super().__init__(block_size, **kw)
        self.store = store
        self.known = store if known is None else known  # what the engine's write-through hook reported
        self.shared_store = name
        self.stores_through = True
        self.pending = True  # a write-through in flight (False: none that could still put blocks there)
        self.probes = 0

    def store_keys(self, token_ids, namespace, num_blocks):
        from pagedkv import block_hashes

        return list(block_hashes(list(token_ids[: num_blocks * self.block_size]), self.block_size, namespace))

    def in_shared_store(self, keys):
        return all(k in self.known for k in keys)

    def stores_pending(self):
        return self.pending

    def probe_shared(self, keys):
        self.probes += 1
        n = 0
        for k in keys:
            if k not in self.store:
                break
            n += 1
        return n


class StallingPort(FakePort):
    """A prefill side whose block reads after the first batch announce themselves on stdout (``stalled``) and
    never return: a process serving it can be killed mid-body, after the first blocks were sent."""

    def read_blocks(self, hold_id, block_ids):
        import time

        if self.reads >= 1:
            print("stalled", flush=True)
            time.sleep(3600)
        return super().read_blocks(hold_id, block_ids)


if __name__ == "__main__":  # python kv_fakes.py: a prefill replica over a StallingPort; prints "url URL"
    import time

    url, *_ = fake_server("prefill", StallingPort(4), lease_s=600.0)
    print(f"url {url}", flush=True)
    while True:
        time.sleep(60)
