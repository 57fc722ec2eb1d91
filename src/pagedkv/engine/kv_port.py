"""The engine's side of a prefill/decode split: :class:`EngineKVPort`, the ``KVPort`` of
:mod:`pagedkv.server.kv_handoff` over an :class:`~pagedkv.engine.LLM` (docs/pd-split.md).

Built on the block manager's external KV (docs/external-kv.md: ``hold``, ``release_hold``, ``expire_holds``;
``allocate(num_external_tokens=)`` through the scheduler's waiting-for-KV state) and the engine's block payloads
(:mod:`.kv_io`: ``read_blocks`` / ``write_blocks``, ``model_fingerprint``). It plugs into the step loop where the
storage tiers do (``llm.kv_tiers``: the tiers' calls are passed on to the engine's own tiers, if any), so the
engine's code is unchanged:

- **prefill side**: a request marked by :meth:`EngineKVPort.hold_on_finish` is held in the step whose forward
  computes its prompt's last chunk (after the forward, before the step's update frees the finished request):
  ``block_manager.hold(seq, lease)``; :meth:`take_hold` hands the hold over, cut to the prompt's whole blocks
  before its last token. Blocks are read (:meth:`read_blocks`) and holds released or expired under the engine's
  step lock, so a hold can never be released (and its blocks reused) while its blocks are being copied out.
- **decode side**: :meth:`attach_external` stages the payloads read from the prefill replica; when the request is
  added it waits for KV (``wait_for_kv``) and is ready at the next step (``kv_ready`` of tokens ``[0, n * bs)``);
  the step that admits it writes the payloads into its external blocks before the forward, and computes the rest.

KV cache groups (Gemma 3: ``HybridBlockManager``, whose external loads are not implemented) are refused with
ValueError.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Sequence

from ..errors import PagedKVError
from .kv_io import model_fingerprint, payload_bytes, read_blocks, write_external

__all__ = ["EngineKVPort"]


class _Held(NamedTuple):
    hold_id: int
    block_ids: tuple
    num_tokens: int
    expires_at: float


class EngineKVPort:
    """See the module docstring. ``lock``: the engine's step lock (``AsyncEngine._lock``), held by whoever
    steps the engine; the port takes it to read held blocks and to release or expire holds."""

    def __init__(self, llm: Any, lock: Any = None) -> None:
        bm = llm.block_manager
        if getattr(llm, "kv_cache_groups", None) is not None or not hasattr(bm, "hold"):
            raise ValueError("a prefill/decode split needs a model with one KV cache group (KV handed over to a "
                             "model with KV cache groups, such as Gemma 3, is not implemented)")
        self._llm = llm
        self._bm = bm
        self._kv = llm.kv_cache
        self._fingerprint = None  # (computed on first use: it reads the weights file once)
        self.block_size = int(bm.block_size)
        self.payload_bytes = payload_bytes(llm.kv_cache)
        self._lock = lock if lock is not None else threading.Lock()
        self._marked: dict = {}  # request id -> lease (prefill side, until its prompt is computed)
        self._held: dict = {}  # request id -> _Held, until take_hold
        self._staged: dict = {}  # request id -> payloads (decode side, until the request is added)
        self._adding: dict = {}  # request id -> payloads (added, waiting for kv_ready)
        self._ready: dict = {}  # request id -> (0, payloads) (until its first prefill)
        self._inner = llm.kv_tiers  # the engine's own storage tiers (None without)
        self.stats = {"held": 0, "blocks_read": 0, "loaded": 0, "written_blocks": 0}
        llm.kv_tiers = self

    @property
    def inner(self) -> Any:
        """The engine's own storage tiers (:class:`pagedkv.engine.kv_tiers.EngineTiers`) this port passes the tiers'
        calls on to, or None without tiers."""
        return self._inner

    # ------------------------------------------------------------------------------------ KVPort (server side)
    @property
    def fingerprint(self) -> Any:
        """The :class:`pagedkv.tiers.ModelFingerprint` of this engine's KV blocks (weights, dtype, block size,
        layout)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self._llm.model, self._kv)
        return self._fingerprint

    def hold_on_finish(self, request: Any, lease_s: float) -> None:
        self._marked[request.request_id] = float(lease_s)

    def take_hold(self, request_id: Any) -> _Held | None:
        self._marked.pop(request_id, None)
        return self._held.pop(request_id, None)

    def read_blocks(self, hold_id: Any, block_ids: Sequence[int]) -> list:
        with self._lock:
            if not any(h.hold_id == hold_id for h in self._bm.holds):
                raise LookupError(f"hold {hold_id} is gone")
            out = read_blocks(self._kv, list(block_ids))
        self.stats["blocks_read"] += len(out)
        return out

    def release_hold(self, hold_id: Any) -> None:
        with self._lock:
            self._bm.release_hold(hold_id)  # (UnknownHoldError is a LookupError)

    def expire_holds(self) -> list:
        with self._lock:
            return list(self._bm.expire_holds())

    def attach_external(self, request: Any, payloads: Sequence) -> None:
        self._staged[request.request_id] = list(payloads)

    def drop_staged(self, request_id: Any) -> None:
        self._staged.pop(request_id, None)

    # ------------------------------------------------------------------------------------ the step loop's calls
    def on_add(self, request_id: Any, token_ids: Any, namespace: Any, block_manager: Any) -> bool:
        payloads = self._staged.pop(request_id, None)
        if payloads:
            self._adding[request_id] = payloads
            return True
        return self._inner.on_add(request_id, token_ids, namespace, block_manager) if self._inner else False

    def poll(self, scheduler: Any) -> int:
        n = 0
        if self._adding:
            adding, self._adding = self._adding, {}
            for rid, payloads in adding.items():
                try:
                    ok = scheduler.kv_ready(rid, 0, len(payloads) * self.block_size)
                except PagedKVError:  # (a range the server's checks exclude) the prompt is computed
                    ok = scheduler.kv_ready(rid, 0, 0)
                    payloads = None
                if ok:
                    n += 1
                    if payloads:
                        self._ready[rid] = (0, payloads)  # (the prompt's blocks from block 0)
                        self.stats["loaded"] += 1
        if self._ready:
            for rid in [rid for rid in self._ready if not scheduler.has_request(rid)]:
                del self._ready[rid]  # (aborted before its admission)
        return n + (self._inner.poll(scheduler) if self._inner else 0)

    def forget(self, request_id: Any) -> None:
        for d in (self._staged, self._adding, self._ready, self._marked, self._held):
            d.pop(request_id, None)
        if self._inner:
            self._inner.forget(request_id)

    def wait(self, timeout: float) -> None:
        if self._inner and not self._adding:
            self._inner.wait(timeout)

    def write_loads(self, plan: Any, kv_cache: Any) -> None:
        if self._ready:
            self.stats["written_blocks"] += write_external(plan, kv_cache, self._ready, self.block_size)
        if self._inner:
            self._inner.write_loads(plan, kv_cache)

    def store_computed(self, plan: Any, kv_cache: Any, by_id: dict) -> None:
        if self._marked:
            bs = self.block_size
            for pw in plan.prefills:
                lease = self._marked.get(pw.request_id)
                if lease is None or not pw.num_samples:  # (not the prompt's last chunk yet)
                    continue
                del self._marked[pw.request_id]
                req = by_id.get(pw.request_id)
                n = (len(req.prompt_token_ids) - 1) // bs if req is not None else 0
                if n <= 0:
                    self._held[pw.request_id] = None
                    continue
                h = self._bm.hold(pw.seq_id, lease)
                self._held[pw.request_id] = _Held(h.hold_id, tuple(h.block_ids[:n]), n * bs, h.expires_at)
                self.stats["held"] += 1
        if self._inner:
            self._inner.store_computed(plan, kv_cache, by_id)

    def take_events(self) -> list:
        return self._inner.take_events() if self._inner else []

    def snapshot(self) -> Any:
        return self._inner.snapshot() if self._inner else None

    def close(self, timeout: float = 30.0) -> None:
        if self._inner:
            self._inner.close(timeout)
