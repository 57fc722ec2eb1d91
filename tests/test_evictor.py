"""The LRU evictor (a push log with lazy deletion) against an OrderedDict, through random operation sequences
long enough to compact the log many times."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.blocks.evictor import LRUEvictor

OPS = st.lists(st.tuples(st.sampled_from(["push", "push_many", "discard", "discard_many", "pop", "pop_many"]),
                         st.integers(0, 1000)), min_size=1, max_size=400)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 40), ops=OPS)
def test_evictor_matches_an_ordered_dict(n, ops):
    ev, ref = LRUEvictor(n), OrderedDict()
    for op, x in ops:
        absent = [b for b in range(n) if b not in ref]
        present = list(ref)
        if op == "push" and absent:
            b = absent[x % len(absent)]
            ev.push(b)
            ref[b] = None
        elif op == "push_many" and absent:
            k = x % (len(absent) + 1)
            blocks = [absent[(x + 7 * i) % len(absent)] for i in range(k)]
            blocks = list(dict.fromkeys(blocks))
            ev.push_many(np.array(blocks, dtype=np.int32))
            ref.update((b, None) for b in blocks)
        elif op == "discard" and present:
            b = present[x % len(present)]
            ev.discard(b)
            del ref[b]
        elif op == "discard_many" and present:
            blocks = list(dict.fromkeys(present[(x + 3 * i) % len(present)] for i in range(x % 5)))
            ev.discard_many(np.array(blocks, dtype=np.int64))
            for b in blocks:
                del ref[b]
        elif op == "pop" and present:
            assert ev.pop() == next(iter(ref))
            ref.popitem(last=False)
        elif op == "pop_many" and present:
            k = x % (len(present) + 1)
            got = ev.pop_many(k).tolist()
            assert got == present[:k]
            for b in got:
                del ref[b]
        assert len(ev) == len(ref)
        assert list(ev) == list(ref)
        assert all((b in ev) == (b in ref) for b in range(n))


def test_compaction_keeps_the_order():
    ev = LRUEvictor(4)  # a log of 4 + 1 + 64 entries
    for _ in range(100):  # push and discard again and again: the log fills with stale entries
        for b in (0, 1, 2):
            ev.push(b)
        for b in (1, 0, 2):
            ev.discard(b)
    ev.push(3)
    ev.push(1)
    assert list(ev) == [3, 1] and ev.pop_many(2).tolist() == [3, 1] and len(ev) == 0
