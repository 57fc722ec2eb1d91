"""Conversation ids for a trace that has none (the ``session`` eviction policy's hint in a replay).

A Mooncake trace names no conversation, but a later turn of a conversation repeats the earlier turn's prompt:
its longest prefix of trace blocks already seen, when longer than one block (the first block is a system prompt
every request shares), was introduced by the earlier turn, whose conversation it joins; any other request starts a
conversation. A client would send this id itself (a chat id); the replay derives it from the prompts before it,
never from later requests, so the hint uses nothing a server could not know at the time.
"""

from __future__ import annotations

import numpy as np

from .trace import Trace

__all__ = ["conversation_ids"]


def conversation_ids(trace: Trace) -> np.ndarray:
    """The conversation id of each request (int64 (n,): the index of the conversation's first request).
    O(total trace blocks), one dict."""
    first: dict = {}  # trace-block id -> the request that first held it
    out = np.empty(len(trace), dtype=np.int64)
    ids = trace.hash_ids.tolist()
    offs = trace.offsets.tolist()
    for i in range(len(trace)):
        r = ids[offs[i] : offs[i + 1]]
        k = 0
        while k < len(r) and r[k] in first:
            k += 1
        out[i] = out[first[r[k - 1]]] if k > 1 else i
        for x in r[k:]:
            first.setdefault(x, i)
    return out
