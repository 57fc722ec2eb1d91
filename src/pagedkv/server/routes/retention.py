"""The pins of the prefix cache as the routes answer them: a pin's JSON, the check that pinning is on, and a
request's ``kv_retention`` admitted between two engine steps (:mod:`pagedkv.engine.request_pins`)."""

from __future__ import annotations

import asyncio
from typing import Any

from ...errors import PagedKVError, PinBudgetError
from ...retention.steering import Pin
from ..async_engine import EngineDead
from ..validation import APIError
from .state import ServerState

__all__ = ["pin_json", "pins_on", "admit_pin", "pin_answer"]


def pin_json(pin: Any) -> dict:
    """A pin as the routes answer it (``pin_id`` null when nothing was pinned)."""
    return {"object": "pin", "pin_id": pin.pin_id or None, "num_tokens": pin.num_tokens,
            "num_blocks": pin.num_blocks, "ttl": pin.ttl}


def pins_on(st: ServerState) -> None:
    """400 ``pinning_disabled`` unless prefix caching is on with a pin budget."""
    if not st.bm.config.enable_prefix_caching or not st.bm.config.pin_budget_blocks:
        raise APIError(400, "pinning is off on this server: start it with --pin-budget-blocks N (and prefix "
                       "caching on)", "invalid_request_error", "pinning_disabled")


async def admit_pin(st: ServerState, ids: list, spec: dict, salt: str | None) -> tuple:
    """A request's ``kv_retention`` checked between two steps: 400 ``pinning_disabled`` or for a ``pin_tokens``
    longer than the prompt, 409 ``pin_budget_exceeded`` when the pin does not fit the budget now. Returns what
    the request pins once computed."""
    from ...engine.request_pins import KVRetention

    pins_on(st)
    try:
        return await asyncio.to_thread(st.engine.between_steps, lambda: st.engine.core.request_pins.admit(
            ids, KVRetention(spec["pin_tokens"], spec["ttl"]), salt))
    except PinBudgetError as e:
        raise APIError(409, str(e), "invalid_request_error", "pin_budget_exceeded", "kv_retention") from None
    except PagedKVError as e:
        raise APIError(400, str(e), "invalid_request_error", None, "kv_retention.pin_tokens") from None
    except EngineDead as e:
        raise APIError(503, str(e), "server_error", "engine_dead") from None


def pin_answer(res: Any, spec: dict) -> dict:
    """The answer's ``kv_retention``: the request's pin (``pin_id`` null when nothing was pinned) and ``error``."""
    pin = res.pin if res.pin is not None else Pin(0, 0, 0, spec["ttl"])
    return {**pin_json(pin), "error": res.pin_error}
