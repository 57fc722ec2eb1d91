"""Incremental block tables with KV cache groups: ``HybridBlockManager.decode_step(..., block_tables=False)``
(:class:`pagedkv.HybridStepDelta`).

The engine keeps one table matrix per group, all indexed by the same table rows (``table_rows``): the whole row of
every group loaded after ``allocate`` / ``allocate_batch`` / ``fork`` / ``swap_in`` (``block_table(seq, g)``),
each step's ``table_updates[g]`` applied to group ``g``'s matrix. Random operation sequences (hypothesis) drive
two coordinators in lockstep, one called with the padded tables and one incrementally; after every operation each
GPU-resident sequence's row of every group must equal ``block_table(seq, g)``, and every step must hand back the
same slots, lengths and copy-on-write pairs as the padded call. The configurations cover every path of the
coordinator's step (the plain-Python small batch, whose sliding groups release their windows first; the
one-token fast path; the general path with multi-token, ragged and lookahead appends), copy-on-write after
fork, swaps, and window retention with prefix caching.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv import (NULL_BLOCK, FullAttentionSpec, BlockManager, HybridBlockManager, HybridStepDelta, HybridStepResult,
                     SlidingWindowSpec)
from pagedkv.errors import InvalidArgumentError
from test_table_delta import SEQS, TOKENS, DeltaMachine, _EngineTables

EXAMPLES = int(os.environ.get("PAGEDKV_DELTA_EXAMPLES", "30"))
STEPS = int(os.environ.get("PAGEDKV_DELTA_STEPS", "40"))


class _GroupTables:
    """What an engine keeps with KV cache groups: one table matrix per group, the same rows."""

    def __init__(self, G: int) -> None:
        self.g = [_EngineTables() for _ in range(G)]
        self.row_of: dict = {}

    def load(self, bm: HybridBlockManager, seq) -> None:
        """Every group's whole row (after allocate / fork / swap_in)."""
        (row,) = bm.table_rows([seq]).tolist()
        for g, eng in enumerate(self.g):
            table = bm.block_table(seq, g)
            eng._fit(row + 1, table.size)
            eng.t[row] = NULL_BLOCK
            eng.t[row, : table.size] = table
        self.row_of[seq] = row


class HybridDeltaMachine(DeltaMachine):
    """test_table_delta's machine on two coordinators; its allocate, fork, swap, free and step-end rules as they
    are, the allocate_batch and decode rules and the check per group."""

    groups: tuple = ()

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        kw = dict(kv_cache_groups=self.groups, num_cpu_blocks=40, enable_prefix_caching=self.cache)
        self.full = BlockManager(40, 4, **kw, grouped_results=True)
        self.inc = BlockManager(40, 4, **kw, grouped_results=True)
        if not self.small:
            for bm in (self.full, self.inc):
                bm._step.small_batch = 0
        self.eng = _GroupTables(len(self.groups))
        self.steps = 0

    def tables(self, seqs) -> dict:
        return {s: [self.inc.block_table(s, g).tolist() for g in range(len(self.groups))] for s in seqs}

    @rule(data=st.data(), n=st.integers(1, 3))
    def allocate_batch(self, data, n):
        ids = data.draw(st.lists(st.sampled_from(SEQS), min_size=n, max_size=n, unique=True))
        prompts = data.draw(st.lists(st.lists(TOKENS, min_size=1, max_size=10), min_size=n, max_size=n))
        if self.both("allocate_batch", ids, prompts) is not None:
            for s in ids:
                self.eng.load(self.inc, s)

    @rule(data=st.data(), form=st.sampled_from(["one", "one", "k", "ragged", "flat"]), la=st.sampled_from([0, 0, 0, 1]))
    def decode(self, data, form, la):
        got = self.step_some(data, form, la)
        if got is None:
            return
        batch, full, inc = got
        assert type(full) is HybridStepResult and type(inc) is HybridStepDelta
        assert len(inc.table_updates) == len(self.groups)
        for g, (eng, upd) in enumerate(zip(self.eng.g, inc.table_updates)):
            for a in upd:
                assert not a.flags.writeable
            assert set(upd.rows.tolist()) <= set(inc.table_rows.tolist())
            eng.apply(upd)  # (asserts each entry changes what it names, once)
            for i, s in enumerate(batch):
                n = self.inc.block_table(s, g).size
                row = eng.t[self.eng.row_of[s]]
                assert row[:n].tolist() == full.block_tables[g][i, :n].tolist()
                assert (full.block_tables[g][i, n:] == NULL_BLOCK).all()

    @invariant()
    def engine_rows_are_the_tables(self):
        for s in self.live(swapped=False):
            (row,) = self.inc.table_rows([s]).tolist()
            assert row == self.eng.row_of[s]
            for g, eng in enumerate(self.eng.g):
                table = self.inc.block_table(s, g)
                assert table.tolist() == self.full.block_table(s, g).tolist()
                mine = eng.t[row]
                assert mine[: table.size].tolist() == table.tolist()
                assert (mine[table.size:] == NULL_BLOCK).all()


def _machine(groups: tuple, cache: bool, small: bool = True):
    name = "HybridDelta_" + "_".join(str(getattr(s, "window", None) or "full") for s in groups) + f"_{cache}_{small}"
    cls = type(name, (HybridDeltaMachine,), {"groups": groups, "cache": cache, "small": small})
    cls.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                     suppress_health_check=list(HealthCheck))
    return cls


F, W5, W6, W9 = FullAttentionSpec(), SlidingWindowSpec(5), SlidingWindowSpec(6), SlidingWindowSpec(9)
TestHybridDeltaPlain = _machine((F, W6, W9), False).TestCase
TestHybridDeltaCache = _machine((F, W6, W9), True).TestCase  # (window retention on)
TestHybridDeltaSlidingFirst = _machine((W5, F), True).TestCase
TestHybridDeltaVectorised = _machine((F, W5), True, small=False).TestCase


def test_hybrid_delta_names_each_groups_appends_and_window_releases():
    bm = BlockManager(32, 2, kv_cache_groups=[F, SlidingWindowSpec(3)], grouped_results=True)
    bm.allocate("a", [1, 2, 3])  # blocks [x, y] in both groups; position 3 goes into block 1
    (ra,) = bm.table_rows(["a"]).tolist()
    d = bm.decode_step(["a"], [4], block_tables=False)  # (the small-batch path)
    assert isinstance(d, HybridStepDelta) and d.table_rows.tolist() == [ra]
    assert all(u.rows.size == 0 for u in d.table_updates)  # nothing changed
    d = bm.decode_step(["a"], np.array([5]), block_tables=False)  # position 4: a new block in each group
    full_upd, win_upd = d.table_updates
    assert list(zip(full_upd.cols.tolist(), full_upd.blocks.tolist())) == [(2, int(bm.block_table("a", 0)[2]))]
    # the sliding group (W = 3: position 4 sees 2..4) also releases block 0
    assert sorted(zip(win_upd.cols.tolist(), win_upd.blocks.tolist())) == \
        [(0, NULL_BLOCK), (2, int(bm.block_table("a", 1)[2]))]
    assert d.slot_mapping.tolist() == [[int(bm.block_table("a", g)[2]) * 2] for g in range(2)]
    bm.allocate("b", [7, 7, 7])
    d = bm.decode_step(["a", "b"], np.array([6, 8]), block_tables=False)  # a batch of two (vectorised or small)
    assert d.table_rows.tolist() == bm.table_rows(["a", "b"]).tolist()
    # "b" (3 tokens, W = 3) writes position 3, which sees 1..3: block 0 is still needed
    assert all(int(r) == ra for r in d.table_updates[1].rows)


def test_hybrid_delta_empty_batch_and_bad_flag():
    bm = BlockManager(8, 2, kv_cache_groups=[F, W5], grouped_results=True)
    d = bm.decode_step([], np.zeros(0, np.int64), block_tables=False)
    assert isinstance(d, HybridStepDelta) and d.table_rows.size == 0 and len(d.table_updates) == 2
    bm.allocate("a", [1])
    with pytest.raises(InvalidArgumentError):
        bm.decode_step(["a"], np.array([1]), block_tables=0)
    assert bm.num_tokens("a") == 1
