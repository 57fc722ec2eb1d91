"""One API for one KV cache group or many (docs/engine-contract.md, "One API for one group or many").

A ``BlockManager`` is the one-group case of a ``HybridBlockManager``: the same calls with the same arguments, and
results that answer the same grouped names with the same shapes (``group_slot_mapping`` (G, T),
``group_block_tables`` and ``group_table_updates`` G-tuples), ``kv_cache_groups`` / ``num_groups``,
``block_table(seq, g)`` / ``slot_mapping(seq, a, z, g)`` with ``g`` defaulting to 0, the batch form of the
lookahead slots, a ragged ``can_append_slots``, and the incremental-table contract with ``append_slots`` and
padded steps in between. Every check here runs the same code on both managers, no adapter.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv import (NULL_BLOCK, BlockManager, FullAttentionSpec, HybridBlockManager, SlidingWindowSpec)
from pagedkv.manager._small import SMALL_BATCH
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, SequenceStateError


def _managers(num_blocks: int = 48, bs: int = 4, **kw):
    """One manager per shape: a plain table, a windowed one, two and three groups (full and sliding)."""
    yield BlockManager(num_blocks, bs, **kw)
    yield BlockManager(num_blocks, bs, sliding_window=6, **kw)
    yield BlockManager(2 * num_blocks, bs, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(5)], **kw, grouped_results=True)
    yield BlockManager(3 * num_blocks, bs, kv_cache_groups=[SlidingWindowSpec(3), FullAttentionSpec(),
                                                                    SlidingWindowSpec(9)], **kw, grouped_results=True)


MANAGERS = ["single", "single-window", "two-groups", "three-groups"]


def _manager(i: int, **kw):
    return list(_managers(**kw))[i]


@pytest.mark.parametrize("which", range(4), ids=MANAGERS)
def test_every_result_answers_the_grouped_names_with_the_same_shapes(which):
    bm = _manager(which, enable_prefix_caching=True)
    G = bm.config.num_groups
    assert len(bm.config.kv_cache_groups) == G and (G == 1) == (type(bm) is BlockManager) and isinstance(bm, BlockManager)
    pre = bm.allocate_batch(["a", "b"], [list(range(9)), list(range(6))], 2)
    assert pre.group_slot_mapping.shape == (G, 15 - 4)  # b's first block (of a's prompt) was a burst hit
    assert len(pre.group_block_tables) == G and all(t.shape[0] == 2 for t in pre.group_block_tables)
    for g in range(G):
        assert (pre.group_slot_mapping[g] == np.concatenate(
            [bm.slot_mapping("a", 0, 9, g), bm.slot_mapping("b", 4, 6, g)])).all()
    # the small-batch path, the one-token fast path, the general path (multi-token, lookahead), padded and delta
    for toks, kw in (([1, 2], {}), (np.array([1, 2]), {}), ([[1, 2], [3]], {}), ([4, 5], {"num_lookahead_slots": 2})):
        n0 = [bm.num_tokens(s) for s in "ab"]
        for tables in (True, False):
            res = bm.decode_step(["a", "b"], toks, block_tables=tables, **kw)
            T = res.slot_mapping.shape[-1]
            assert res.group_slot_mapping.shape == (G, T)
            if tables:
                assert len(res.group_block_tables) == G
                for g in range(G):
                    for i, s in enumerate("ab"):
                        t = bm.block_table(s, g)
                        assert (res.group_block_tables[g][i, : t.size] == t).all()
            else:
                assert len(res.group_table_updates) == G
            n1 = [bm.num_tokens(s) for s in "ab"]
            for g in range(G):
                want = np.concatenate([bm.slot_mapping(s, a, z, g) for s, a, z in zip("ab", n0, n1)])
                assert (res.group_slot_mapping[g] == want).all()
            n0 = n1
    if G == 1:  # the plain names stay what they were on a BlockManager
        assert res.slot_mapping.ndim == 1 and res.group_slot_mapping.base is res.slot_mapping
        assert bm.block_table("a").tolist() == bm.block_table("a", 0).tolist()
    bm.check_invariants()


@pytest.mark.parametrize("which", range(4), ids=MANAGERS)
def test_group_argument_defaults_to_0_and_is_checked(which):
    bm = _manager(which)
    bm.allocate("a", list(range(7)))
    G = bm.config.num_groups
    assert bm.block_table("a").tolist() == bm.block_table("a", 0).tolist()
    assert bm.slot_mapping("a", 0, 7).tolist() == bm.slot_mapping("a", 0, 7, 0).tolist()
    for bad in (G, -1, 1.0, "0", None, True):
        with pytest.raises(InvalidArgumentError):
            bm.block_table("a", bad)
        with pytest.raises(InvalidArgumentError):
            bm.slot_mapping("a", 0, 1, bad)


@pytest.mark.parametrize("which", range(4), ids=MANAGERS)
def test_lookahead_slots_batch_form(which):
    bm = _manager(which, num_blocks=90)
    G = bm.config.num_groups
    for i, s in enumerate("abc"):
        bm.allocate(s, list(range(5 + 3 * i)), 3)
    res = bm.decode_step(["a", "b", "c"], [[1], [2, 3], [4, 5, 6]], 3)
    la = bm.lookahead_slots(["c", "a", "b"], 3)
    assert la.shape == (G, 9) and la.dtype == np.int64
    for g in range(G):
        want = np.concatenate([bm.slot_mapping(s, bm.num_tokens(s), bm.num_tokens(s) + 3, g) for s in "cab"])
        assert (la[g] == want).all()
        # the drafts' slots follow the appended tokens' in the same blocks, never a slot handed out twice
        assert np.intersect1d(la[g], res.group_slot_mapping[g]).size == 0
    # a batch past the plain-Python cut-off (B x k > 32) takes the numpy path: the same answer, the same errors
    big = [f"x{i}" for i in range(12)]
    for i, s in enumerate(big):
        bm.allocate(s, list(range(1 + i)), 5)
    bm.decode_step(big, list(range(12)), 5)
    got = bm.lookahead_slots(big, 5)
    assert got.shape == (G, 60)
    for g in range(G):
        want = np.concatenate([bm.slot_mapping(s, bm.num_tokens(s), bm.num_tokens(s) + 5, g) for s in big])
        assert (got[g] == want).all()
    with pytest.raises(InvalidArgumentError, match="fewer than num_lookahead_slots"):
        bm.lookahead_slots(big, 9)
    for s in big:
        bm.free(s)
    assert bm.lookahead_slots(["a", "b"], 0).shape == (G, 0)
    assert bm.lookahead_slots([], 3).shape == (G, 0)
    before = [bm.block_table(s, g).tolist() for s in "abc" for g in range(G)]
    with pytest.raises(InvalidArgumentError, match="fewer than num_lookahead_slots"):
        bm.lookahead_slots(["a", "b"], 9)
    with pytest.raises(InvalidArgumentError):
        bm.lookahead_slots(["a"], -1)
    with pytest.raises(Exception) as e:  # a repeated id, as decode_step refuses it
        bm.lookahead_slots(["a", "a"], 1)
    assert "twice" in str(e.value)
    bm.free("c")
    bm.swap_out(["b"]) if bm.config.num_cpu_blocks else None
    assert [bm.block_table(s, g).tolist() for s in "ab" for g in range(G)] == before[: 2 * G]
    bm.check_invariants()


def test_lookahead_slots_refuses_a_swapped_sequence():
    for bm in _managers(num_cpu_blocks=40):
        bm.allocate("a", list(range(6)), 2)
        bm.swap_out(["a"])
        with pytest.raises(SequenceStateError):
            bm.lookahead_slots(["a"], 2)


@pytest.mark.parametrize("which", range(4), ids=MANAGERS)
def test_ragged_can_append_slots_predicts_the_ragged_step(which):
    """can_append_slots(ids, la, num_new_tokens=counts) is True exactly when decode_step(ids, flat, la,
    num_new_tokens=counts) succeeds, on random ragged batches over a small pool (forks: copy-on-write counted)."""
    rng = random.Random(which)
    fits = misses = 0
    for trial in range(60):
        bm = _manager(which, num_blocks=14, enable_prefix_caching=trial % 2 == 1, watermark=0.0)
        ids = []
        for i in range(rng.randrange(1, 5)):
            s = f"s{i}"
            try:
                bm.allocate(s, [rng.randrange(3) for _ in range(rng.randrange(1, 12))])
            except OutOfBlocksError:
                break
            ids.append(s)
            if rng.random() < 0.3:
                bm.fork(s, s + "f")
                ids.append(s + "f")
        if not ids:
            continue
        counts = [rng.randrange(1, 9) for _ in ids]
        la = rng.randrange(0, 3)
        ok = bm.can_append_slots(ids, la, num_new_tokens=counts)
        if len(set(counts)) > 1:  # a uniform count would say something else for this batch
            assert ok == bm.can_append_slots(ids, la, num_new_tokens=np.array(counts))
        flat = [rng.randrange(3) for _ in range(sum(counts))]
        try:
            bm.decode_step(ids, flat, la, num_new_tokens=counts)
            assert ok, (which, trial)
            fits += 1
        except OutOfBlocksError:
            assert not ok, (which, trial)
            misses += 1
        bm.check_invariants()
    assert fits and misses


def test_ragged_can_append_slots_bad_counts_raise():
    for bm in _managers():
        bm.allocate("a", [1, 2, 3])
        bm.allocate("b", [1, 2])
        assert bm.can_append_slots(["a", "b"], num_new_tokens=[1, 5])
        for bad in ([1], [1, 0], [1, -2], [1.5, 1], "ab", None, True, 0, [[1, 1]]):
            with pytest.raises(InvalidArgumentError):
                bm.can_append_slots(["a", "b"], num_new_tokens=bad)
        assert bm.can_append_slots([], num_new_tokens=[])


class _Tables:
    """An engine's block tables, one matrix per group indexed by table rows, kept by the documented contract."""

    def __init__(self, bm) -> None:
        self.bm = bm
        self.t = [np.full((64, 64), NULL_BLOCK, np.int32) for _ in range(bm.config.num_groups)]

    def load(self, seq) -> None:  # after allocate, fork, swap_in, append_slots
        (row,) = self.bm.table_rows([seq]).tolist()
        for g, t in enumerate(self.t):
            b = self.bm.block_table(seq, g)
            t[row] = NULL_BLOCK
            t[row, : b.size] = b

    def padded(self, ids, res) -> None:  # after a decode_step with the padded tables
        rows = self.bm.table_rows(ids)
        for t, bt in zip(self.t, res.group_block_tables):
            t[rows, : bt.shape[1]] = bt

    def delta(self, res) -> None:  # after a decode_step(..., block_tables=False)
        for t, u in zip(self.t, res.group_table_updates):
            u.apply(t)

    def check(self, ids) -> None:
        for s in ids:
            if self.bm.is_swapped(s):
                continue
            (row,) = self.bm.table_rows([s]).tolist()
            for g, t in enumerate(self.t):
                b = self.bm.block_table(s, g)
                assert t[row, : b.size].tolist() == b.tolist(), (s, g)
                assert (t[row, b.size :] == NULL_BLOCK).all()


@pytest.mark.parametrize("which", range(4), ids=MANAGERS)
def test_incremental_tables_with_append_slots_and_padded_steps_in_between(which):
    """The contract of docs/engine-contract.md: whole rows after allocate / fork / swap_in / append_slots, a
    padded step's tables written over the batch's rows, a delta step's updates applied; the engine's tables then
    equal block_table(seq, g) after every call (prefix caching, windows, forks, swaps)."""
    rng = random.Random(7 + which)
    stale_after_append = 0
    for trial in range(6):
        bm = _manager(which, num_blocks=40, enable_prefix_caching=True, num_cpu_blocks=80, watermark=0.0)
        eng = _Tables(bm)
        live, n = [], 0
        for op in range(120):
            gpu = [s for s in live if not bm.is_swapped(s)]
            r = rng.random()
            try:
                if r < 0.15 or not gpu:
                    s = f"q{n}"
                    n += 1
                    bm.allocate(s, [rng.randrange(3) for _ in range(rng.randrange(1, 14))], rng.randrange(0, 3))
                    live.append(s)
                    eng.load(s)
                elif r < 0.4:
                    batch = rng.sample(gpu, rng.randrange(1, len(gpu) + 1))
                    counts = [rng.choice((1, 1, 2, 3)) for _ in batch]
                    flat = [rng.randrange(3) for _ in range(sum(counts))]
                    res = bm.decode_step(batch, flat, rng.randrange(0, 3), num_new_tokens=counts, block_tables=False)
                    eng.delta(res)
                elif r < 0.55:
                    batch = rng.sample(gpu, rng.randrange(1, len(gpu) + 1))
                    res = bm.decode_step(batch, [rng.randrange(3) for _ in batch], rng.choice((0, 0, 2)))
                    eng.padded(batch, res)
                elif r < 0.7:
                    s = rng.choice(gpu)
                    (row,) = bm.table_rows([s]).tolist()
                    before = [t[row].copy() for t in eng.t]
                    bm.append_slots(s, [rng.randrange(3) for _ in range(rng.randrange(1, 6))], rng.randrange(0, 3))
                    stale_after_append += any(
                        before[g][: bm.block_table(s, g).size].tolist() != bm.block_table(s, g).tolist()
                        for g in range(bm.config.num_groups))
                    eng.load(s)
                elif r < 0.78 and len(live) < 12:
                    s = rng.choice(gpu)
                    c = f"q{n}"
                    n += 1
                    bm.fork(s, c)
                    live.append(c)
                    eng.load(c)
                elif r < 0.86:
                    s = rng.choice(live)
                    if bm.is_swapped(s):
                        bm.swap_in([s])
                        eng.load(s)
                    else:
                        bm.swap_out([s])
                elif r < 0.95:
                    s = rng.choice(live)
                    bm.free(s)
                    live.remove(s)
                else:
                    bm.take_copy_plan()
            except (OutOfBlocksError, SequenceStateError):  # (fork / swap_out in a step that handed slots)
                pass
            eng.check(live)
            bm.check_invariants()
    assert stale_after_append  # append_slots does change tables the engine holds: the reload is needed


def test_docs_small_batch_size_is_small_batch():
    """docs that state the plain-Python path's batch size state SMALL_BATCH."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs/guide/sliding-window-and-lookahead.md").read_text()
    assert f"up to `SMALL_BATCH` ({SMALL_BATCH}) sequences" in text


class _Forwarding:
    """A wrapper that forwards every attribute (as an engine's timing or metrics layer does)."""

    def __init__(self, bm) -> None:
        self._bm = bm

    def __getattr__(self, name):
        return getattr(self._bm, name)


@pytest.mark.parametrize("which", range(4), ids=MANAGERS)
def test_grouped_results_flag_keeps_the_scheduler_shapes_behind_a_wrapper(which):
    """grouped_results says which form the plain names take; the scheduler reads it (through any wrapper), so a
    BlockManager's plans keep (T,) slots and one table, a HybridBlockManager's (G, T) and G tables."""
    from pagedkv.scheduler import Scheduler

    bm = _manager(which)
    assert bm.config.grouped_results is bm.config.grouped_results
    sched = Scheduler(_Forwarding(bm), max_num_seqs=4)
    sched.add_request("r", list(range(9)), max_tokens=2, ignore_eos=True)
    (pw,) = sched.schedule().prefills
    if bm.config.grouped_results:
        assert pw.slot_mapping.shape == (bm.config.num_groups, 9) and len(pw.block_table) == bm.config.num_groups
    else:
        assert pw.slot_mapping.shape == (9,) and pw.block_table.ndim == 1
