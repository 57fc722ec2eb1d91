"""The KV connector: the one seam through which KV enters and leaves the engine (docs/kv-connector.md).

A connector has a **scheduler side** (what is available outside for a request, what to reserve, what to store, a
request gone) and a **worker side** (move the bytes: start loads into reserved blocks, write staged payloads,
snapshot blocks to store, wait for completions), as vLLM's ``KVConnectorBase_V1`` splits the two; here both
halves run in the engine's process and thread, so one object implements both. Implemented once each by the
storage tiers (:class:`pagedkv.engine.kv_tiers.EngineTiers`: the disk tier and the shared tiers, Redis or a
directory, over one :class:`~pagedkv.tiers.TierConnector`) and the prefill/decode handoff
(:class:`pagedkv.engine.kv_port.EngineKVPort`: the decode side loads from a prefill replica, the prefill side
holds).

:class:`~pagedkv.engine.core.EngineCore` keeps its connectors in one :class:`KVConnectors` (None when it has
none: a plain request then calls no connector code) and calls only the methods below, all on the step loop's
thread, between or inside steps::

    add_request      on_add        (in order; the first connector that claims the request owns its load)
    add failed       forget
    every step       poll          (before the schedule: lookups, loads and stores that finished are reported)
                     start_loads   (after the step's copy plan: the loads of the blocks this step reserved)
                     write_loads   (before the forward: payloads staged for the step's prefills)
                     on_blocks_filled (before the forward: the content of the blocks this step fills)
                     store_computed (after the forward and sampling: what the step computed, to store or hold)
    idle             wait          (nothing can run but requests wait for KV)
                     stores_pending (the idle server settles writes in flight)
    close            close

Every method is O(its own work): a connector with nothing in flight returns at once.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["KVConnector", "KVConnectorScheduler", "KVConnectorWorker", "KVConnectors"]


class KVConnectorScheduler:
    """The scheduler side: decides what crosses the seam. Abstract: :meth:`on_add` and :meth:`poll`."""

    def on_add(self, request_id: Any, token_ids: Sequence[int], namespace: Any, block_manager: Any) -> bool:
        """A request is being added (before the scheduler sees it). The connector starts finding how many of the
        prompt's tokens past the block manager's own hit it can provide (vLLM's ``get_num_new_matched_tokens``,
        asynchronous here: the answer comes through :meth:`poll`). True: it claims the request's load, and the
        request waits for KV (``wait_for_kv``) until :meth:`poll` reports it ready; False: not its request.
        Never blocks on I/O."""
        raise NotImplementedError

    def poll(self, scheduler: Any) -> int:
        """Before each step's schedule (and on an idle server): report what finished. A claimed request's match
        -> ``scheduler.kv_ready(rid, start, num_tokens, reserve=...)`` (the tokens to allocate as external, the
        reservation vLLM's ``update_state_after_alloc`` records); a load that ended -> ``scheduler.kv_loaded``
        (all, or the good leading tokens: the rest is computed); a store that ended ->
        ``block_manager.external.complete_store`` (vLLM's ``get_finished``). Returns how many requests became ready."""
        raise NotImplementedError

    def forget(self, request_id: Any) -> None:
        """A request this connector was told of left before its load began (its add failed; vLLM's
        ``request_finished``): drop what is kept for it. A request aborted later needs no call: :meth:`poll` sees
        it gone from the scheduler. O(1)."""

    def stores_pending(self) -> bool:
        """Whether writes are in flight or finished and not yet reported by :meth:`poll`. Thread-safe. O(1)."""
        return False


class KVConnectorWorker:
    """The worker side: moves the bytes. Abstract: :meth:`start_loads` and :meth:`store_computed`."""

    def start_loads(self, kv_loads: Sequence) -> list:
        """After the copy plan of the step that reserved them (vLLM's ``start_load_kv``): start loading the
        ``StepPlan.kv_loads`` this connector claimed into their reserved blocks (written as they arrive, from the
        next :meth:`poll` on). Returns the loads it did not take (the next connector's). Never blocks on I/O."""
        raise NotImplementedError

    def write_loads(self, plan: Any, kv_cache: Any) -> None:
        """Before the step's forward (vLLM's ``wait_for_layer_load``, for the whole model at once): payloads staged
        for the plan's prefills written into their external blocks. Default: nothing staged."""

    def on_blocks_filled(self, plan: Any, scheduler: Any, requests: dict) -> None:
        """Before the step's forward: the content (tokens) of the blocks the step fills, which a later store plan
        names. ``requests``: request id -> :class:`~pagedkv.engine.core.Request`. Default: nothing to learn."""

    def store_computed(self, plan: Any, kv_cache: Any, requests: dict) -> None:
        """After the step's forward and sampling (vLLM's ``save_kv_layer`` + ``wait_for_save``, asynchronous
        here): take what the step computed that this connector keeps (the block manager's store plan, a hold
        for a remote decode) and snapshot those blocks; the writes complete off the step loop and are reported
        by :meth:`poll`."""
        raise NotImplementedError

    def wait(self, timeout: float) -> bool:
        """Nothing can run but requests wait for KV: block up to ``timeout`` seconds for a transfer of this
        connector to finish. False at once when it has nothing in flight (default)."""
        return False

    def close(self, timeout: float = 30.0) -> None:
        """Finish the writes in flight (at most ``timeout`` seconds) and release what the connector holds."""


class KVConnector(KVConnectorScheduler, KVConnectorWorker):
    """A KV connector: both sides (see the module docstring for who calls each method, when)."""


class KVConnectors(KVConnector):
    """The engine's connectors, in order, as one (immutable: adding one builds a new :class:`KVConnectors`).
    :meth:`on_add` asks each until one claims the request; :meth:`start_loads` hands each the loads the ones
    before it left; :meth:`wait` lets the first one with transfers in flight wait (briefly when others follow,
    so that theirs are not delayed); every other call goes to each. O(connectors) per call."""

    def __init__(self, connectors: Sequence[KVConnector]) -> None:
        for c in connectors:
            if not isinstance(c, KVConnector):
                raise TypeError(f"a KV connector implements pagedkv.engine.connector.KVConnector, got {c!r}")
        self._all = tuple(connectors)

    @property
    def connectors(self) -> tuple:
        """The connectors, in the order they are asked."""
        return self._all

    def __len__(self) -> int:
        return len(self._all)

    def with_connector(self, connector: KVConnector, first: bool = False) -> "KVConnectors":
        """These connectors and ``connector`` (asked first when ``first``); unchanged if it is one of them."""
        if any(c is connector for c in self._all):
            return self
        return KVConnectors((connector,) + self._all if first else self._all + (connector,))

    def on_add(self, request_id: Any, token_ids: Sequence[int], namespace: Any, block_manager: Any) -> bool:
        return any(c.on_add(request_id, token_ids, namespace, block_manager) for c in self._all)

    def poll(self, scheduler: Any) -> int:
        return sum(c.poll(scheduler) for c in self._all)

    def forget(self, request_id: Any) -> None:
        for c in self._all:
            c.forget(request_id)

    def stores_pending(self) -> bool:
        return any(c.stores_pending() for c in self._all)

    def start_loads(self, kv_loads: Sequence) -> list:
        left = list(kv_loads)
        for c in self._all:
            if not left:
                break
            left = c.start_loads(left)
        return left

    def write_loads(self, plan: Any, kv_cache: Any) -> None:
        for c in self._all:
            c.write_loads(plan, kv_cache)

    def on_blocks_filled(self, plan: Any, scheduler: Any, requests: dict) -> None:
        for c in self._all:
            c.on_blocks_filled(plan, scheduler, requests)

    def store_computed(self, plan: Any, kv_cache: Any, requests: dict) -> None:
        for c in self._all:
            c.store_computed(plan, kv_cache, requests)

    def wait(self, timeout: float) -> bool:
        last = len(self._all) - 1
        for i, c in enumerate(self._all):
            if c.wait(timeout if i == last else min(timeout, _SHARE_S)):
                for rest in self._all[i + 1:]:  # (theirs that finished meanwhile are polled next step)
                    rest.wait(0.0)
                return True
        return False

    def close(self, timeout: float = 30.0) -> None:
        for c in self._all:
            c.close(timeout)


#: the longest a connector waits while another one follows it in :meth:`KVConnectors.wait` (seconds)
_SHARE_S = 0.005
