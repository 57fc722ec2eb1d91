"""The tiered replay (pagedkv.replay.tiered): GPU -> CPU -> disk -> shared, hits counted per tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from pagedkv import InvalidArgumentError
from pagedkv.cli import main as cli_main
from pagedkv.replay import parse_trace_lines, replay_sequence
from pagedkv.replay.tiered import ChainTier, LruTier, replay_tiered
from pagedkv.tiers import DiskBackend

SAMPLE = Path(__file__).parent / "data" / "mooncake_conversation_sample.jsonl"
T = 512  # one trace block; the replays below use blocks of 512 tokens, one per hash id


def trace_of(*reqs):
    """reqs: (input_length, hash_ids)."""
    return parse_trace_lines([json.dumps({"timestamp": 0, "input_length": n, "output_length": 0, "hash_ids": ids})
                              for n, ids in reqs], "hand")


# Blocks of 512 tokens, GPU 3 blocks, no CPU tier, disk 1 block, shared 4 blocks. "A", "AB" name chain nodes.
GOLDEN = trace_of(
    (2 * T + 1, [1, 2, 90]),  # R0 AB: miss. GPU caches A, AB; shared <- AB, A (children first)
    (2 * T + 1, [3, 4, 91]),  # R1 CD: miss; the GPU evicts AB then A (tail first) -> disk keeps A (1 block)
    (2 * T + 1, [1, 2, 92]),  # R2 AB: A from disk, AB from shared; GPU evicts CD, C -> disk keeps C
    (2 * T + 1, [3, 4, 93]),  # R3 CD: C from disk, CD from shared; GPU evicts AB, A -> disk keeps A
    (3 * T + 1, [1, 2, 5, 94]),  # R4: 4 blocks > 3: skipped, changes nothing
    (2 * T, [1, 2]),  # R5 AB (2 full blocks, lookup capped at 1): A from disk. GPU evicts CD -> disk keeps CD
    (2 * T + 1, [1, 2, 95]),  # R6 AB: both on the GPU (R5 cached them)
)


def test_golden_hits_per_tier():
    p = replay_tiered(GOLDEN, 3 * T, block_size=T, disk_capacity_tokens=T, shared_capacity_tokens=4 * T,
                      check_every=1)
    assert (p.requests, p.skipped, p.prompt_tokens) == (6, 1, 5 * (2 * T + 1) + 2 * T)
    assert p.disk_hit_tokens == 3 * T  # R2 A, R3 C, R5 A
    assert p.shared_hit_tokens == 2 * T  # R2 AB, R3 CD
    assert p.cpu_hit_tokens is None
    assert p.hit_tokens == 7 * T  # + R6's 2 blocks on the GPU
    assert p.gpu_hit_rate * p.prompt_tokens == pytest.approx(2 * T)
    assert p.extra["disk_blocks_held"] == 1 and p.extra["shared_blocks_held"] == 4


def test_golden_without_the_lower_tiers_is_the_plain_replay():
    p = replay_tiered(GOLDEN, 3 * T, block_size=T, check_every=1)
    q = replay_sequence(GOLDEN, 3 * T, block_size=T)
    assert p.hit_tokens == q.hit_tokens == 2 * T
    assert p.disk_hit_tokens is None and p.shared_hit_tokens is None


def test_a_bigger_disk_tier_serves_what_shared_did():
    # disk of 4 blocks holds every evicted block: R2 and R3 come whole from disk, the shared tier is never reached
    p = replay_tiered(GOLDEN, 3 * T, block_size=T, disk_capacity_tokens=4 * T, shared_capacity_tokens=4 * T)
    assert (p.disk_hit_tokens, p.shared_hit_tokens, p.hit_tokens) == (5 * T, 0, 7 * T)


def test_shared_tier_alone_is_written_through():
    # no disk: every block entered the GPU cache is in shared (4 blocks: A, AB, C, CD all fit)
    p = replay_tiered(GOLDEN, 3 * T, block_size=T, shared_capacity_tokens=4 * T)
    assert (p.disk_hit_tokens, p.shared_hit_tokens, p.hit_tokens) == (None, 5 * T, 7 * T)


@pytest.mark.parametrize("cpu", [0, 300_000])
def test_zero_capacity_tiers_equal_no_tier_and_totals_add_up(cpu):
    from pagedkv.replay.trace import load_trace

    tr = load_trace(SAMPLE, 150)
    base = replay_sequence(tr, 100_000, cpu_capacity_tokens=cpu)
    zero = replay_tiered(tr, 100_000, cpu_capacity_tokens=cpu, disk_capacity_tokens=0, shared_capacity_tokens=0,
                         check_every=25)
    assert (zero.hit_tokens, zero.cpu_hit_tokens, zero.evictions) == (base.hit_tokens, base.cpu_hit_tokens,
                                                                      base.evictions)
    assert zero.disk_hit_tokens is None and zero.shared_hit_tokens is None
    tiny = replay_tiered(tr, 100_000, cpu_capacity_tokens=cpu, disk_capacity_tokens=15, shared_capacity_tokens=15)
    assert tiny.disk_hit_tokens == tiny.shared_hit_tokens == 0  # less than a block: a tier of 0 blocks
    assert tiny.hit_tokens == base.hit_tokens
    full = replay_tiered(tr, 100_000, cpu_capacity_tokens=cpu, disk_capacity_tokens=1_000_000,
                         shared_capacity_tokens=3_000_000, check_every=25)
    # the lower tiers never change what the GPU and CPU serve; they add to it
    assert full.cpu_hit_tokens == base.cpu_hit_tokens and full.evictions == base.evictions
    assert full.disk_hit_tokens > 0 and full.shared_hit_tokens > 0
    parts = full.hit_tokens - full.disk_hit_tokens - full.shared_hit_tokens
    assert parts == base.hit_tokens
    total = full.gpu_hit_rate + full.cpu_hit_rate + full.disk_hit_rate + full.shared_hit_rate
    assert total == pytest.approx(full.hit_rate)
    assert full.hit_tokens <= full.prompt_tokens


def test_bad_capacities_raise():
    with pytest.raises(InvalidArgumentError):
        replay_tiered(GOLDEN, 3 * T, block_size=T, disk_capacity_tokens=-1)
    with pytest.raises(InvalidArgumentError):
        LruTier(-1)


# ---------------------------------------------------------------- LruTier follows DiskBackend's eviction rules
_ops = st.lists(st.tuples(st.sampled_from(["put", "read"]), st.lists(st.integers(0, 9), max_size=4)), max_size=40)


@settings(max_examples=40, deadline=None)
@given(cap=st.integers(0, 5), ops=_ops)
def test_lru_tier_matches_a_disk_backend(tmp_path_factory, cap, ops):
    value = b"x" * 10
    tier = LruTier(cap)
    disk = DiskBackend(tmp_path_factory.mktemp("d"), capacity_bytes=max(cap, 1) * len(value), fsync=False)
    try:
        for op, keys in ops:
            names = [f"{k:032x}" for k in keys]
            if op == "put":
                tier.put_many(keys)
                if cap:  # DiskBackend's bound is >= 1 byte; a tier of 0 blocks stores nothing (TOO_LARGE there)
                    disk.write_many(names, [value] * len(names))
            else:
                got = tier.read_many(keys)
                if cap:
                    assert got == sum(v is not None for v in disk.read_many(names))
            tier.check_invariants()
            if cap:
                assert sorted(tier.keys()) == sorted(int(n, 16) for n in disk.eviction_order())
                assert tier.keys() == [int(n, 16) for n in disk.eviction_order()]  # the same LRU order
            else:
                assert len(tier) == 0
    finally:
        disk.close()


# ---------------------------------------------------------------- the command
def test_command_tiers(capsys, tmp_path):
    out = tmp_path / "t.json"
    rc = cli_main(["replay", str(SAMPLE), "--limit", "40", "--capacity", "100k", "--cpu-capacity", "100k",
                   "--disk-capacity", "1M", "--shared-capacity", "300k", "--bound", "--no-progress",
                   "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "disk hit" in text and "shared hit" in text
    p = json.loads(out.read_text())["points"][0]
    assert p["disk_capacity_tokens"] == 1_000_000 and p["shared_capacity_tokens"] == 300_000
    assert p["hit_rate"] == pytest.approx(p["gpu_hit_rate"] + p["cpu_hit_rate"] + p["disk_hit_rate"]
                                          + p["shared_hit_rate"])
    assert p["hit_rate"] <= p["bound"] + 1e-12  # the bound of one pool of the tiers' total


@pytest.mark.parametrize("extra", [["--mode", "timed"], ["--replicas", "2"], ["--groups", "gemma3"]])
def test_command_tiers_refused_where_not_modelled(capsys, extra):
    rc = cli_main(["replay", str(SAMPLE), "--limit", "5", "--capacity", "100k", "--disk-capacity", "1M",
                   "--no-progress", *extra])
    assert rc == 2 and "--disk-capacity" in capsys.readouterr().err


def test_decimal_token_counts():
    from pagedkv.replay.__main__ import parse_tokens

    assert parse_tokens("33.3M") == 33_300_000 and parse_tokens("2.5k") == 2_500
    with pytest.raises(Exception, match="not a token count"):
        parse_tokens("1.00001k")


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(1, 5),
       ops=st.lists(st.tuples(st.sampled_from(["put", "get"]), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
                    max_size=30))
def test_chain_tier_matches_a_disk_backend_given_parents(tmp_path_factory, cap, ops):
    # the replay's chain tier (issue 34) against a real DiskBackend given the same parents: block k's parent is
    # k - 1 (k = 0, 5: roots), two chains of five
    value = b"x" * 10
    tier = ChainTier(cap)
    disk = DiskBackend(tmp_path_factory.mktemp("d"), capacity_bytes=cap * len(value), fsync=False)
    par = {k: (None if k % 5 == 0 else k - 1) for k in range(10)}
    name = "{:032x}".format
    try:
        for op, keys in ops:
            if op == "put":
                tier.put_many(keys, parents=[par[k] for k in keys])
                disk.write_many([name(k) for k in keys], [value] * len(keys),
                                [None if par[k] is None else name(par[k]) for k in keys])
            else:
                assert tier.read_many(keys) == sum(v is not None for v in disk.read_many([name(k) for k in keys]))
            tier.check_invariants()
            disk.check_invariants()
            assert tier.keys() == [int(n, 16) for n in disk.eviction_order()]  # the same eviction order
            assert tier.refused == disk.refused_orphans
    finally:
        disk.close()
