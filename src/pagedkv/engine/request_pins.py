"""Request-level pins (``kv_retention``): a request asks that the first tokens of its prompt stay in the prefix
cache after it, within the pin budget (``pin_budget_blocks``), as TensorRT-LLM's ``KvCacheRetentionConfig`` lets a
request keep a token range for a duration and SGLang pins a prefix with a TTL.

The shape, on ``LLM.generate(..., kv_retention=...)`` and on ``pagedkv serve``'s completion and chat requests
alike: ``{"pin_tokens": N | "prompt", "ttl": seconds | None}``. ``pin_tokens`` says how much of the prompt (the
whole prompt, or its first N tokens: a system prompt, a tool list), rounded down to whole blocks, as
``pin_prefix`` pins; ``ttl`` is the pin's TTL in seconds, refreshed on every hit (None: until unpinned, e.g.
``DELETE /v1/pins/{id}``). One pin per request rather than TensorRT-LLM's list of token ranges with priorities: a
prefix cache can only hit a prefix, and the request's priority already orders the rest (``priority``).

Life of a request pin (:class:`RequestPins`):

1. *admission* (:meth:`RequestPins.admit`, before the request is queued; the server runs it between two engine
   steps): refused, nothing queued, with InvalidArgumentError when pinning is off (prefix caching or
   ``pin_budget_blocks`` 0) or ``pin_tokens`` is longer than the prompt, and with PinBudgetError when the pin
   can never fit the budget, or does not fit what other pins leave of it now. That last check counts every block
   of the pin as new (the manager does not say which of them other pins already hold), except when a live pin
   holds exactly this prefix (same tokens and namespace: made by an earlier request's ``kv_retention``,
   ``LLM.pin_prefix`` or ``POST /v1/pins``), whose blocks the new pin shares; so it is conservative only when
   the prefix overlaps a *different* pin. A request whose exact prefix and TTL an earlier request's
   ``kv_retention`` pinned reuses that pin.
2. *once computed* (:meth:`RequestPins.settle`, right after the engine step that computed the prompt's last
   chunk): the prefix's full blocks are pinned (``pin_prefix``), or the earlier identical pin is reused (its TTL
   was refreshed by this request's hit). The pin shows in ``llm.pins`` / ``GET /v1/pins`` like any other. If the
   budget was taken meanwhile (other pins made between admission and this step), nothing is pinned and the
   request's result says why (``RequestOutput.pin_error``); the request itself is unaffected.

Costs: admission O(prompt) plus O(pins); the pin O(prompt blocks x groups) plus O(pins), once per request.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from ..errors import InvalidArgumentError, PagedKVError, PinBudgetError
from ..retention.steering import Pin

__all__ = ["KVRetention", "RequestPins", "parse_kv_retention"]

#: the longest TTL a request pin may ask for (seconds: 30 days), as POST /v1/pins
MAX_PIN_TTL = 30 * 24 * 3600.0


class KVRetention(NamedTuple):
    """A request's ``kv_retention``: the prompt tokens to pin (an int >= 1, or ``"prompt"``: all of them) and the
    pin's TTL in seconds (None: until unpinned)."""

    pin_tokens: int | str
    ttl: float | None = None


def parse_kv_retention(value: Any) -> KVRetention | None:
    """``value`` (None, a :class:`KVRetention`, or a mapping with ``pin_tokens`` and optionally ``ttl``) checked;
    InvalidArgumentError naming the field at fault otherwise. O(1)."""
    if value is None or isinstance(value, KVRetention):
        spec = value
    elif isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in ("pin_tokens", "ttl"))
        if unknown:
            raise InvalidArgumentError(f"kv_retention: unknown field(s) {', '.join(unknown)[:200]} (it takes "
                                       "pin_tokens and ttl)")
        if "pin_tokens" not in value:
            raise InvalidArgumentError("kv_retention needs pin_tokens: an int >= 1 or 'prompt'")
        spec = KVRetention(value["pin_tokens"], value.get("ttl"))
    else:
        raise InvalidArgumentError(f"kv_retention must be a mapping {{'pin_tokens': N | 'prompt', 'ttl': seconds}}, "
                                   f"got {type(value).__name__}")
    if spec is None:
        return None
    n, ttl = spec
    if n != "prompt" and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise InvalidArgumentError(f"kv_retention.pin_tokens must be an int >= 1 or 'prompt', got {n!r}")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_PIN_TTL):
        raise InvalidArgumentError(f"kv_retention.ttl must be a number of seconds in (0, {MAX_PIN_TTL:g}] or None, "
                                   f"got {ttl!r}")
    return KVRetention(n, None if ttl is None else float(ttl))


def pin_blocks(kv_cache_groups: Any, num_tokens: int, block_size: int) -> int:
    """The blocks a pin of ``num_tokens`` (a block multiple) holds: one per block with one table
    (``kv_cache_groups`` None); with KV cache groups, a full-attention group's every block and a sliding group's
    blocks covering ``(L - W, L)`` (what :meth:`pagedkv.HybridBlockManager.pin_prefix` holds). O(groups)."""
    nb = num_tokens // block_size
    if kv_cache_groups is None:
        return nb
    total = 0
    for spec in kv_cache_groups:
        w = spec.window
        if w is None:
            total += nb
        elif nb:
            total += (num_tokens - 1) // block_size - max(0, num_tokens - w + 1) // block_size + 1
    return total


class RequestPins:
    """The request pins of one engine: admission checks, the pin once computed, and the reuse of a live pin of the
    same prefix (``_by_key``: (namespace, ttl, prefix tokens) -> pin id of a request pin; ``_cover``: (namespace,
    prefix tokens) -> pin id of any pin the engine made, :meth:`remember`; both pruned of dead pins as pins are
    made). Not thread-safe: call it on the engine's thread, or between two steps."""

    def __init__(self, block_manager: Any, kv_cache_groups: Any = None) -> None:
        self._bm = block_manager
        self._groups = kv_cache_groups
        self._by_key: dict = {}
        self._cover: dict = {}

    def _live(self, key: tuple, table: dict | None = None) -> Pin | None:
        table = self._by_key if table is None else table
        pid = table.get(key)
        if pid is None:
            return None
        for p in self._bm.retention.pins:  # (expired pins dropped first)
            if p.pin_id == pid:
                return p
        del table[key]
        return None

    def remember(self, tokens: Any, pin: Pin, namespace: Any = None, ttl: Any = False) -> None:
        """Record ``pin`` (made by ``pin_prefix`` over exactly ``tokens``, e.g. by ``LLM.pin_prefix`` or ``POST
        /v1/pins``) so that admission knows its blocks are pinned; with ``ttl`` (not False) it is also a request
        pin that requests of the same prefix and TTL reuse. Prunes the records of dead pins. O(pins + prefix)."""
        if not pin.pin_id:
            return
        live_ids = {p.pin_id for p in self._bm.retention.pins}
        for table in (self._by_key, self._cover):
            for k in [k for k, pid in table.items() if pid not in live_ids]:
                del table[k]
        t = tuple(tokens)
        self._cover[(namespace, t)] = pin.pin_id
        if ttl is not False:
            self._by_key[(namespace, ttl, t)] = pin.pin_id

    def admit(self, ids: Any, spec: KVRetention, namespace: Any = None) -> tuple[int, float | None]:
        """Check a request's ``kv_retention`` against its prompt ``ids`` and the pin budget now (see the module
        docstring); returns ``(tokens to pin, ttl)`` (0 tokens: shorter than a block, nothing will be pinned).
        Raises InvalidArgumentError or PinBudgetError; changes nothing. O(prompt + pins)."""
        bm = self._bm
        if not bm.config.enable_prefix_caching or not bm.config.pin_budget_blocks:
            raise InvalidArgumentError("kv_retention pins a prefix: it needs prefix caching and a pin budget "
                                       "(pin_budget_blocks > 0, pagedkv serve --pin-budget-blocks N)")
        n = len(ids) if spec.pin_tokens == "prompt" else spec.pin_tokens
        if n > len(ids):
            raise InvalidArgumentError(f"kv_retention.pin_tokens={n} is longer than the prompt ({len(ids)} tokens)")
        full = n // bm.block_size * bm.block_size
        if not full:
            return 0, spec.ttl
        need = pin_blocks(self._groups, full, bm.block_size)
        if need > bm.config.pin_budget_blocks:
            raise PinBudgetError(f"kv_retention: pinning {full} tokens holds {need} blocks; the pin budget is "
                                 f"{bm.config.pin_budget_blocks} blocks (pin_budget_blocks)")
        if self._live((namespace, tuple(ids[:full])), self._cover) is None:  # (else: those blocks are pinned)
            bm.retention.pins  # (drops expired pins first)
            held = bm.retention.num_pinned_blocks
            if held + need > bm.config.pin_budget_blocks:
                raise PinBudgetError(f"kv_retention: pinning {full} tokens may hold {need} more blocks; other pins "
                                     f"hold {held} of the pin budget of {bm.config.pin_budget_blocks} blocks now (unpin "
                                     "some, DELETE /v1/pins/{id}, or retry later)")
        return full, spec.ttl

    def settle(self, ids: Any, num_tokens: int, ttl: float | None, namespace: Any = None) -> tuple[Pin, str | None]:
        """Pin the first ``num_tokens`` of ``ids`` (computed: call it after the step that computed them), or reuse
        the live pin of the same prefix. Returns ``(pin, error)``: the pin (``pin_id`` 0 when nothing was pinned)
        and None, or ``Pin(0, 0, 0, ttl)`` and the reason (the budget taken meanwhile). O(prefix blocks + pins)."""
        if not num_tokens:
            return Pin(0, 0, 0, ttl), None
        key = (namespace, ttl, tuple(ids[:num_tokens]))
        live = self._live(key)
        if live is not None:
            return live, None
        try:
            pin = self._bm.retention.pin_prefix(list(ids[:num_tokens]), ttl=ttl, namespace=namespace)
        except PinBudgetError as e:
            return Pin(0, 0, 0, ttl), str(e)
        except PagedKVError as e:  # (not expected: admit checked the rest) the request goes on unpinned
            return Pin(0, 0, 0, ttl), f"{type(e).__name__}: {e}"
        if pin.num_tokens == num_tokens:
            self.remember(ids[:num_tokens], pin, namespace, ttl)
        return pin, None
