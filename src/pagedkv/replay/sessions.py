"""Conversation ids for a trace that has none (the ``session`` eviction policy's hint in a replay).

A Mooncake trace names no conversation, but a later turn of a conversation repeats the earlier turn's whole
prompt (all its trace blocks but the last, partial one): a request whose longest prefix of trace blocks already
seen is longer than one block (the first block is a system prompt every request shares) and ends where the
request that introduced its last block ended (or one block short of it) joins that request's conversation; any
other request starts one (a prompt that only shares a system prompt or a document head with an earlier one is not
its next turn). A client would send this id itself (a chat id); the replay derives it from the prompts before it,
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
        j = first[r[k - 1]] if k > 1 else -1
        out[i] = out[j] if j >= 0 and k >= offs[j + 1] - offs[j] - 1 else i
        for x in r[k:]:
            first.setdefault(x, i)
    return out
