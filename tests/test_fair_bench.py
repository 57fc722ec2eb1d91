"""The side-by-side harness charges each implementation with what it claims (``pagedkv.bench.fair``, the steps
built by ``hybrid`` and ``sweep``): which calls fall inside the timed regions, on which inputs, in which order
the implementations run, and in which garbage-collector state. The anchors' packages live in their own
virtualenvs, so the anchors here are stand-ins with the adapters' interface that log what is called; a clock
that logs its reads shows what each timed part contains. No timing is asserted."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest

from pagedkv.bench import fair, hybrid, runner_tables, sweep


class Log:
    """A shared event log and a clock that writes a tick into it (returns 0, 10, 20, ... ns)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.n = 0

    def clock(self) -> int:
        self.events.append("tick")
        self.n += 1
        return 10 * (self.n - 1)

    def timed(self) -> list[list[str]]:
        """The events between consecutive ticks (what each timed part contained), for the last step logged."""
        last = len(self.events) - 1 - self.events[::-1].index("tick")
        start = self.events.index("tick", max(0, self.events.index("STEP") if "STEP" in self.events else 0))
        parts, cur = [], []
        for e in self.events[start + 1:last + 1]:
            if e == "tick":
                parts.append(cur)
                cur = []
            else:
                cur.append(e)
        return parts


class FakeV1:
    """vLLM V1 adapter stand-in: one new block id per group every 4 tokens (block size 4)."""

    def __init__(self, log: Log, groups: int) -> None:
        self.log, self.groups = log, groups
        self.lens: dict[int, int] = {}
        self.tables: dict[int, list[list[int]]] = {}
        self.next_id = 100

    def allocate(self, i, p):
        assert type(p) is list
        self.lens[i] = len(p)
        self.tables[i] = [[10 * g + j for j in range(-(-len(p) // 4))] for g in range(self.groups)]

    def prepare_step(self, ids, toks):
        self.stage(ids, toks)
        self.update_requests()

    def stage(self, ids, toks):
        assert type(toks) is list and all(type(t) is int for t in toks), "V1 gets the sampled tokens as ints"
        self.log.events.append("stage")
        self._ids = list(ids)

    def update_requests(self):
        self.log.events.append("update_requests")
        for i in self._ids:
            self.lens[i] += 1

    def decode_step(self, ids, toks=None):
        self.log.events.append("kv_calls")
        out = []
        for i in ids:
            if self.lens[i] % 4 == 1:  # a token at a block's first slot: a new block in every group
                out.append(tuple([self.next_id + g] for g in range(self.groups)))
                for g in range(self.groups):
                    self.tables[i][g].append(self.next_id + g)
                self.next_id += self.groups
            else:
                out.append(None)
        return SimpleNamespace(block_tables=out, cow=[])

    def block_table(self, i, g=0):
        return list(self.tables[i][g])


@pytest.fixture
def no_slot_mapping(monkeypatch):
    """The CPU builders of slot mappings and padded tables must not run for V1."""
    def boom(*a, **k):
        raise AssertionError("a slot mapping / padded table was built for V1")
    monkeypatch.setattr(runner_tables.GroupTables, "build", boom)
    monkeypatch.setattr(runner_tables.PersistentTables, "build", boom)
    monkeypatch.setattr(runner_tables.ListTables, "build", boom)


@pytest.mark.parametrize("where", ["hybrid", "sweep"])
def test_v1_is_charged_with_request_update_kv_calls_and_block_id_appends_only(where, no_slot_mapping):
    """V1's timed region: its request update (where it hashes), its KV-manager calls, then the block-id appends
    of its runner, in three parts; the adapter's staging is outside; no slot mapping or padded table is built."""
    log = Log()
    groups = 6 if where == "hybrid" else 1
    bm = FakeV1(log, groups)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    toks = [[7, 8], [9, 10], [11, 12]]
    if where == "hybrid":
        step = hybrid._v1_decoder(bm, prompts, [0, 0], toks, groups, 4, log.clock).step
    else:
        step = sweep.make_step("vllm_v1", bm, prompts, toks, 3, log.clock)
    log.events.append("STEP")
    parts = step(0)
    assert log.events[log.events.index("STEP") + 1] == "stage"  # before the first clock read
    assert log.timed() == [["update_requests"], ["kv_calls"], []]  # the last part: numpy appends, no log entry
    assert set(parts) == {"request", "calls", "runner"} and all(v == 10 for v in parts.values())
    rows = step.rows
    for _ in range(2):
        step(1)
    # every group's row holds what V1 handed over: the admission tables then the new ids
    for g in range(groups):
        for i in range(2):
            assert rows.row(i, g) == bm.block_table(i, g)
    assert any(rows.row(0, g)[-1] >= 100 for g in range(groups))


def test_v1_block_rows_append_only_the_new_ids_per_group():
    rows = runner_tables.V1BlockRows(2, 2, width=1)  # width 1: the matrices must grow
    rows.add_row(0, [[10, 11], [20]])
    rows.add_row(1, [[30], [40]])
    rows.append([None, ([31], [])])
    rows.append([([12], [21]), None])
    assert [rows.row(0, 0), rows.row(0, 1), rows.row(1, 0), rows.row(1, 1)] == [[10, 11, 12], [20, 21], [30, 31], [40]]


class FakeNano:
    def __init__(self, log: Log) -> None:
        self.log = log
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self._batch: list = []

    def allocate(self, i, p):
        self.lens[i] = len(p)
        self.tables[i] = list(range(10 * i, 10 * i + -(-len(p) // 16)))

    def prepare_step(self, ids, toks):
        self.log.events.append("append_token")
        for i in ids:
            self.lens[i] += 1
        self._batch = [[0] * self.lens[i] for i in ids]

    def decode_step(self, ids, toks=None):
        self.log.events.append("may_append")
        return SimpleNamespace(block_tables=[self.tables[i] for i in ids], cow=[])


def test_nano_vllm_is_shown_with_its_calls_alone_and_with_its_table_building(monkeypatch):
    log = Log()
    built = []
    real = runner_tables.ListTables.build

    def build(self, tables, lens):
        log.events.append("tables")
        built.append(list(lens))
        return real(self, tables, lens)

    monkeypatch.setattr(runner_tables.ListTables, "build", build)
    bm = FakeNano(log)
    step = sweep.make_step("nanovllm", bm, [[1] * 20, [2] * 40], [[3, 4]], 1, log.clock)
    log.events.append("STEP")
    parts = step(0)
    assert log.timed() == [["may_append"], ["tables"]]
    assert set(parts) == {"calls", "tables"}
    assert built == [[21, 41]]


class Recorder:
    """A pagedkv manager behind a proxy that logs how decode_step is called."""

    def __init__(self, bm, log: Log) -> None:
        self.bm, self.log, self.calls = bm, log, []

    def allocate(self, i, p):
        assert type(p) is list
        return self.bm.allocate(i, p)

    def decode_step(self, ids, toks, *a, **k):
        self.log.events.append("decode_step")
        self.calls.append((toks, k))
        return self.bm.decode_step(ids, toks, *a, **k)


@pytest.mark.parametrize("name", ["pagedkv", "pagedkv-tables"])
def test_pagedkv_gets_token_lists_and_is_timed_around_its_step_alone(name):
    import pagedkv

    log = Log()
    rec = Recorder(pagedkv.BlockManager(64, 16, enable_prefix_caching=True), log)
    toks = np.random.default_rng(0).integers(0, 1000, size=(3, 2)).tolist()
    step = sweep.make_step(name, rec, [[1] * 20, [2] * 40], toks, 3, log.clock)
    log.events.append("STEP")
    assert set(step(0)) == {"calls"}
    assert log.timed() == [["decode_step"]]
    got, kw = rec.calls[-1]
    assert type(got) is list and all(type(t) is int for t in got)
    assert kw == {"block_tables": name == "pagedkv-tables"}


def test_alternation_runs_call_i_of_everyone_before_call_i_plus_1_rotating_the_first():
    order = []
    cs = [lambda i, c=c: order.append((i, c)) or {"x": c} for c in range(3)]
    res = fair.alternate(cs, 4)
    assert order == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0), (2, 2), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
    assert res == [[{"x": c}] * 4 for c in range(3)]


def test_engine_gc_freezes_what_exists_at_start_up_and_unfreezes_after():
    gc.unfreeze()
    keep = [object() for _ in range(10)]  # noqa: F841 - something tracked to freeze
    with fair.engine_gc():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_clock_overhead_is_subtracted_per_part_and_never_below_zero():
    ticks = iter(range(0, 10**6, 7))
    assert fair.clock_overhead(lambda: next(ticks), n=11) == 7
    assert fair.net({"a": 20, "b": 3}, 7) == {"a": 13, "b": 0}
    assert fair.CLOCK is __import__("time").thread_time_ns


def test_hybrid_decode_alternates_both_pagedkv_modes_on_the_same_state(monkeypatch):
    """The run's managers are built before the gc freeze and admitted after it; pagedkv's two modes end with the
    same free blocks (the same work), and each gets a figure."""
    seen = []
    real = fair.engine_gc

    def spy():
        seen.append(gc.get_freeze_count())
        return real()

    monkeypatch.setattr(hybrid, "engine_gc", spy)
    impl = hybrid._resolve("pagedkv", hybrid.gemma3_groups())
    out = hybrid.run_decode([impl], 2, True, 6, 0, 1, (40, 90))
    assert set(out) == {"pagedkv", "pagedkv-tables"} and seen == [0]
    assert out["pagedkv"]["free_blocks"] == out["pagedkv-tables"]["free_blocks"]
    assert all(r["us"] >= 0 and set(r["parts_us"]) == {"calls"} for r in out.values())
