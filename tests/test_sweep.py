"""The batch-size sweep and the single-call benchmark: structure of their output, and that what they compare
computes the same thing (the plain-Python reference keeps pagedkv's block tables; the runner-side table builders
reproduce pagedkv's step result). No timing is asserted."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.bench import single, sweep
from pagedkv.bench.__main__ import main as bench_main
from pagedkv.bench.runner_tables import ListTables, PersistentTables
from pagedkv.errors import PagedKVError


def _outcome(fn, *args, **kwargs):
    try:
        return ("ok", fn(*args, **kwargs))
    except PagedKVError as exc:
        return ("error", type(exc).__name__)


@pytest.mark.parametrize("seed", range(6))
def test_reference_keeps_pagedkv_tables(seed):
    """Random single-sequence calls (allocate, one- and multi-token appends with lookahead, fork, free, and bad
    calls) on both: the same results, exceptions, block tables, token counts and free-block counts throughout."""
    rng = random.Random(seed)
    nblocks, bs = 60, 4
    ref, pk = single.Reference(nblocks, bs), BlockManager(nblocks, bs)
    live, next_id = [], 0
    for _ in range(400):
        r = rng.random()
        if r < 0.15 or not live:
            toks = [rng.randrange(1000) for _ in range(rng.randint(1, 14))]
            call = ("allocate", next_id, toks)
            next_id += 1
        elif r < 0.25:
            call = ("fork", rng.choice(live), next_id)
            next_id += 1
        elif r < 0.35:
            call = ("free", live.pop(rng.randrange(len(live))))
        elif r < 0.42:  # bad calls: unknown sequence, bad tokens, duplicate id
            bad = rng.choice([("append_slots", 10_000, [1]), ("append_slots", rng.choice(live), [-1]),
                              ("append_slots", rng.choice(live), []), ("allocate", rng.choice(live), [1, 2]),
                              ("append_slots", rng.choice(live), [2**31]), ("free", 10_000)])
            call = bad
        else:
            sid = rng.choice(live)
            k = 1 if rng.random() < 0.7 else rng.randint(2, 6)
            la = 0 if rng.random() < 0.8 else rng.randint(1, 5)
            call = ("append_slots", sid, [rng.randrange(1000) for _ in range(k)], la)
        a = _outcome(getattr(ref, call[0]), *call[1:])
        b = _outcome(getattr(pk, call[0]), *call[1:])
        assert a == b, (call, a, b)
        if call[0] in ("allocate", "fork") and a[0] == "ok":
            live.append(call[2] if call[0] == "fork" else call[1])
        if call[0] == "free" and a[0] == "error" and call[1] in live:  # pragma: no cover - never expected
            live.remove(call[1])
        assert ref.num_free_gpu_blocks == pk.num_free_gpu_blocks
        for s in live:
            assert ref.block_table(s) == pk.block_table(s).tolist()
            assert ref.num_tokens(s) == pk.num_tokens(s)
    assert sorted(ref.seqs) == sorted(pk.seq_ids)


def test_reference_out_of_blocks_changes_nothing():
    ref, pk = single.Reference(4, 4, watermark=0), BlockManager(4, 4, watermark=0)
    for m in (ref, pk):
        m.allocate(0, list(range(12)))
        m.fork(0, 1)
    # the child writes its shared last block (copy-on-write) and needs a new one: 2 blocks, 1 free
    assert _outcome(ref.append_slots, 1, [1, 2, 3, 4, 5]) == _outcome(pk.append_slots, 1, [1, 2, 3, 4, 5]) == \
        ("error", "OutOfBlocksError")
    assert ref.append_slots(1, [7]) == pk.append_slots(1, [7])  # the copy alone fits
    assert ref.block_table(1) == pk.block_table(1).tolist()
    assert _outcome(ref.allocate, 9, list(range(20))) == _outcome(pk.allocate, 9, list(range(20))) == \
        ("error", "PromptTooLongError")


def test_runner_tables_rebuild_pagedkv_step():
    """Fed pagedkv's own tables, the anchors' runner-side builders produce pagedkv's step arrays exactly."""
    bs, b = 4, 7
    pk = BlockManager(200, bs)
    rng = np.random.default_rng(0)
    for i in range(b):
        pk.allocate(i, rng.integers(0, 100, size=int(rng.integers(1, 12))))
    ids = list(range(b))
    pers = PersistentTables(bs, b, width=1)
    for i in ids:
        pers.add_row(i, pk.block_table(i).tolist())
    lists = ListTables(bs)
    for _ in range(10):
        before = [pk.block_table(i).tolist() for i in ids]
        res = pk.decode_step(ids, rng.integers(0, 100, size=b))
        tables = [pk.block_table(i).tolist() for i in ids]
        lens = [pk.num_tokens(i) for i in ids]
        deltas = [([*t[len(o):]],) if len(t) > len(o) else None for t, o in zip(tables, before)]
        for got in (lists.build(tables, lens), pers.build(np.arange(b), deltas, lens)):
            np.testing.assert_array_equal(got[0], res.slot_mapping)
            np.testing.assert_array_equal(got[1], res.block_tables)
            np.testing.assert_array_equal(got[2], res.seq_lens)
            assert (got[0].dtype, got[1].dtype, got[2].dtype) == (np.int64, np.int32, np.int32)


def test_quick_sweep_writes_results_and_chart(tmp_path, capsys):
    out, plots = tmp_path / "results", tmp_path / "plots"
    assert bench_main(["sweep", "--quick", "--impl", "pagedkv", "no-such-anchor", "--out", str(out),
                       "--plot", str(plots)]) == 0
    (path,) = out.glob("sweep-*.json")
    doc = json.loads(path.read_text())
    assert doc["kind"] == "sweep" and doc["command"].split()[1:4] == ["-m", "pagedkv.bench", "sweep"]
    assert doc["machine"]["cpu_count"] >= 1 and doc["versions"]["numpy"]
    assert "no-such-anchor" in doc["skipped"]
    keys = {(r["impl"], r["prefix_caching"], r["batch"]) for r in doc["results"]}
    assert keys == {(n, c, b) for n in ("pagedkv", "pagedkv-tables") for c in (False, True)
                    for b in sweep.QUICK_BATCH_SIZES}
    for r in doc["results"]:
        u = r["us_per_step"]
        assert 0 < u["min"] <= u["median"] <= u["max"]
    assert doc["ratios"] == []
    assert {p.name for p in plots.glob("*.png")} == {"sweep.png"}
    # the report merges several files
    capsys.readouterr()
    assert sweep.main(["report", str(path), str(path)]) == 0
    text = capsys.readouterr().out
    assert "| 8 |" in text and "prefix caching on" in text


def test_sweep_ratios_are_same_process_pairs():
    """Ratios come from the pagedkv and anchor runs of the same repeat (an anchor stand-in: pagedkv again)."""
    doc = sweep.run_sweep(["pagedkv"], batch_sizes=(1, 4), steps=4, repeats=2, skip=1, caching=(False,))
    assert len(doc["results"]) == 4 and all(len(r["runs_us"]) == 2 for r in doc["results"])
    two = sweep.merge([doc, doc])
    assert len(two["by"][("pagedkv", False, 4)]) == 2


def test_quick_single_writes_results(tmp_path, capsys):
    out = tmp_path / "results"
    assert bench_main(["single", "--quick", "--impl", "pagedkv", "no-such-anchor", "--out", str(out)]) == 0
    (path,) = out.glob("single-*.json")
    doc = json.loads(path.read_text())
    assert doc["kind"] == "single" and "no-such-anchor" in doc["skipped"]
    by = {(r["impl"], r["call"]): r for r in doc["results"]}
    assert set(by) == {(i, c) for i in ("reference", "pagedkv") for c in single.CALLS}
    assert by[("pagedkv", "append_slots")]["calls_per_repeat"] == 50 * 4
    assert by[("pagedkv", "free")]["calls_per_repeat"] == 100  # children, then parents
    for c in single.CALLS:
        q = by[("pagedkv", c)]["ratio_to_reference"]
        assert 0 < q["min"] <= q["median"] <= q["max"]
    assert "| append_slots | pagedkv |" in capsys.readouterr().out
