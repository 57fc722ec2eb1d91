"""Incremental block tables: ``decode_step(..., block_tables=False)`` (:class:`pagedkv.StepDelta`).

An engine-side table (one row per sequence, ``table_rows``) is kept the way docs/engine-contract.md says: the whole
row loaded after ``allocate`` / ``allocate_batch`` / ``fork`` / ``swap_in`` (``block_table(seq)``), each step's
``table_updates`` applied after the step. Random operation sequences (hypothesis) drive two managers in lockstep,
one called with the padded tables (the default) and one incrementally; after every operation each GPU-resident
sequence's engine row must equal ``block_table(seq)`` (NULL_BLOCK past it), and every step must hand back the
same slots, lengths and copy-on-write pairs as the default, with tables equal to the default's rows. Every update
must change the entry it names (no redundant entries). The managers cover every path that changes a table in a
step: the one-token fast path, the general path (multi-token, ragged, lookahead), the plain-Python small-batch
path (on and off), copy-on-write after fork, sliding-window releases, eviction with prefix caching.

More examples: PAGEDKV_DELTA_EXAMPLES=1000 PAGEDKV_DELTA_STEPS=80 pytest tests/test_table_delta.py
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv import NULL_BLOCK, BlockManager, StepDelta, StepResult, TableUpdates
from pagedkv.errors import InvalidArgumentError, PagedKVError

EXAMPLES = int(os.environ.get("PAGEDKV_DELTA_EXAMPLES", "40"))
STEPS = int(os.environ.get("PAGEDKV_DELTA_STEPS", "40"))
SEQS = ["s0", "s1", "s2", "s3", "s4", "s5"]
TOKENS = st.integers(0, 2)  # a tiny vocabulary: prefix hits (shared blocks) happen by chance


class _EngineTables:
    """What an engine keeps: a table matrix indexed by the manager's table rows."""

    def __init__(self) -> None:
        self.t = np.full((8, 8), NULL_BLOCK, dtype=np.int32)
        self.row_of: dict = {}

    def _fit(self, rows: int, cols: int) -> None:
        r, c = self.t.shape
        if rows > r or cols > c:
            t = np.full((max(rows, 2 * r), max(cols, 2 * c)), NULL_BLOCK, dtype=np.int32)
            t[:r, :c] = self.t
            self.t = t

    def load(self, bm: BlockManager, seq) -> None:
        """The whole row (after allocate / fork / swap_in)."""
        (row,) = bm.table_rows([seq]).tolist()
        table = bm.block_table(seq)
        self._fit(row + 1, table.size)
        self.t[row] = NULL_BLOCK
        self.t[row, : table.size] = table
        self.row_of[seq] = row

    def apply(self, upd: TableUpdates) -> None:
        if upd.rows.size:
            self._fit(int(upd.rows.max()) + 1, int(upd.cols.max()) + 1)
            # every entry changes what it names, and names it once
            assert (self.t[upd.rows, upd.cols] != upd.blocks).all()
            assert np.unique(upd.rows * (1 << 32) + upd.cols).size == upd.rows.size
        upd.apply(self.t)


def draw_step_tokens(data, form: str, b: int) -> tuple:
    """A decode step's tokens for ``b`` sequences in one of decode_step's forms, and its keyword arguments:
    "one" (B,) (a list or an array), "k" (B, k), "ragged" (lists), "flat" (flat with ``num_new_tokens``)."""
    if form == "one":
        toks = np.array(data.draw(st.lists(TOKENS, min_size=b, max_size=b)), dtype=np.int64)
        return (toks.tolist() if data.draw(st.booleans()) else toks), {}
    if form == "k":
        k = data.draw(st.integers(1, 3))
        return np.array(data.draw(st.lists(st.lists(TOKENS, min_size=k, max_size=k), min_size=b, max_size=b))), {}
    ragged = data.draw(st.lists(st.lists(TOKENS, min_size=1, max_size=3), min_size=b, max_size=b))
    if form == "ragged":
        return ragged, {}
    return np.array([t for r in ragged for t in r], dtype=np.int64), {"num_new_tokens": np.array([len(r) for r in ragged])}


class DeltaMachine(RuleBasedStateMachine):
    cache = False
    window = None
    small = True

    def __init__(self) -> None:
        super().__init__()
        kw = dict(num_cpu_blocks=24, enable_prefix_caching=self.cache, sliding_window=self.window)
        self.full = BlockManager(24, 4, **kw)
        self.inc = BlockManager(24, 4, **kw)
        if not self.small:
            self.full._small_batch = self.inc._small_batch = 0
        self.eng = _EngineTables()
        self.steps = 0

    # ------------------------------------------------------------------ the two managers in lockstep
    def both(self, name: str, *args, **kwargs):
        """Call ``name`` on both managers: both raise the same error type, or both return (the results)."""
        out = []
        for bm in (self.full, self.inc):
            try:
                out.append(getattr(bm, name)(*args, **kwargs))
            except PagedKVError as e:
                out.append(e)
        a, b = out
        assert type(a) is type(b) or not (isinstance(a, Exception) or isinstance(b, Exception)), (a, b)
        return None if isinstance(a, Exception) else (a, b)

    def tables(self, seqs) -> dict:
        return {s: self.inc.block_table(s).tolist() for s in seqs}

    def step_both(self, batch: list, toks, kw: dict, la: int):
        """The same decode_step on both managers, padded tables then incremental: (full, inc), or None when both
        raised the same error and changed nothing."""
        before = self.tables(batch)
        out = []
        for bm, tables in ((self.full, True), (self.inc, False)):
            try:
                out.append(bm.decode_step(batch, toks, la, block_tables=tables, **kw))
            except PagedKVError as e:
                out.append(e)
        full, inc = out
        if isinstance(full, Exception) or isinstance(inc, Exception):
            assert type(full) is type(inc), (full, inc)
            assert self.tables(batch) == before  # all or nothing
            return None
        self.steps += 1
        assert full.slot_mapping.tolist() == inc.slot_mapping.tolist()
        assert full.seq_lens.tolist() == inc.seq_lens.tolist()
        assert np.asarray(full.cow).reshape(-1, 2).tolist() == np.asarray(inc.cow).reshape(-1, 2).tolist()
        assert inc.table_rows.tolist() == self.inc.table_rows(batch).tolist()
        assert inc.table_rows.tolist() == [self.eng.row_of[s] for s in batch]
        assert not inc.table_rows.flags.writeable
        return full, inc

    def step_some(self, data, form: str, la: int):
        """:meth:`step_both` on a drawn non-empty batch of the running sequences, its tokens drawn in ``form``
        (:func:`draw_step_tokens`): (batch, full, inc), or None (nothing running, or both raised alike)."""
        running = self.live(swapped=False)
        if not running:
            return None
        batch = data.draw(st.lists(st.sampled_from(running), min_size=1, max_size=len(running), unique=True))
        got = self.step_both(batch, *draw_step_tokens(data, form, len(batch)), la)
        return None if got is None else (batch, *got)

    def live(self, swapped: bool | None = None) -> list:
        return [s for s in SEQS if s in self.inc and (swapped is None or self.inc.is_swapped(s) == swapped)]

    # ------------------------------------------------------------------ rules
    @rule(seq=st.sampled_from(SEQS), prompt=st.lists(TOKENS, min_size=1, max_size=14), la=st.integers(0, 3))
    def allocate(self, seq, prompt, la):
        got = self.both("allocate", seq, prompt, la)
        if got is not None:
            self.eng.load(self.inc, seq)

    @rule(data=st.data(), n=st.integers(1, 3))
    def allocate_batch(self, data, n):
        ids = data.draw(st.lists(st.sampled_from(SEQS), min_size=n, max_size=n, unique=True))
        prompts = data.draw(st.lists(st.lists(TOKENS, min_size=1, max_size=10), min_size=n, max_size=n))
        got = self.both("allocate_batch", ids, prompts)
        if got is not None:
            a, b = got
            rows = self.inc.table_rows(ids)
            for i, s in enumerate(ids):  # the batch's padded tables are the full rows
                n_i = self.inc.block_table(s).size
                assert b.block_tables[i, :n_i].tolist() == self.inc.block_table(s).tolist()
                self.eng.load(self.inc, s)
                assert self.eng.row_of[s] == rows[i]

    @rule(parent=st.sampled_from(SEQS), child=st.sampled_from(SEQS))
    def fork(self, parent, child):
        if self.both("fork", parent, child) is not None:
            self.eng.load(self.inc, child)

    @rule(data=st.data(), form=st.sampled_from(["one", "k", "ragged", "flat"]), la=st.sampled_from([0, 0, 1, 2]))
    def decode(self, data, form, la):
        got = self.step_some(data, form, la)
        if got is None:
            return
        batch, full, inc = got
        assert type(full) is StepResult and type(inc) is StepDelta
        for a in inc.table_updates:
            assert not a.flags.writeable
        assert set(inc.table_updates.rows.tolist()) <= set(inc.table_rows.tolist())  # only the batch's rows
        self.eng.apply(inc.table_updates)
        for i, s in enumerate(batch):  # the engine's rows are the default's padded tables, unpadded
            row = self.eng.t[self.eng.row_of[s]]
            n = self.inc.block_table(s).size
            assert row[:n].tolist() == full.block_tables[i, :n].tolist()
            assert (full.block_tables[i, n:] == NULL_BLOCK).all()

    @rule(data=st.data())
    def swap_out(self, data):
        running = self.live(swapped=False)
        if running:
            self.both("swap_out", data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True)))

    @rule(data=st.data())
    def swap_in(self, data):
        out = self.live(swapped=True)
        if out:
            ids = data.draw(st.lists(st.sampled_from(out), min_size=1, unique=True))
            if self.both("swap_in", ids) is not None:
                for s in ids:
                    self.eng.load(self.inc, s)

    @rule(seq=st.sampled_from(SEQS), cache=st.booleans())
    def free(self, seq, cache):
        if self.both("free", seq, cache=cache) is not None:
            self.eng.row_of.pop(seq)

    @rule()
    def end_step(self):
        self.both("take_copy_plan")

    # ------------------------------------------------------------------ the check
    @invariant()
    def engine_rows_are_the_tables(self):
        for s in self.live(swapped=False):
            (row,) = self.inc.table_rows([s]).tolist()
            assert row == self.eng.row_of[s]  # stable from allocate / fork to free, swaps included
            table = self.inc.block_table(s)
            assert table.tolist() == self.full.block_table(s).tolist()  # the lockstep holds
            mine = self.eng.t[row]
            assert mine[: table.size].tolist() == table.tolist()
            assert (mine[table.size:] == NULL_BLOCK).all()

    def teardown(self) -> None:
        self.inc.check_invariants()


def _machine(cache: bool, window: int | None, small: bool = True):
    cls = type(f"Delta_{cache}_{window}_{small}", (DeltaMachine,), {"cache": cache, "window": window, "small": small})
    cls.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                     suppress_health_check=list(HealthCheck))
    return cls


TestDeltaPlain = _machine(False, None).TestCase
TestDeltaCache = _machine(True, None).TestCase
TestDeltaWindow = _machine(False, 6).TestCase
TestDeltaCacheWindow = _machine(True, 9).TestCase
TestDeltaVectorised = _machine(True, None, small=False).TestCase
TestDeltaVectorisedWindow = _machine(False, 5, small=False).TestCase


# ---------------------------------------------------------------------------------------------- worked examples


def test_delta_names_appends_cow_and_window_releases():
    bm = BlockManager(16, 2, sliding_window=3)
    bm.allocate("a", [1, 2, 3])  # blocks [0, 1]; position 3 goes into block 1
    (ra,) = bm.table_rows(["a"]).tolist()
    d = bm.decode_step(["a"], np.array([4]), block_tables=False)
    assert d.table_rows.tolist() == [ra] and d.table_updates.rows.size == 0  # nothing changed
    d = bm.decode_step(["a"], np.array([5]), block_tables=False)  # position 4: a new block; block 0 leaves the window
    assert sorted(zip(d.table_updates.cols.tolist(), d.table_updates.blocks.tolist())) == \
        [(0, NULL_BLOCK), (2, int(bm.block_table("a")[2]))]
    assert d.slot_mapping.tolist() == [int(bm.block_table("a")[2]) * 2]
    assert d.seq_lens.tolist() == [5] and d.cow.shape == (0, 2)
    bm.fork("a", "b")
    d = bm.decode_step(["a", "b"], np.array([6, 6]), block_tables=False)  # both write shared block 2
    (rb,) = bm.table_rows(["b"]).tolist()
    assert d.cow.shape == (1, 2)  # "a" copies; "b", the last writer, keeps the original
    assert list(zip(d.table_updates.rows.tolist(), d.table_updates.cols.tolist(), d.table_updates.blocks.tolist())) \
        == [(ra, 2, int(d.cow[0, 1]))]
    assert rb != ra


def test_empty_batch_and_bad_flag():
    bm = BlockManager(4, 2)
    d = bm.decode_step([], np.zeros(0, np.int64), block_tables=False)
    assert isinstance(d, StepDelta) and d.table_rows.size == 0 and d.table_updates.rows.size == 0
    bm.allocate("a", [1])
    with pytest.raises(InvalidArgumentError):
        bm.decode_step(["a"], np.array([1]), block_tables=0)
    assert bm.num_tokens("a") == 1


def test_table_rows_are_stable_and_recycled():
    bm = BlockManager(16, 2, num_cpu_blocks=8)
    for s in "abc":
        bm.allocate(s, [1, 2, 3])
    rows = dict(zip("abc", bm.table_rows(list("abc")).tolist()))
    assert len(set(rows.values())) == 3
    bm.swap_out(["b"])
    assert bm.table_rows(["b"]).tolist() == [rows["b"]]  # swapped out: same row
    bm.swap_in(["b"])
    assert bm.table_rows(["b"]).tolist() == [rows["b"]]
    bm.free("a")
    bm.allocate("d", [1])
    assert bm.table_rows(["d"]).tolist() == [rows["a"]]  # a freed row is given to a later sequence
    with pytest.raises(PagedKVError):
        bm.table_rows(["a"])
    assert not bm.table_rows(["d"]).flags.writeable
