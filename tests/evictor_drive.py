"""The driver the eviction-policy tests share: an evictor and its plain reference model taken through one random
sequence of operations, every state compared (tests/test_eviction_policies.py, tests/test_density_policy.py).

A reference model has ``push_many(blocks)`` (a list, in push order: one release), ``discard(block)``, ``pop()``
and ``order()`` (the blocks in eviction order), and ``hint(blocks, session)`` when the policy takes hints."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st

KINDS = ("push", "push_many", "discard", "discard_many", "pop", "pop_many", "hint")


def ops(kinds: tuple = KINDS, max_size: int = 300) -> st.SearchStrategy:
    """Operation sequences: ``(kind, x)`` pairs, ``x`` choosing the blocks or counts."""
    return st.lists(st.tuples(st.sampled_from(kinds), st.integers(0, 1000)), min_size=1, max_size=max_size)


def drive(ev: Any, ref: Any, n: int, operations: list,
          hint: Callable[[int, list, list], tuple | None] | None = None) -> None:
    """Apply ``operations`` to ``ev`` (an evictor over blocks ``0..n-1``) and ``ref`` alike, only ones valid in the
    current state (push absent blocks, discard present ones); after each, the length, the eviction order and
    membership must agree, and every pop must take the reference's block. ``hint(x, absent, inside)`` gives the
    ``(blocks, session)`` of a ``"hint"`` operation, or None to skip it (no ``hint``: hints are skipped)."""
    inside: list = []
    for op, x in operations:
        absent = [b for b in range(n) if b not in inside]
        if op == "push" and absent:
            b = absent[x % len(absent)]
            ev.push(b)
            ref.push_many([b])
            inside.append(b)
        elif op == "push_many" and absent:
            blocks = list(dict.fromkeys(absent[(x + 7 * i) % len(absent)] for i in range(x % (len(absent) + 1))))
            ev.push_many(np.array(blocks, dtype=np.int32))
            ref.push_many(blocks)
            inside += blocks
        elif op == "discard" and inside:
            b = inside.pop(x % len(inside))
            ev.discard(b)
            ref.discard(b)
        elif op == "discard_many" and inside:
            blocks = list(dict.fromkeys(inside[(x + 3 * i) % len(inside)] for i in range(x % 4)))
            ev.discard_many(np.array(blocks, dtype=np.int64))
            for b in blocks:
                ref.discard(b)
                inside.remove(b)
        elif op == "pop" and inside:
            b = ev.pop()
            assert b == ref.pop()
            inside.remove(b)
        elif op == "pop_many" and inside:
            k = x % (len(inside) + 1)
            got = ev.pop_many(k).tolist()
            assert got == [ref.pop() for _ in range(k)]
            for b in got:
                inside.remove(b)
        elif op == "hint" and hint is not None:
            h = hint(x, absent, inside)
            if h is not None:
                blocks, session = h
                ev.hint(np.array(blocks, dtype=np.int64), session)
                ref.hint(blocks, session)
        assert len(ev) == len(inside)
        assert list(ev) == ref.order()
        assert all((b in ev) == (b in inside) for b in range(n))


class LRUReference:
    """A reference for "exactly LRU" checks: an :class:`~pagedkv.blocks.evictor.LRUEvictor` behind the reference
    interface."""

    def __init__(self, lru: Any) -> None:
        self.lru = lru

    def push_many(self, blocks: list) -> None:
        self.lru.push_many(np.array(blocks, dtype=np.int32))

    def discard(self, b: int) -> None:
        self.lru.discard(b)

    def pop(self) -> int:
        return self.lru.pop()

    def order(self) -> list:
        return list(self.lru)
