"""Window retention of HybridBlockManager (pagedkv.hybrid._retention, pagedkv.blocks.evictor.RetentionEvictor): released
sliding-window blocks outside the windows before useful points are evicted first, so hybrid prefix hits survive
memory pressure that plain LRU turns into misses; invariants hold throughout."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv import FullAttentionSpec, BlockManager, HybridBlockManager, SlidingWindowSpec
from pagedkv.errors import InvalidArgumentError
from pagedkv.blocks.evictor import RetentionEvictor

BS = 4
GROUPS = [FullAttentionSpec(), SlidingWindowSpec(16), SlidingWindowSpec(16), SlidingWindowSpec(16)]  # k = 4


def test_retention_evictor_evicts_spare_blocks_first_each_class_in_lru_order():
    ev = RetentionEvictor(20)
    ev.push_many(np.array([1, 2, 3, 4, 5], dtype=np.int32))
    ev.demote_many(np.array([4, 2, 9], dtype=np.int32))  # 9 is not in the evictor: ignored
    ev.push(6)
    assert len(ev) == 6 and 4 in ev and 9 not in ev
    assert list(ev) == [4, 2, 1, 3, 5, 6]
    ev.discard(2)  # a spare one
    ev.discard_many(np.array([3], dtype=np.int32))
    assert list(ev) == [4, 1, 5, 6]
    assert ev.pop() == 4 and ev.pop_many(2).tolist() == [1, 5] and len(ev) == 1
    ev.demote_many(np.array([6], dtype=np.int32))
    ev.push_many(np.array([7, 8], dtype=np.int32))
    assert ev.pop_many(3).tolist() == [6, 7, 8] and len(ev) == 0


def _conversation(retention: bool, others: int, interval=None) -> int:
    """Turn 1 of a conversation (30 blocks) is cached, ``others`` unrelated prompts pass through a small pool,
    then turn 2 (turn 1 + 20 tokens) arrives: its hybrid hit in tokens."""
    bm = BlockManager(4 * 60, BS, kv_cache_groups=GROUPS, enable_prefix_caching=True, watermark=0,
                            window_retention=retention, retention_interval=interval, grouped_results=True)
    rng = np.random.default_rng(1)
    first = rng.integers(0, 1000, 120)
    bm.allocate(0, first)
    bm.free(0)
    for i in range(others):
        bm.allocate(10 + i, rng.integers(0, 1000, 40))
        bm.free(10 + i)
        bm.check_invariants()
    hit = bm.allocate(1, np.concatenate([first, rng.integers(0, 1000, 20)]))
    bm.check_invariants()
    return hit


def test_retention_keeps_a_conversation_hit_that_plain_lru_loses():
    # 4 unrelated prompts: with plain LRU the pool's pressure evicts turn 1's full-group tail (freed first, so
    # least recent) and the hit collapses; with retention the sliding groups' blocks outside turn 1's last
    # window go first and the whole turn-1 prefix still hits
    assert [_conversation(True, n) for n in (0, 4, 6)] == [120, 120, 120]
    assert [_conversation(False, n) for n in (0, 4, 6)] == [120, 0, 0]
    # with enough pressure both lose it
    assert _conversation(True, 10) == 0


def test_window_released_during_decode_is_kept_only_before_useful_points():
    bm = BlockManager(400, BS, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(8)],
                            enable_prefix_caching=True, grouped_results=True)  # k = 2
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, 40)  # 10 blocks: kept during steps: positions 7, 8, 9 (windows at 10 and 9)
    bm.allocate(0, prompt)
    for _ in range(12):  # 52 tokens: positions 0..10 released
        bm.decode_step([0], [5])
    ev = bm._cache.evictor
    kept = sorted(int(b) for b in ev.main)
    spare = sorted(int(b) for b in ev.spare)
    assert len(kept) == 3 and len(spare) == 8  # (position 10 is not before a useful point)
    bm.free(0)  # the sequence end (13 blocks): its last window (11, 12) and every full block are kept
    assert len(ev.main) == 3 + 2 + 13 and len(ev.spare) == 8
    bm.check_invariants()
    # the next turn (with the answer) and the same prompt again both hit through the kept windows
    assert bm.allocate(1, np.concatenate([prompt, [5] * 12, [9] * 8])) == 52
    assert bm.allocate(2, np.concatenate([prompt, [7] * 3])) == 40
    assert bm.allocate(3, prompt) == 36  # (a hit stops before the last token: the window at 9 blocks)
    bm.check_invariants()


def test_interval_points_keep_windows_inside_a_prompt():
    """A prefix shared up to an arbitrary point (a document) hits at the last multiple of the interval before
    the point where the prompts differ, once pressure evicted the spare blocks."""
    def run(interval):
        bm = BlockManager(4 * 70, BS, kv_cache_groups=GROUPS, enable_prefix_caching=True, watermark=0,
                                retention_interval=interval, grouped_results=True)
        rng = np.random.default_rng(2)
        doc = rng.integers(0, 1000, 120)
        bm.allocate(0, np.concatenate([doc, rng.integers(0, 1000, 40)]))
        bm.free(0)
        for i in range(4):
            bm.allocate(10 + i, rng.integers(0, 1000, 40))
            bm.free(10 + i)
        hit = bm.allocate(1, np.concatenate([doc, rng.integers(0, 1000, 40)]))
        bm.check_invariants()
        return hit
    assert run(0) == 0 and run(None) == 0  # none, and the default (16 windows = 256 tokens: past this prompt)
    assert run(64) == 64  # 120 shared tokens: the window at 64 tokens survived (and the full prefix)
    with pytest.raises(InvalidArgumentError):
        BlockManager(40, BS, kv_cache_groups=GROUPS, enable_prefix_caching=True, retention_interval=-1, grouped_results=True)


@pytest.mark.parametrize("seed", range(4))
def test_random_calls_keep_the_invariants_with_retention(seed):
    rng = random.Random(seed)
    bm = BlockManager(160, BS, kv_cache_groups=GROUPS, enable_prefix_caching=True, watermark=0,
                            retention_interval=rng.choice([None, 16, 32]), grouped_results=True)
    prompts = [[rng.randrange(50) for _ in range(rng.randint(4, 48))] for _ in range(6)]
    live, nid = [], 0
    for _ in range(300):
        r = rng.random()
        try:
            if r < 0.3 or not live:
                p = rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randint(0, 12))]
                bm.allocate(nid, p)
                live.append(nid)
                nid += 1
            elif r < 0.4:
                bm.fork(rng.choice(live), nid)
                live.append(nid)
                nid += 1
            elif r < 0.6:
                bm.free(live.pop(rng.randrange(len(live))))
            else:
                batch = rng.sample(live, rng.randint(1, len(live)))
                bm.decode_step(batch, [rng.randrange(50) for _ in batch])
        except Exception as e:  # out of blocks: nothing changed
            assert type(e).__name__ in ("OutOfBlocksError", "PromptTooLongError"), e
        bm.take_copy_plan()
        bm.check_invariants()


def test_replay_groups_command_on_the_sample_trace(tmp_path, capsys):
    """``pagedkv replay --groups gemma3``: one table, groups and groups without retention at equal KV bytes on the
    repository's 300-request sample; the groups hold more full-attention tokens and hit at least as much."""
    import json
    from pathlib import Path

    from pagedkv.cli import main as cli_main

    sample = Path(__file__).parent / "data" / "mooncake_conversation_sample.jsonl"
    out = tmp_path / "g.json"
    rc = cli_main(["replay", str(sample), "--groups", "gemma3", "--capacity", "200k", "--compare-lru",
                   "--no-progress", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    by = {p["impl"]: p for p in doc["points"]}
    assert set(by) == {"one table", "groups", "groups, plain LRU"} and doc["windows"] == [None] + [512] * 5
    assert by["groups"]["hit_rate"] >= by["one table"]["hit_rate"] > 0
    assert by["groups"]["extra"]["tokens_held"] > 2 * by["one table"]["extra"]["tokens_held"]
    assert by["groups, plain LRU"]["extra"]["tokens_held"] < by["groups"]["extra"]["tokens_held"]
    assert "| 200,000 | groups |" in capsys.readouterr().out
    assert cli_main(["replay", str(sample), "--groups", "llama9"]) == 2
    assert "unknown --groups preset" in capsys.readouterr().err
