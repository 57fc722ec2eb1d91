"""Tier retention that keeps what prefixes need (issue 34 item 1): a full disk tier evicts a chain's tail before
its head, values whose parent is gone first, and never keeps a tail no load can reach; across restarts too.
ChainOrder checked against a brute-force model."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv
from pagedkv.tiers import BlockStore, DiskBackend, ModelFingerprint, PutStatus, codec
from pagedkv.tiers.chain_order import LEAF, ORPHAN, ChainOrder

import numpy as np

FP = ModelFingerprint("test-model", "float32", 16, "L2,2,B,H1,D8")
PB = 1024
VB = PB + codec.OVERHEAD_BYTES


def chain(n: int, seed: int) -> list[int]:
    return pagedkv.block_hashes(list(range(seed, seed + 16 * n)), 16)


def put_chain(s: BlockStore, ks: list[int], batch: int = 8) -> list:
    """As the engine's connector stores a prompt: in calls of ``batch`` blocks, each block's parent the one
    before it."""
    out = []
    for a in range(0, len(ks), batch):
        sub = ks[a:a + batch]
        out += s.put_many(sub, [np.zeros(PB // 4, np.float32)] * len(sub),
                          parents=[ks[i - 1] if i else None for i in range(a, a + len(sub))])
    return out


def reachable_only(b: DiskBackend, s: BlockStore, chains: list[list[int]]) -> None:
    """Every stored value of these chains lies on a stored prefix (its parent stored, or it is a root)."""
    for ks in chains:
        held = s.contains_many(ks)
        n = s.prefix_length(ks)
        assert not any(held[n:]), f"a tail is kept without its head: prefix {n}, held {held}"


def test_two_prompts_both_keep_their_heads_across_a_restart(tmp_path):
    # the reproduction: a tier of 88 blocks, two different 57-block prompts A then B, a restart. Plain
    # LRU kept B whole and A's last 31 blocks (unreachable: A hit 0 blocks); now A keeps its first 31
    a, b_ = chain(57, 0), chain(57, 10_000)
    be = DiskBackend(tmp_path, 88 * VB, fsync=False)
    s = BlockStore(be, FP, PB)
    assert put_chain(s, a) == [PutStatus.STORED] * 57
    assert put_chain(s, b_) == [PutStatus.STORED] * 57
    be.check_invariants()
    be.close()
    be = DiskBackend(tmp_path, 88 * VB, fsync=False)  # restart
    s = BlockStore(be, FP, PB)
    assert s.prefix_length(b_) == 57
    assert s.prefix_length(a) == 88 - 57
    reachable_only(be, s, [a, b_])
    # the parents survived the restart: a third prompt evicts the least recently used chain (A) from its tail
    # to its head, then B's tail; never a head before its tail
    c = chain(40, 20_000)
    put_chain(s, c)
    be.check_invariants()
    assert s.prefix_length(c) == 40
    assert s.prefix_length(a) + s.prefix_length(b_) == 88 - 40
    assert s.prefix_length(a) == 0 and s.prefix_length(b_) == 57 - 9
    reachable_only(be, s, [a, b_, c])
    be.close()


def test_a_tier_smaller_than_one_prompt_keeps_its_head_and_no_dead_tail(tmp_path):
    # 29 blocks for two 57-block prompts: before, 29 blocks stored and nothing hit; now the newest prompt's
    # first 29 blocks, and a block whose own parent is the next victim is refused (it would cut its chain)
    a, b_ = chain(57, 0), chain(57, 10_000)
    be = DiskBackend(tmp_path, 29 * VB, fsync=False)
    s = BlockStore(be, FP, PB)
    put_chain(s, a)
    assert s.prefix_length(a) == 29 and be.num_values == 29
    put_chain(s, b_)
    assert s.prefix_length(b_) == 29 and be.num_values == 29 and s.prefix_length(a) == 0
    assert be.refused_orphans == 2 * (57 - 29)
    reachable_only(be, s, [a, b_])
    be.check_invariants()
    be.close()


def test_values_whose_parent_is_gone_go_first(tmp_path):
    a, b_ = chain(6, 0), chain(6, 10_000)
    be = DiskBackend(tmp_path, 12 * VB, fsync=False)
    s = BlockStore(be, FP, PB)
    put_chain(s, a)
    put_chain(s, b_)
    be.discard_many(s.names(b_[:1]))  # B's head dropped (corrupt, say): B's other 5 blocks are dead weight
    s.get_many(b_[1:])  # (even if just read: recency does not save them)
    c = chain(6, 20_000)
    assert put_chain(s, c) == [PutStatus.STORED] * 6
    assert s.prefix_length(a) == 6 and s.prefix_length(c) == 6
    assert not any(s.contains_many(b_))
    be.check_invariants()
    # a value whose parent was never here is a live block (a write-back sends a chain's tail before its head):
    # stored into a full tier, then its parent comes, spares it, and they are one chain
    d = chain(3, 30_000)
    z = [np.zeros(PB // 4, np.float32)]
    assert s.put_many(d[2:3], z, parents=[d[1]]) == (PutStatus.STORED,)
    assert s.put_many(d[1:2], z, parents=[d[0]]) == (PutStatus.STORED,)
    assert s.put_many(d[:1], z) == (PutStatus.STORED,)
    assert s.prefix_length(d) == 3 and be.num_values == 12
    be.check_invariants()
    be.close()


def test_without_parents_it_is_plain_lru(tmp_path):
    ks = chain(6, 0)
    be = DiskBackend(tmp_path, 4 * VB, fsync=False)
    s = BlockStore(be, FP, PB)
    for k in ks:
        s.put_many([k], [np.zeros(PB // 4, np.float32)])
    assert s.contains_many(ks) == (False, False, True, True, True, True)
    be.close()


class _Model:
    """ChainOrder's rule by brute force: O(n) per victim."""

    def __init__(self):
        self.parent, self.last, self.lost, self.t = {}, {}, set(), 0

    def add(self, n, p, orphan=False):
        self.t += 1
        self.parent[n], self.last[n] = p, self.t
        if orphan and p is not None and p not in self.parent:
            self.lost.add(n)
        self.lost -= {k for k, q in self.parent.items() if q == n}

    def touch(self, n):
        self.t += 1
        self.last[n] = self.t

    def remove(self, n):
        self.parent.pop(n)
        self.last.pop(n)
        self.lost.discard(n)
        self.lost |= {k for k, q in self.parent.items() if q == n}

    def victim(self):
        kids = {p for p in self.parent.values() if p is not None}
        best = None
        for n in self.parent:
            c = ORPHAN if n in self.lost else (LEAF if n not in kids else None)
            if c is not None and (best is None or (c, self.last[n]) < best[0]):
                best = ((c, self.last[n]), n)
        return None if best is None else best[1]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("aotrv"), st.integers(0, 11), st.integers(-1, 11)), max_size=80))
def test_chain_order_against_a_brute_force_model(ops):
    o, m = ChainOrder(), _Model()
    for op, n, p in ops:
        if op in "ao" and n not in m.parent:
            par = None if p < 0 or p >= n else p  # (a chain: no cycles)
            o.add(n, par, op == "o")
            m.add(n, par, op == "o")
        elif op == "t" and n in m.parent:
            o.touch(n)
            m.touch(n)
        elif op == "r":
            o.remove(n)
            if n in m.parent:
                m.remove(n)
        elif op == "v":
            got = o.pop()
            assert got == m.victim()
            if got is not None:
                m.remove(got)
        o.check_invariants()
        assert o.victim() == m.victim()
        assert len(o) == len(m.parent)


def test_a_bounded_shared_dir_sweeps_tails_first(tmp_path):
    # --kv-shared file:///DIR --kv-shared-gib: past the bound the writing replica sweeps to 90% of it, a chain's
    # tail before its head (before: unbounded; sweep() deleted the oldest values, a prompt's first blocks)
    from pagedkv.tiers import SharedDirBackend

    a, b_ = chain(15, 0), chain(15, 10_000)
    be = SharedDirBackend(tmp_path, fsync=False, max_bytes=20 * VB)
    s = BlockStore(be, FP, PB)
    put_chain(s, a)
    put_chain(s, b_)
    assert be.swept > 0
    held_a, held_b = s.prefix_length(a), s.prefix_length(b_)
    assert held_b == 15 and 0 < held_a < 15
    reachable_only(None, s, [a, b_])
    assert sum(s.contains_many(a + b_)) <= 20
    # another replica over the same directory, bounded too, finds the directory over its bound at open: swept
    other = SharedDirBackend(tmp_path, fsync=False, max_bytes=10 * VB)
    assert sum(s.contains_many(a + b_)) <= 10 and other.swept > 0


def test_redis_with_a_bound_of_our_own_evicts_tails_first(tmp_path):
    # RedisBackend(max_bytes=): before, only the server's maxmemory + allkeys-lru (a prompt's first blocks
    # were the least recently used: evicted first)
    import shutil

    if shutil.which("redis-server") is None and os.environ.get("CI") != "true":
        import pytest

        pytest.skip("no redis-server")
    from redis_server import RedisServer

    from pagedkv.tiers import RedisBackend

    srv = RedisServer(tmp_path)
    try:
        be = RedisBackend(srv.url, prefix="b:", max_bytes=20 * VB)
        s = BlockStore(be, FP, PB)
        a, b_ = chain(15, 0), chain(15, 10_000)
        put_chain(s, a)
        put_chain(s, b_)
        assert be.evictions > 0
        assert s.prefix_length(b_) == 15 and 0 < s.prefix_length(a) < 15
        reachable_only(None, s, [a, b_])
        assert sum(s.contains_many(a + b_)) <= 20
        assert s.prefix_length(a) == 3  # (20 values past the bound: down to 18)
        s.get_many(a[:2])  # a read makes A's head recent: past A's tail leaf, the next evictions take B's tail
        put_chain(s, chain(3, 20_000))  # 21 values: 3 go, A's last block then B's last two
        assert s.prefix_length(a) == 2 and s.prefix_length(b_) == 13
        reachable_only(None, s, [a, b_])
        be.close()
    finally:
        srv.stop()
