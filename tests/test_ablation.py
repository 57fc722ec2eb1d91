"""The ablation variants implement pagedkv's decode semantics exactly, and the ablation runs end to end."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from pagedkv.bench import ablation
from pagedkv.bench.ablation import VARIANTS, normalize
from pagedkv.errors import OutOfBlocksError

OTHERS = [name for name in VARIANTS if name != "pagedkv"]


def _script(cls, seed, tables, num_blocks=400, block_size=4, ops=150):
    """A random but variant-independent sequence of allocate / fork / free / decode steps (batches are random
    subsets in random order, so copy-on-write, the last-writer rule and block reuse after free all occur).
    Returns every step's normalised result and the final free list and refcounts."""
    rng = random.Random(seed)
    mgr = cls(num_blocks, block_size)
    live, next_id, trace = [], 0, []
    for _ in range(ops):
        r = rng.random()
        if r < 0.15 or not live:
            mgr.allocate(next_id, np.ones(rng.randint(1, 13), dtype=np.int32))
            live.append(next_id)
            next_id += 1
        elif r < 0.3:
            mgr.fork(rng.choice(live), next_id)
            live.append(next_id)
            next_id += 1
        elif r < 0.38 and len(live) > 1:
            victim = live.pop(rng.randrange(len(live)))
            mgr.free(victim)
            trace.append(("free", victim))
        else:
            batch = rng.sample(live, rng.randint(1, len(live)))
            res = mgr.step(batch, np.arange(len(batch), dtype=np.int32), tables)
            trace.append(normalize(res))
    return trace, mgr.free_ids(), mgr.refcounts()


@pytest.mark.parametrize("tables", [True, False])
@pytest.mark.parametrize("name", OTHERS)
def test_variant_matches_pagedkv(name, tables):
    for seed in range(4):
        want = _script(VARIANTS["pagedkv"], seed, tables)
        got = _script(VARIANTS[name], seed, tables)
        assert any(step[3] for step in want[0] if step[0] != "free"), "the script must exercise copy-on-write"
        assert got[0] == want[0], f"{name} seed {seed}: step results differ"
        assert got[1] == want[1], f"{name} seed {seed}: free lists differ"
        assert got[2] == want[2], f"{name} seed {seed}: refcounts differ"


def _seed_workload(cls, batch=12, prompt_len=20, steps=40, block_size=16):
    mgr = cls(batch * 4 + 8, block_size)
    for i in range(batch):
        mgr.allocate(i, np.ones(prompt_len, dtype=np.int32))
    ids, toks = list(range(batch)), np.zeros(batch, dtype=np.int32)
    return [normalize(mgr.step(ids, toks, True)) for _ in range(steps)]


@pytest.mark.parametrize("name", OTHERS)
def test_seed_workload_matches(name):
    assert _seed_workload(VARIANTS[name]) == _seed_workload(VARIANTS["pagedkv"])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_out_of_blocks_is_all_or_nothing(name):
    """A step short of blocks raises and changes nothing; the exact count applies the last-writer rule."""
    mgr = VARIANTS[name](3, 4)
    mgr.allocate("a", np.ones(7, dtype=np.int32))  # blocks 0, 1 (1 is partial); block 2 free
    mgr.fork("a", "b")
    mgr.fork("a", "c")
    before = (mgr.free_ids(), mgr.refcounts())
    with pytest.raises(OutOfBlocksError):
        mgr.step(["a", "b", "c"], np.zeros(3, dtype=np.int32))  # a and b copy, c keeps: needs 2, 1 free
    assert (mgr.free_ids(), mgr.refcounts()) == before
    with pytest.raises(OutOfBlocksError):
        mgr.step(["c", "a"], np.zeros(2, dtype=np.int32))  # two of three holders write: both copy, needs 2
    assert (mgr.free_ids(), mgr.refcounts()) == before
    res = normalize(mgr.step(["c"], np.zeros(1, dtype=np.int32)))  # one writer copies: fits
    assert res[3] == ((1, 2),)
    assert mgr.refcounts() == [3, 2, 1]


def test_out_of_blocks_exact_count_allows_tight_fit():
    for name, cls in VARIANTS.items():
        mgr = cls(4, 4)
        mgr.allocate("a", np.ones(7, dtype=np.int32))
        mgr.fork("a", "b")
        mgr.fork("a", "c")  # 2 free blocks, batch of 3: the exact count (2 copies) says it fits
        res = normalize(mgr.step(["a", "b", "c"], np.zeros(3, dtype=np.int32)))
        assert res[3] == ((1, 2), (1, 3)), name
        assert mgr.refcounts() == [3, 1, 1, 1], name


def test_quick_run_and_report(tmp_path):
    out = tmp_path / "ablation.json"
    assert ablation.main(["--quick", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["results"]["step"]) == set(VARIANTS)
    assert set(result["results"]["append"]) == set(VARIANTS) - {"pagedkv-accessors"}
    for mode in ablation.MODES:
        for row in result["results"][mode].values():
            assert len(row["median_us"]) == 2 and row["min"] <= row["median"] <= row["max"]
            assert row["vs_pagedkv"]["lo"] <= row["vs_pagedkv"]["ratio"] <= row["vs_pagedkv"]["hi"]
    assert {v["question"] for v in result["verdicts"]["step"]} == {q[0] for q in ablation.QUESTIONS}
    designs = {r["design"]: r for r in result["memory"]["rows"]}
    assert designs["pagedkv"]["refcounts_bytes_per_block"] == pytest.approx(4, abs=0.5)
    assert designs["py-list"]["refcounts_bytes_per_block"] == pytest.approx(8, abs=0.5)
    assert designs["py-dict"]["refcounts_bytes_per_block"] > designs["py-list"]["refcounts_bytes_per_block"]
    text = ablation.format_table(result)
    for name in VARIANTS:
        assert name in text


def test_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv.bench.ablation", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "--quick" in proc.stdout
