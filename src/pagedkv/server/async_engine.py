"""``AsyncEngine``: one background thread runs an :class:`~pagedkv.engine.LLM`'s step loop for many clients.

Contract:

* :meth:`AsyncEngine.prepare` validates a prompt (tokenises it, checks it against the context and the KV cache)
  and raises a ``pagedkv.errors`` exception without changing any state when it can never run.
* :meth:`AsyncEngine.submit` queues a prepared request and returns its :class:`RequestStream`; it raises
  :class:`EngineOverloaded` (and queues nothing) when ``max_waiting`` requests already wait for admission.
* The engine thread applies new requests and aborts only between two steps (the scheduler's contract), so an
  abort that arrives while a step runs is applied right after it; the aborted request's blocks are freed then.
* Each step's new text of every running sample is pushed to its request's asyncio queue (thread-safely, on
  the loop that submitted it); text is decoded in the engine thread with the same rules as ``LLM``: a piece is
  held back while it ends in an incomplete UTF-8 sequence or could be the start of a stop string, and the
  final text of a sample is exactly ``LLM.generate``'s (stop strings cut, special tokens skipped).
* Fault isolation. An error that one request causes fails that request alone: its stream ends with
  :class:`RequestFailed`, it is aborted (its blocks freed) and the engine goes on. That covers a request the
  scheduler refuses when it is added, a sampler that raises for one request (the engine core's
  ``StepOutput.faults``), and text decoding of one request. A forward pass that raises cannot be pinned on one
  request: the step is completed with
  placeholder tokens and every request of the step fails, the others go on. After any fault the block manager's
  invariants are checked. Only a fault that leaves the engine unusable (the scheduler itself raising, a failed
  invariant, a failed recovery) stops it: every request in flight fails, :attr:`alive` turns False (/health
  answers 503), new requests are refused, and ``on_fatal(message)`` is called (``pagedkv serve`` exits non-zero
  so that a supervisor restarts it).
* The engine is driven through its core's public API only (:class:`pagedkv.engine.core.EngineCore`:
  ``make_request``, ``add_request``, ``abort``, ``step``, ``has_unfinished``, ``wait_for_loads``).
* :meth:`between_steps` runs a caller's function with the engine between two steps (``pagedkv serve``'s pins).
* :meth:`drain` (SIGTERM): new requests are refused (:class:`EngineDraining`), the requests in flight run to
  their end for up to ``timeout`` seconds, the rest then fail with a clean error.
* :attr:`AsyncEngine.snapshot` holds counters and gauges as of the end of the last loop iteration (for
  /metrics); latency observations go to the optional ``observer`` (``observer(kind, seconds)``, kind one of
  ``"ttft"``, ``"itl"``, ``"e2e"``), called from the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import PromptTooLongError
from ..scheduler import FINISH_ABORT

__all__ = ["AsyncEngine", "EngineOverloaded", "EngineDraining", "EngineDead", "RequestFailed", "RequestStream",
           "Delta", "Finished"]

log = logging.getLogger("pagedkv.server")


class EngineOverloaded(Exception):
    """The waiting queue is full: the request was not queued (the server answers 503)."""


class EngineDead(Exception):
    """The engine thread failed or was stopped."""


class EngineDraining(EngineDead):
    """The server is shutting down: no new request is taken (the server answers 503)."""


class RequestFailed(Exception):
    """This request failed inside the engine (a server fault, not the client's); the engine goes on."""


@dataclass(frozen=True)
class Delta:
    """New output of one sample: ``text`` (possibly empty while text is held back) and ``num_tokens`` tokens."""

    index: int
    text: str
    num_tokens: int


@dataclass(frozen=True)
class Finished:
    """The request finished: ``result`` is the ``pagedkv.engine.RequestOutput`` (texts as ``LLM.generate``'s),
    ``deltas`` the last pieces of text of each sample not yet sent (one per sample)."""

    result: Any
    deltas: tuple


@dataclass(frozen=True)
class Failed:
    message: str
    fatal: bool = True  # the engine stopped (EngineDead) rather than this request alone failing (RequestFailed)


_ABORTED = object()  # wakes a consumer waiting on an aborted stream
_SETTLE_S = 0.05  # idle with tier writes in flight: how often they are accounted


class RequestStream:
    """The consumer side of one request: iterate it (``async for``) for :class:`Delta` items; the last item is
    a :class:`Finished` (or the iteration raises :class:`EngineDead`)."""

    def __init__(self, engine: "AsyncEngine", request: Any) -> None:
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.n = request.params.n
        self.finished = False
        self.aborted = False
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    def _push(self, item: Any) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Delta | Finished:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _ABORTED:
            raise StopAsyncIteration
        if isinstance(item, Failed):
            self.finished = True
            raise (EngineDead if item.fatal else RequestFailed)(item.message)
        if isinstance(item, Finished):
            self.finished = True
        return item

    async def result(self) -> Finished:
        """Wait for the end of the request."""
        async for item in self:
            if isinstance(item, Finished):
                return item
        raise EngineDead("stream ended without a result")

    def abort(self) -> None:
        """Abort the request unless it finished (idempotent; call it on the loop that submitted the request).
        The engine frees its blocks after its current step; an iteration waiting on this stream ends."""
        if not self.finished:
            self.finished = True
            self.aborted = True
            self._engine.abort(self.request_id)
            self._queue.put_nowait(_ABORTED)


@dataclass
class _Live:
    """Engine-thread state of one request."""

    req: Any  # pagedkv.engine.core.Request
    stream: RequestStream
    arrival: float
    sent_text: list = field(default_factory=list)  # per sample: text already pushed
    sent_tokens: list = field(default_factory=list)  # per sample: tokens already accounted
    first: float | None = None
    last: float | None = None


class AsyncEngine:
    """Runs ``llm`` (a :class:`pagedkv.engine.LLM`, or its :class:`~pagedkv.engine.core.EngineCore`) in a
    background thread; see the module docstring.

    Args:
        llm: the engine; nothing else may call its generate/chat/stream while this runs.
        max_waiting: most requests waiting for admission (queued here or in the scheduler's waiting queue).
        observer: ``observer(kind, seconds)`` for latency histograms (engine thread).
        event_sink: ``event_sink(events)`` receives the block manager's KV events after every step (when the
            block manager has ``take_events``).
    """

    def __init__(self, llm: Any, *, max_waiting: int = 256, observer: Callable[[str, float], None] | None = None,
                 event_sink: Callable[[list], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.llm = llm
        #: the engine core this drives (``llm.core``, or ``llm`` itself when it is one)
        self.core = getattr(llm, "core", llm)
        self.max_waiting = int(max_waiting)
        self._observer = observer
        self._event_sink = event_sink
        self._take_events = self.core.block_manager.events.take if event_sink is not None else None
        self._lock = threading.Lock()  # held by the engine thread while it touches the scheduler
        self._cond = threading.Condition()
        self._adds: list[_Live] = []
        self._aborts: list[Any] = []
        self._live: dict[Any, _Live] = {}
        self._in_transit = 0  # requests taken from _adds and not yet in _live
        self._stopping = False
        self._draining = False
        self._error: str | None = None
        self._on_fatal = on_fatal
        self._faults = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished: dict[str, int] = {}
        self.snapshot: dict = {}
        self._take_snapshot()
        self._thread = threading.Thread(target=self._loop, name="pagedkv-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------------------- client side
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def draining(self) -> bool:
        """True once :meth:`drain` began: new requests are refused."""
        return self._draining

    @property
    def faults(self) -> int:
        """Requests failed by a fault of their own (or of their step) while the engine went on."""
        return self._faults

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished or aborted (queued here or in the scheduler)."""
        with self._cond:
            return len(self._adds) + self._in_transit + len(self._live)

    def prepare(self, prompt: str | Mapping, params: Any, namespace: Any = None) -> Any:
        """Validate and tokenise one prompt (blocking: call it with ``asyncio.to_thread``); raises
        ``pagedkv.errors.PagedKVError`` for a request that can never run: besides ``LLM``'s checks, one whose
        prompt plus ``max_tokens`` would not fit in the whole KV cache (it would be preempted forever). Changes
        no engine state, and reads only the pool's fixed sizes, so it runs while a step does."""
        req = self.core.make_request(prompt, params, namespace=namespace, check_fit=False)
        bm = self.core.block_manager
        usable = bm.config.num_gpu_blocks - bm.config.watermark_blocks
        need = -(-(len(req.prompt_token_ids) + params.max_tokens) // bm.block_size)
        if need > usable:
            raise PromptTooLongError(
                f"prompt of {len(req.prompt_token_ids)} tokens plus max_tokens={params.max_tokens} needs {need} KV "
                f"blocks of {bm.block_size} tokens; the KV cache has {usable}"
            )
        return req

    def submit(self, request: Any) -> RequestStream:
        """Queue a prepared request (call from the event loop); raises :class:`EngineOverloaded` or
        :class:`EngineDead` and queues nothing when it cannot be taken."""
        stream = RequestStream(self, request)
        with self._cond:
            if self._draining:
                raise EngineDraining("the server is shutting down; retry on another replica")
            if not self.alive:
                raise EngineDead(self._error or "the engine is stopped")
            sched = self.core.scheduler
            if len(self._adds) + self._in_transit + sched.num_waiting + sched.num_loading >= self.max_waiting:
                raise EngineOverloaded(f"{self.max_waiting} requests are already waiting; retry later")
            n = request.params.n
            self._adds.append(_Live(request, stream, time.perf_counter(), [""] * n, [0] * n))
            self._cond.notify()
        return stream

    def between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the calling thread while the engine thread is between two steps (it holds off the next
        step until ``fn`` returns), and return its result: the way to call the block manager from another thread
        (pins). Blocking (call it with ``asyncio.to_thread``); keep ``fn`` short. Raises :class:`EngineDead` when
        the engine is stopped."""
        if not self.alive:
            raise EngineDead(self._error or "the engine is stopped")
        with self._lock:
            return fn()

    def abort(self, request_id: Any) -> None:
        """Abort a request (thread-safe, idempotent); applied between two steps."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def drain(self, timeout: float) -> bool:
        """Refuse new requests, let those in flight finish for up to ``timeout`` seconds, then fail the rest with
        a clean error ("the server is shutting down"). Returns True if every request finished on its own. Thread-
        safe; call it from any thread but the engine's."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self.num_unfinished and self.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        clean = not self.num_unfinished
        if not clean:
            with self._cond:
                self._stopping = True
                self._cond.notify()
            self._thread.join(max(1.0, timeout))
        return clean

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # ---------------------------------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        core = self.core
        sched = core.scheduler
        while True:
            idle = False
            with self._cond:
                # (has_unfinished: aborted loads too, freed once their reads end)
                while not (self._stopping or self._adds or self._aborts or core.has_unfinished()):
                    if core.tier_stores_pending():  # idle, tier writes in flight: account them as they finish
                        self._cond.wait(_SETTLE_S)
                        idle = not (self._stopping or self._adds or self._aborts or core.has_unfinished())
                        break
                    self._cond.wait()
                if self._stopping:
                    break
                if not idle:
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    self._in_transit = len(adds)
            if idle:
                self._settle_tiers()
                continue
            try:
                with self._lock:
                    self._apply(adds, aborts)
                    self._in_transit = 0
                    if core.has_unfinished():
                        self._guarded_step()
                    self._publish_events()
            except Exception as e:  # the engine itself is broken (not one request): stop, and say so
                self._die(f"engine error: {e!r}", adds)
                return
            self._take_snapshot()
            if (sched.num_loading or getattr(sched, "num_parked", 0)) and not (
                    sched.num_running or sched.num_waiting or sched.num_swapped):
                core.wait_for_loads(0.02)  # only requests waiting for tier loads: sleep until one ends (bounded)
        self._fail_all("the server is shutting down", fatal=True)

    def _settle_tiers(self) -> None:
        """Idle with tier writes in flight: complete the finished ones (their pinned blocks released, their
        counters in the metrics) without a step, then refresh the metrics snapshot."""
        try:
            with self._lock:
                self.core.poll_tiers()
                self._publish_events()
        except Exception:  # (the next step's poll meets the same fault and handles it)
            log.exception("settling the tier writes failed")
        self._take_snapshot()

    def _die(self, message: str, adds: list) -> None:
        log.exception("the engine is unusable and stops: %s", message)
        self._error = message
        for live in adds:  # some may not have reached _live
            if live.req.request_id not in self._live:
                live.stream._push(Failed(message))
        self._in_transit = 0
        self._fail_all(message, fatal=True)
        if self._on_fatal is not None:
            try:
                self._on_fatal(message)
            except Exception:
                log.exception("on_fatal failed")

    def _guarded_step(self) -> None:
        """One step with fault isolation (see the module docstring). Raises only when the engine is unusable."""
        out = self.core.step()  # (the core aborts the requests it reports in out.faults)
        if out.forward_error is not None:
            log.error("a forward pass failed; the requests of its step fail, the engine goes on: %r",
                      out.forward_error)
        faults = dict(out.faults)
        self._emit(out.plan, list(out.finished), faults)
        if faults:
            self._fail_requests(faults)
        if out.forward_error is not None:  # (the core reset the prefix cache: nobody may hit unwritten KV)
            self.core.block_manager.check_invariants()

    def _fail_requests(self, faults: dict) -> None:
        """Abort each faulty request, free its blocks, fail its stream; then check the block manager."""
        for rid, e in faults.items():
            live = self._live.pop(rid, None)
            self.core.abort(rid)  # (idempotent: the core aborted its step's faults already)
            self._faults += 1
            self._finished["error"] = self._finished.get("error", 0) + 1
            log.error("request %r failed in the engine: %r (the engine goes on)", rid, e)
            if live is not None:
                live.stream._push(Failed(f"internal error while generating: {type(e).__name__}", fatal=False))
        self.core.block_manager.check_invariants()  # raises (the engine then stops) if the fault broke state

    def _apply(self, adds: list[_Live], aborts: list) -> None:
        core = self.core
        dropped = set(aborts)
        failed: dict = {}
        for live in adds:
            rid = live.req.request_id
            if rid in dropped:
                continue
            try:
                core.add_request(live.req)
            except Exception as e:  # refused by the scheduler: this request alone fails
                failed[rid] = e
                self._live[rid] = live
                continue
            self._live[rid] = live
        if failed:
            self._fail_requests(failed)
        for rid in aborts:
            self._live.pop(rid, None)
            if core.abort(rid) is not None:
                self._finished[FINISH_ABORT] = self._finished.get(FINISH_ABORT, 0) + 1

    def _emit(self, plan: Any, done: list, faults: dict) -> None:
        """Push the step's new text of every touched sample, then finish the requests of ``done``. A request whose
        text fails to decode is added to ``faults`` (and sends nothing more)."""
        now = time.perf_counter()
        sched = self.core.scheduler
        finished_ids = {out.request_id for out in done}
        seq_ids = [pw.seq_id for pw in plan.prefills]
        if plan.decode is not None:
            seq_ids += plan.decode.seq_ids.tolist()
        touched: set = set()
        for sid in seq_ids:
            try:
                view = sched.sequence(sid)
            except KeyError:  # its request finished in this step
                continue
            if view.request_id in finished_ids or view.request_id in faults:
                continue
            live = self._live.get(view.request_id)
            if live is None:
                continue
            i = view.sample_index
            new = len(view.output) - live.sent_tokens[i]
            if new <= 0:
                continue
            live.sent_tokens[i] = len(view.output)
            self._generation_tokens += new
            try:
                text = self._visible_text(live.req, view.output)
            except Exception as e:
                faults[view.request_id] = e
                continue
            piece = text[len(live.sent_text[i]):] if text.startswith(live.sent_text[i]) else ""
            if piece:
                live.sent_text[i] += piece
            live.stream._push(Delta(i, piece, new))
            touched.add(view.request_id)
        for rid in touched:
            if rid not in faults:
                self._timing(self._live[rid], now)
        for out in done:
            if out.request_id in faults:
                continue
            live = self._live.get(out.request_id)
            if live is None:
                continue
            req = live.req
            try:
                req.finish(out)
            except Exception as e:  # decoding its final text failed (its blocks are already freed)
                faults[out.request_id] = e
                continue
            self._live.pop(out.request_id, None)
            self._timing(live, now)
            deltas = []
            for c in req.result.outputs:
                i = c.index
                self._generation_tokens += max(0, len(c.token_ids) - live.sent_tokens[i])
                sent = live.sent_text[i]
                deltas.append(Delta(i, c.text[len(sent):] if c.text.startswith(sent) else c.text,
                                    len(c.token_ids) - live.sent_tokens[i]))
            reason = out.finish_reason
            self._finished[reason] = self._finished.get(reason, 0) + 1
            if self._observer is not None:
                self._observer("e2e", now - live.arrival)
            live.stream._push(Finished(req.result, tuple(deltas)))

    def _timing(self, live: _Live, now: float) -> None:
        if live.first is None:
            live.first = now
            self._prompt_tokens += len(live.req.prompt_token_ids)
            if self._observer is not None:
                self._observer("ttft", now - live.arrival)
        elif self._observer is not None and live.last is not None and now > live.last:
            self._observer("itl", now - live.last)
        live.last = now

    @staticmethod
    def _visible_text(req: Any, tokens: tuple) -> str:
        """Text that is safe to send before the sample finishes: no trailing partial UTF-8 character, nothing
        from a stop string on, and the last ``len(longest stop) - 1`` characters held back (they might begin one)."""
        text = req.tokenizer.decode(tokens, skip_special_tokens=True)
        stops = req.params.stop
        if stops:
            cut = min((k for k in (text.find(s) for s in stops) if k >= 0), default=-1)
            if cut >= 0:
                return text[:cut]
            hold = max(len(s) for s in stops) - 1
            text = text[: len(text) - hold] if hold else text
        while text.endswith("\ufffd"):
            text = text[:-1]
        return text

    def _publish_events(self) -> None:
        if self._take_events is not None:
            events = self._take_events()
            tiers = self.core.kv_tiers
            if tiers is not None:  # blocks the disk / shared tiers stored (medium DISK / SHARED)
                events = events + tiers.take_events()
            if events:
                self._event_sink(events)

    def _fail_all(self, message: str, fatal: bool = True) -> None:
        with self._lock:
            for rid, live in list(self._live.items()):
                try:
                    self.core.abort(rid)
                except Exception:  # keep failing the others
                    log.exception("abort of %r failed", rid)
                live.stream._push(Failed(message, fatal))
            self._live.clear()
        with self._cond:
            adds, self._adds = self._adds, []
        for live in adds:
            live.stream._push(Failed(message, fatal))
        if self._stopping and self._error is None:
            self._error = message

    def _take_snapshot(self) -> None:
        sched, bm = self.core.scheduler, self.core.block_manager
        st = bm.stats
        with self._cond:
            queued = len(self._adds)
        self.snapshot = {
            "num_requests_running": sched.num_running,
            "num_requests_waiting": sched.num_waiting + getattr(sched, "num_loading", 0) + queued,
            "num_requests_swapped": sched.num_swapped,
            "kv_cache_usage_perc": bm.stats.gpu_usage,
            "prefix_cache_queries": st.prefix_query_tokens,
            "prefix_cache_hits": st.prefix_hit_tokens,
            "num_preemptions": sched.stats.preemptions,
            "prompt_tokens": self._prompt_tokens,
            "generation_tokens": self._generation_tokens,
            "request_success": dict(self._finished),
        }
        tiers = self.core.kv_tiers
        if tiers is not None:
            self.snapshot["kv_tiers"] = tiers.snapshot()
