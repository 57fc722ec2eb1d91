"""TierConnector (torch-free): lookups walk the tiers in order (disk, then shared) from the GPU/CPU hit on, loads
and stores run on its I/O threads, completions say done or failed with the good leading blocks, stores emit KV
events with the tier's medium, a tier slower than computing is skipped (the crossover), a store that is down
answers "nothing held", and the counters and the latency histogram count what happened."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import pagedkv
from pagedkv.errors import InvalidArgumentError
from pagedkv.tiers import (Backend, BlockStore, DiskBackend, ModelFingerprint, PutStatus, SharedDirBackend,
                           check_digests)
from pagedkv.tiers.backend import FAILED
from pagedkv.tiers.connector import LoadLatencyHistogram, TierConnector

BS = 4
PB = 64  # payload bytes per block
FP = ModelFingerprint("test-weights", "float32", BS, "L1,2,B4,H1,D2")


def payload(i: int) -> np.ndarray:
    return np.full(PB // 4, i, np.float32)


def tokens(n_blocks: int, seed: int = 0) -> list[int]:
    return list(range(seed, seed + BS * n_blocks + 1))  # one token more: the last one is always computed


def wait_loads(c: TierConnector, n: int = 1, timeout: float = 10.0) -> list:
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, "load did not finish"
        c.wait(0.05)
        out += c.poll()
    return out


@pytest.fixture
def tiers(tmp_path):
    disk = BlockStore(DiskBackend(tmp_path / "disk", 1 << 20), FP, PB)
    shared = BlockStore(SharedDirBackend(tmp_path / "shared"), FP, PB)
    c = TierConnector([("DISK", disk), ("SHARED", shared)], BS)
    yield c, disk, shared
    c.close()


def test_lookup_walks_disk_then_shared_from_the_hit(tiers):
    c, disk, shared = tiers
    toks = tokens(6)
    keys = pagedkv.block_hashes(toks, BS, "ns")
    ch = check_digests(toks, BS, "ns")
    disk.put_many(keys[:3], [payload(i) for i in range(3)], "ns", ch[:3])  # blocks 0-2 on disk
    shared.put_many(keys[3:5], [payload(i) for i in range(3, 5)], "ns", ch[3:5])  # 3-4 in the shared tier
    assert c.request_load("r", toks, "ns", hit_blocks=1)  # blocks 0 on the GPU: ask from block 1
    (r,) = wait_loads(c)
    assert r.request_id == "r" and r.ok and r.start_block == 1 and r.num_asked == 4
    assert [int(np.frombuffer(p, np.float32)[0]) for p in r.payloads] == [1, 2, 3, 4]
    assert r.by_tier == (("DISK", 2), ("SHARED", 2))
    d, s = c.counters()
    assert (d.hit_blocks, s.hit_blocks, d.hit_bytes) == (2, 2, 2 * PB)
    cum, total, count = c.latency.snapshot()
    assert count == 1 and cum[-1] == 1 and total > 0
    assert c.poll() == [] and c.num_pending_loads == 0


def test_nothing_to_ask_and_other_namespace(tiers):
    c, disk, _ = tiers
    toks = tokens(3)
    assert not c.request_load("r", toks, None, hit_blocks=3)  # the hit already covers every full block
    disk.put_many(pagedkv.block_hashes(toks, BS, "a"), [payload(i) for i in range(3)], "a",
                  check_digests(toks, BS, "a"))
    assert c.request_load("r", toks, "b", hit_blocks=0)  # another tenant's blocks are never loaded
    (r,) = wait_loads(c)
    assert r.ok and r.payloads == () and r.num_asked == 0
    with pytest.raises(InvalidArgumentError):
        c.request_load("x", toks, None, 0) and c.request_load("x", toks, None, 0)


def test_a_corrupted_value_fails_the_load_with_the_good_leading_blocks(tiers, tmp_path):
    c, disk, _ = tiers
    toks = tokens(4)
    keys = pagedkv.block_hashes(toks, BS)
    disk.put_many(keys, [payload(i) for i in range(4)], checks=check_digests(toks, BS))
    name = disk.names(keys[2:3])[0]
    path = next(os.path.join(dp, f) for dp, _, fs in os.walk(tmp_path / "disk") for f in fs if f.startswith(name))
    with open(path, "r+b") as f:  # flip a byte of block 2's payload
        f.seek(60)
        b = f.read(1)
        f.seek(60)
        f.write(bytes([b[0] ^ 0xFF]))
    c.request_load("r", toks, None, 0)
    (r,) = wait_loads(c)
    assert not r.ok and len(r.payloads) == 2 and r.num_asked == 4
    assert c.counters()[0].failed_blocks == 2 and disk.stats.corrupt == 1
    assert disk.contains_many(keys[2:3]) == (False,)  # dropped


class _Down(Backend):
    medium = "down"

    def read_many(self, names):
        return [FAILED] * len(names)

    def write_many(self, names, values):
        return [PutStatus.ERROR] * len(names)

    def exists_many(self, names):
        return [None] * len(names)

    def discard_many(self, names):
        pass


def test_a_store_that_is_down_holds_nothing_and_counts_errors():
    st = BlockStore(_Down(), FP, PB)
    c = TierConnector([("SHARED", st)], BS)
    try:
        toks = tokens(3)
        c.request_load("r", toks, None, 0)
        (r,) = wait_loads(c)
        assert r.ok and r.payloads == ()  # nothing held: the request computes
        keys = pagedkv.block_hashes(toks, BS)
        assert c.store(keys, [payload(i) for i in range(3)], None, toks[:3 * BS])
        assert c.flush(10)
        (s,) = c.counters()
        assert s.store_errors == 3 and s.stored_blocks == 0 and c.take_events() == []
    finally:
        c.close()


def test_stores_go_to_every_tier_once_with_events_of_their_medium(tiers):
    c, disk, shared = tiers
    toks = tokens(4)
    keys = pagedkv.block_hashes(toks, BS)
    ch = check_digests(toks, BS)
    assert c.store(keys[1:3], [payload(1), payload(2)], None, toks[BS:3 * BS], keys[0], ch[1:3])
    assert c.flush(10)
    ev = c.take_events()
    assert [(e.medium, e.block_hashes, e.parent_block_hash, e.token_ids) for e in ev] == [
        ("DISK", keys[1:3], keys[0], toks[BS:3 * BS]), ("SHARED", keys[1:3], keys[0], toks[BS:3 * BS])]
    assert disk.contains_many(keys) == (False, True, True, False)
    assert shared.contains_many(keys) == (False, True, True, False)
    c.store(keys[1:4], [payload(1), payload(2), payload(3)], None, toks[BS:4 * BS], keys[0], ch[1:4])
    c.flush(10)
    ev = c.take_events()  # the shared tier held 1-2 already (PRESENT): only block 3 is news there
    assert [(e.medium, e.block_hashes) for e in ev if e.medium == "SHARED"] == [("SHARED", keys[3:4])]
    assert c.counters()[1].stored_blocks == 3


def test_a_tier_slower_than_computing_is_skipped_then_probed(tmp_path):
    disk = BlockStore(DiskBackend(tmp_path / "d", 1 << 20), FP, PB)
    c = TierConnector([("DISK", disk)], BS, max_load_ms_per_block=5.0, initial_load_ms=50.0, probe_every=3)
    try:
        toks = tokens(2)
        disk.put_many(pagedkv.block_hashes(toks, BS), [payload(0), payload(1)], checks=check_digests(toks, BS))
        got = []
        for i in range(3):
            c.request_load(i, toks, None, 0)
            got += wait_loads(c)
        # lookups 1 and 2 skipped (50 ms > 5 ms per block), the 3rd probes: a fast read brings the average down
        assert [len(r.payloads) for r in got] == [0, 0, 2]
        d = c.counters()[0]
        assert d.skipped_slow == 2 and d.lookups == 1 and d.load_ms_per_block < 50.0
    finally:
        c.close()


def test_cancel_drops_the_result_and_bad_arguments(tiers):
    c, disk, _ = tiers
    toks = tokens(2)
    c.request_load("r", toks, None, 0)
    c.cancel("r")
    deadline = time.monotonic() + 10
    while c.num_pending_loads:
        assert time.monotonic() < deadline
        c.poll()
        time.sleep(0.01)
    assert c.poll() == []
    with pytest.raises(InvalidArgumentError):
        TierConnector([], BS)
    with pytest.raises(InvalidArgumentError):
        TierConnector([("DISK", disk)], BS + 1)  # another block size than the store's fingerprint
    with pytest.raises(InvalidArgumentError):
        c.store([1, 2], [payload(0)], None)


def test_latency_histogram_buckets():
    h = LoadLatencyHistogram((0.01, 0.1))
    for s in (0.005, 0.01, 0.05, 3.0):
        h.observe(s)
    cum, total, n = h.snapshot()
    assert cum == (2, 3, 4) and n == 4 and abs(total - 3.065) < 1e-9


class _Memory(Backend):
    """A dict store that records the size of every call."""

    medium = "memory"

    def __init__(self):
        self.d, self.calls = {}, []

    def read_many(self, names):
        self.calls.append(("read", len(names)))
        return [self.d.get(n) for n in names]

    def write_many(self, names, values):
        self.calls.append(("write", len(names)))
        out = []
        for n, v in zip(names, values):
            out.append(PutStatus.PRESENT if n in self.d else PutStatus.STORED)
            self.d.setdefault(n, bytes(v))
        return out

    def exists_many(self, names):
        self.calls.append(("exists", len(names)))
        return [n in self.d for n in names]

    def discard_many(self, names):
        for n in names:
            self.d.pop(n, None)


def test_long_runs_are_read_and_written_in_bounded_calls():
    mem = _Memory()
    c = TierConnector([("SHARED", BlockStore(mem, FP, PB))], BS, max_blocks_per_call=2)
    try:
        toks = tokens(5)
        keys = pagedkv.block_hashes(toks, BS)
        c.store(keys, [payload(i) for i in range(5)], None, toks[:5 * BS])  # (check digests from the tokens)
        c.flush(10)
        assert [n for op, n in mem.calls if op == "write"] == [2, 2, 1]
        mem.calls.clear()
        c.request_load("r", toks, None, 0)
        (r,) = wait_loads(c)
        assert r.ok and [int(np.frombuffer(p, np.float32)[0]) for p in r.payloads] == [0, 1, 2, 3, 4]
        assert [n for op, n in mem.calls if op == "read"] == [2, 2, 1]
        with pytest.raises(InvalidArgumentError):
            TierConnector([("SHARED", BlockStore(mem, FP, PB))], BS, max_blocks_per_call=0)
    finally:
        c.close()


# ------------------------------------------------------------------ the engine's two phases, completions, removals
def test_lookup_then_read_in_two_phases(tmp_path):
    """request_lookup answers how many blocks each tier holds past the hit, reading nothing; request_read reads
    the blocks it is given by the runs the lookup found (the engine reserves GPU blocks in between)."""
    disk = BlockStore(DiskBackend(tmp_path / "disk", 1 << 20), FP, PB)
    shared = BlockStore(SharedDirBackend(tmp_path / "shared"), FP, PB)
    c = TierConnector([("DISK", disk), ("SHARED", shared)], BS, chain_names=True)
    try:
        toks = tokens(6)
        keys = pagedkv.block_hashes(toks, BS, "t")
        disk.put_many(keys[:3], [payload(i) for i in range(3)])  # (chain names: no namespace in the name)
        shared.put_many(keys[3:5], [payload(i) for i in range(3, 5)])
        gets0 = disk.stats.gets + shared.stats.gets
        assert c.request_lookup("r", toks, "t", 1)
        (lk,) = wait_loads(c)
        assert (lk.request_id, lk.start_block, lk.num_blocks, lk.runs) == ("r", 1, 4, ((0, 2), (1, 2)))
        assert disk.stats.gets + shared.stats.gets == gets0  # nothing read yet
        c.request_read("r", keys[2:5], ((0, 1), (1, 2)), None, start_block=2)  # the hit grew by one block
        (ld,) = wait_loads(c)
        assert ld.ok and ld.start_block == 2 and [np.frombuffer(v, np.float32)[0] for v in ld.payloads] == [2, 3, 4]
        assert ld.by_tier == (("DISK", 1), ("SHARED", 2))
        with pytest.raises(InvalidArgumentError):
            c.request_read("x", keys[:2], ((0, 3),), None)  # more blocks than keys
        with pytest.raises(InvalidArgumentError):
            c.request_read("x", keys[:2], ((5, 1),), None)  # no such tier
        assert c.request_lookup("none", tokens(1), None, 1) is False  # nothing past the hit to ask for
    finally:
        c.close()


def test_store_completions_say_whether_every_block_is_held(tmp_path):
    disk = BlockStore(DiskBackend(tmp_path / "disk", 3 * (PB + 100)), FP, PB)  # room for 3 values
    c = TierConnector([("DISK", disk)], BS, chain_names=True)
    try:
        keys = pagedkv.block_hashes(tokens(6), BS)
        ck = check_digests(tokens(6), BS)
        assert c.store(keys[:2], [payload(0), payload(1)], None, store_id=7, chained=False, checks=ck[:2])
        assert c.flush(10)
        assert c.poll_stores() == [(7, True)] and c.poll_stores() == []
        c.store(keys[:2], [payload(0), payload(1)], None, store_id=8, chained=False, checks=ck[:2])  # PRESENT
        c.store([keys[2]], [np.zeros(3, np.float32)], None, store_id=9, chained=False, checks=ck[2:3])  # bad
        assert not c.store(keys[3:4], [payload(3)], None, store_id=11, chained=False)  # no check digest: refused
        assert c.flush(10)
        assert sorted(c.poll_stores()) == [(8, True), (9, False)]
        c.write_through = False
        assert not c.store(keys[:1], [payload(0)], None, store_id=10)  # nothing submitted: the caller ends it
    finally:
        c.close()


def test_the_disk_tier_publishes_its_evictions_and_drops_as_block_removed(tmp_path):
    """A DiskBackend evicts inside a put; with events on, the connector publishes BlockRemoved(medium "DISK")
    with the chain keys of the blocks that left (evicted, or dropped as corrupt on a load); the shared tier's
    evictions are not tracked (Redis evicts by itself)."""
    from pagedkv.events import BlockRemoved, BlockStored

    size = len(pagedkv.tiers.codec.encode(FP.digest, "0" * 32, payload(0).tobytes()))
    disk = BlockStore(DiskBackend(tmp_path / "disk", 3 * size), FP, PB, track_removals=True)
    c = TierConnector([("DISK", disk)], BS, chain_names=True)
    try:
        keys = pagedkv.block_hashes(tokens(5), BS)
        ck = check_digests(tokens(5), BS)
        c.store(keys[:3], [payload(i) for i in range(3)], None, store_id=1, chained=False, checks=ck[:3])
        c.flush(10)
        ev = c.take_events()
        assert ev == [BlockStored(block_hashes=keys[:3], parent_block_hash=None, token_ids=[], block_size=BS,
                                  medium="DISK", namespace=None)]
        c.store(keys[3:5], [payload(3), payload(4)], None, store_id=2, chained=False, checks=ck[3:5])  # evicts 2
        c.flush(10)
        ev = c.take_events()
        assert [type(e).__name__ for e in ev] == ["BlockStored", "BlockRemoved"]
        assert ev[1] == BlockRemoved(keys[:2], "DISK")
        # a value damaged on disk: dropped when a load finds it, published as removed
        (name,) = disk.names([keys[2]])
        path = pagedkv.tiers._files.value_path(str(tmp_path / "disk"), name)
        with open(path, "r+b") as f:
            f.seek(60)
            f.write(b"\xff")
        c.request_read("r", [keys[2]], ((0, 1),), None, checks=ck[2:3])
        (ld,) = wait_loads(c)
        assert not ld.ok and c.take_events() == [BlockRemoved([keys[2]], "DISK")]
        assert disk.take_removed() == []
    finally:
        c.close()
def test_a_forced_chain_key_collision_is_never_loaded(tiers, monkeypatch):
    """Two prompts with the same chain keys by construction (the chain hash monkeypatched to ignore the tokens):
    the first one's blocks stored through the connector, the second's load refuses each (another prefix's check
    digest): nothing served, the load failed (the request computes), the refusals counted, the values kept."""
    import pagedkv.blocks.prefix_cache as pc

    c, disk, shared = tiers
    monkeypatch.setattr(pc, "_xxh3", lambda data, seed=0: (seed * 31 + 7) % 2**64)
    a, b = tokens(3, seed=10), tokens(3, seed=500)
    keys = pagedkv.block_hashes(a, BS)
    assert keys == pagedkv.block_hashes(b, BS) and a != b
    assert c.store(keys, [payload(i) for i in range(3)], None, a[:3 * BS])
    assert c.flush(10)
    c.request_load("b", b, None, 0)
    (r,) = wait_loads(c)
    assert not r.ok and r.payloads == () and r.num_asked == 3  # the names are there; none is served
    assert disk.stats.check_refused == 3 and disk.stats.hits == 0 and c.counters()[0].failed_blocks == 3
    assert disk.contains_many(keys) == (True,) * 3  # prefix a's blocks are kept
    c.request_load("a", a, None, 0)
    (r,) = wait_loads(c)
    assert r.ok and [int(np.frombuffer(p, np.float32)[0]) for p in r.payloads] == [0, 1, 2]


def test_a_store_mid_chain_needs_its_check_digests(tiers):
    c, disk, shared = tiers
    toks = tokens(3)
    keys = pagedkv.block_hashes(toks, BS)
    # mid-chain blocks without check digests: not stored (a load would refuse them), counted
    assert not c.store(keys[1:3], [payload(1), payload(2)], None, toks[BS:3 * BS], keys[0])
    assert [t.store_errors for t in c.counters()] == [2, 2] and not any(disk.contains_many(keys))
    assert c.store(keys[1:3], [payload(1), payload(2)], None, toks[BS:3 * BS], keys[0],
                   check_digests(toks, BS)[1:3])
    assert c.flush(10) and disk.contains_many(keys) == (False, True, True)
    c.request_load("r", toks, None, 1)
    (r,) = wait_loads(c)
    assert r.ok and len(r.payloads) == 2


def test_watch_held_reports_the_blocks_a_tier_holds_after_stores_and_reads(tiers, tmp_path):
    """The prefill side of a P/D split waits for its held blocks in the shared tier: the watcher hears, on an
    I/O thread, the keys a store put there (stored now or held already) and the keys a read brought back checked,
    for the watched medium only; never the keys a tier refused."""
    c, disk, shared = tiers
    seen: list = []
    lock = threading.Lock()

    def heard(keys):
        with lock:
            seen.extend(keys)

    c.watch_held("SHARED", heard)
    toks = tokens(4)
    keys = pagedkv.block_hashes(toks, BS, None)
    ch = check_digests(toks, BS, None)
    assert c.store(keys[:2], [payload(0), payload(1)], None, checks=ch[:2])
    assert c.flush(10)
    assert sorted(seen) == sorted(keys[:2])  # (the disk tier stored them too: not the watched medium)
    seen.clear()
    assert c.store(keys[:3], [payload(0), payload(1), payload(2)], None, checks=ch[:3])  # 0-1 held already
    assert c.flush(10) and sorted(seen) == sorted(keys[:3])
    seen.clear()
    for n in disk.names(keys[:3]):  # (only the shared tier holds them now: a load reads them there)
        disk.backend.discard_many([n])
    assert c.request_load("r", toks, None, hit_blocks=0)
    (r,) = wait_loads(c)
    assert r.by_tier[-1] == ("SHARED", 3) and sorted(seen) == sorted(keys[:3])
    with pytest.raises(InvalidArgumentError, match="no tier"):
        c.watch_held("CLOUD", heard)
    c.watch_held("SHARED", None)
    seen.clear()
    assert c.store(keys[3:4], [payload(3)], None, checks=ch[3:4]) and c.flush(10) and seen == []


def test_backends_name_their_location_without_credentials(tmp_path):
    pytest.importorskip("redis")
    from pagedkv.tiers import RedisBackend

    link = tmp_path / "link"
    os.symlink(tmp_path, link)
    assert SharedDirBackend(link / "s").location == SharedDirBackend(tmp_path / "s").location == \
        "file://" + os.path.realpath(tmp_path / "s")
    a = RedisBackend("redis://:secret@Cache.Local:6390/2").location
    assert a == "redis://cache.local:6390/2#pagedkv:kv:" and "secret" not in a
    assert RedisBackend("redis://cache.local:6390/2", prefix="other:").location != a


def test_a_store_plan_is_published_as_chains_with_parents_and_tokens(tiers):
    """A store plan's blocks (of any chains, in any order) with their parent keys and tokens: one BlockStored
    per run of a parent followed by its child, parents first, with the parent key and the run's tokens (vLLM's
    fields); a block stored already is left out of the events and a run restarts after it."""
    c, disk, shared = tiers
    a, b = tokens(4, 0)[:16], tokens(2, 500)[:8]  # two chains: a (4 blocks) and b (2 blocks)
    ka, kb = pagedkv.block_hashes(a, BS), pagedkv.block_hashes(b, BS)
    ca, cb = check_digests(a, BS), check_digests(b, BS)
    disk.put_many([ka[2]], [payload(2)], None, [ca[2]])  # a's third block on disk already
    order = [3, 0, 5, 1, 4, 2]  # a plan's order: block ids, not chain order (4, 5: b's blocks)
    keys, checks, blocks = ka + kb, ca + cb, [a[i * BS:(i + 1) * BS] for i in range(4)] + \
        [b[i * BS:(i + 1) * BS] for i in range(2)]
    parents = [None, ka[0], ka[1], ka[2], None, kb[0]]
    assert c.store([keys[i] for i in order], [payload(i) for i in order], None, store_id=1, chained=False,
                   checks=[checks[i] for i in order], parents=[parents[i] for i in order],
                   token_ids=[t for i in order for t in blocks[i]])
    assert c.flush(10)
    ev = c.take_events()
    disk_ev = [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in ev if e.medium == "DISK"]
    assert disk_ev == [([ka[3]], ka[2], a[12:16]), ([ka[0], ka[1]], None, a[:8]), ([kb[0], kb[1]], None, b)]
    shared_ev = [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in ev if e.medium == "SHARED"]
    assert shared_ev == [([ka[0], ka[1], ka[2], ka[3]], None, a), ([kb[0], kb[1]], None, b)]
    with pytest.raises(InvalidArgumentError):
        c.store(ka[:2], [payload(0), payload(1)], None, chained=False, checks=ca[:2], parents=[None])


def test_a_restarted_disk_tier_publishes_what_it_found_once_in_batches(tmp_path, monkeypatch):
    """At start, with events on, the blocks the disk tier's rebuilt index found are published as BlockStored
    (medium DISK), RESTORED_BATCH keys per event, oldest first, once; the shared tier (no index) publishes none."""
    import pagedkv.tiers.connector as conn

    monkeypatch.setattr(conn, "RESTORED_BATCH", 2)
    toks = tokens(5)
    keys, ck = pagedkv.block_hashes(toks, BS), check_digests(toks, BS)

    def open_tiers():
        return [("DISK", BlockStore(DiskBackend(tmp_path / "disk", 1 << 20), FP, PB)),
                ("SHARED", BlockStore(SharedDirBackend(tmp_path / "shared"), FP, PB))]

    c = TierConnector(open_tiers(), BS)
    assert c.take_events() == []  # nothing found
    for i in range(5):
        c.store([keys[i]], [payload(i)], None, store_id=i, chained=False, checks=ck[i:i + 1])
        assert c.flush(10)
        time.sleep(0.01)  # (distinct modification times: the restart's order)
    c.take_events()
    c.close()
    c = TierConnector(open_tiers(), BS)  # a restart
    ev = c.take_events()
    assert [(e.block_hashes, e.medium, e.parent_block_hash, e.token_ids) for e in ev] == \
        [(keys[0:2], "DISK", None, []), (keys[2:4], "DISK", None, []), (keys[4:5], "DISK", None, [])]
    assert c.take_events() == []  # once
    c.close()
    c = TierConnector(open_tiers(), BS, record_events=False)  # without events nothing is kept
    assert c.take_events() == []
    c.close()


# ------------------------------------------------------------------------------------------ KV cache groups
def test_kv_cache_groups_lookup_read_and_store_per_group(tmp_path):
    """KV cache groups (docs/tiers.md#kv-cache-groups): each tier holds one store per group on one backend (group
    g's fingerprint); a store sends each block to its group's store; the lookup answers the longest load every
    group can serve (the full group's leading run; a sliding group only the blocks its window sees at the load's
    end), naming each block's tier; the grouped read fills each group on its own, and a block that does not come
    back checked ends that group's read."""
    from pagedkv.tiers.connector import group_block_ranges

    win = (None, 2 * BS)  # group 1: a window of 2 blocks: a load ending at block n needs its blocks n-2 and n-1
    dbe, sbe = DiskBackend(tmp_path / "disk", 1 << 20), SharedDirBackend(tmp_path / "shared")
    disk = tuple(BlockStore(dbe, FP.for_group(g), PB) for g in range(2))
    shared = tuple(BlockStore(sbe, FP.for_group(g), PB) for g in range(2))
    c = TierConnector([("DISK", disk), ("SHARED", shared)], BS, chain_names=True)
    try:
        toks = tokens(8)  # 8 loadable blocks
        keys = [pagedkv.block_hashes(toks[:8 * BS], BS, None, g) for g in range(2)]
        ck = [check_digests(toks[:8 * BS], BS, None, group=g) for g in range(2)]
        assert keys[0][0] != keys[1][0]  # each group's chain has a root of its own
        # a store plan naming blocks of both groups: group 0's 0-7 and group 1's 6 go to both tiers
        ks = list(keys[0]) + [keys[1][6]]
        assert c.store(ks, [payload(i) for i in range(8)] + [payload(16)], None, store_id=1, chained=False,
                       checks=list(ck[0]) + [ck[1][6]], groups=[0] * 8 + [1])
        assert c.flush(10) and c.poll_stores() == [(1, True)]
        ev = [(e.medium, e.group_idx, len(e.block_hashes)) for e in c.take_events()]
        assert ev == [("DISK", 0, 8), ("DISK", 1, 1), ("SHARED", 0, 8), ("SHARED", 1, 1)]  # (every tier)
        assert disk[0].prefix_length(keys[0]) == 8 and disk[1].contains_many(keys[1]) == (False,) * 6 + (True, False)
        assert not any(disk[0].contains_many(keys[1]))  # (group 1's blocks are not group 0's)
        shared[1].put_many([keys[1][5]], [payload(15)], None, [ck[1][5]])  # group 1's block 5: the shared tier only
        with pytest.raises(InvalidArgumentError):
            c.request_lookup("r", toks, None, 0)  # a grouped connector needs windows= and keys=
        assert c.request_lookup("r", toks, None, 0, keys=keys, windows=win)
        (lk,) = wait_loads(c)
        # n = 8 needs group 1's block 7 (held nowhere): n = 7 needs its blocks 5 (shared) and 6 (disk)
        assert (lk.start_block, lk.num_blocks, lk.runs) == (0, 7, ())
        assert group_block_ranges(7, BS, win) == [(0, 7), (5, 7)]
        assert lk.group_tiers == ((0, (0,) * 7), (5, (1, 0)))
        items = [[(keys[0][j], ck[0][j], 0) for j in range(7)],
                 [(keys[1][5], ck[1][5], 1), (keys[1][6], ck[1][6], 0)]]
        c.request_read_groups("r", items, 0)
        (ld,) = wait_loads(c)
        assert ld.ok and ld.payloads == () and ld.num_asked == 9
        assert [[int(np.frombuffer(v, np.float32)[0]) for v in p] for p in ld.group_payloads] == \
            [list(range(7)), [15, 16]]
        assert ld.by_tier == (("DISK", 8), ("SHARED", 1))
        bad = [list(items[0]), [(keys[1][5], ck[1][5] ^ 1, 1), items[1][1]]]  # another prefix's check digest
        c.request_read_groups("r2", bad, 0)
        (ld,) = wait_loads(c)
        assert not ld.ok and [len(p) for p in ld.group_payloads] == [7, 0]
        with pytest.raises(InvalidArgumentError):
            c.request_read_groups("x", items[:1], 0)  # one list per group
        with pytest.raises(InvalidArgumentError):
            c.request_read("x", keys[0][:2], ((0, 2),), None)  # the one-table calls are refused
        with pytest.raises(InvalidArgumentError):
            c.request_load("x", toks, None, 0)
        with pytest.raises(InvalidArgumentError):  # a tier's stores must be its groups', on one backend
            TierConnector([("DISK", (disk[1], disk[0]))], BS)
    finally:
        c.close()


@pytest.mark.parametrize("seed", range(4))
def test_kv_cache_groups_lookup_is_the_longest_load_every_group_can_serve(seed):
    """Random holdings of two tiers x three groups (full, windows of 2 and 3 blocks + 1 token), random hits: the
    grouped lookup's n is the largest one (brute force) whose every group holds, in some tier, each block past the
    hit that group_block_ranges says a load of n needs, and each block's tier is the first tier holding it."""
    import random

    from pagedkv.tiers.connector import group_block_ranges

    rng = random.Random(seed)
    win = (None, 2 * BS, 3 * BS + 1)
    mems = [_Memory(), _Memory()]
    stores = [tuple(BlockStore(m, FP.for_group(g), PB) for g in range(3)) for m in mems]
    c = TierConnector([("DISK", stores[0]), ("SHARED", stores[1])], BS, chain_names=True)
    try:
        for trial in range(25):
            nb = rng.randrange(1, 12)
            toks = tokens(nb, seed=1000 * trial)
            keys = [pagedkv.block_hashes(toks[:nb * BS], BS, None, g) for g in range(3)]
            held = {}  # (tier, group, block)
            for t in range(2):
                for g in range(3):
                    for j in range(nb):
                        if rng.random() < 0.75:
                            held[(t, g, j)] = True
                            stores[t][g].put_many([keys[g][j]], [payload(j)], None, [0])
            hit = rng.randrange(nb)
            assert c.request_lookup(("r", trial), toks, None, hit, keys=keys, windows=win)
            (lk,) = wait_loads(c)

            def servable(n):
                return all(any((t, g, j) in held for t in range(2))
                           for g, (a, z) in enumerate(group_block_ranges(n, BS, win)) for j in range(max(a, hit), z))

            want = max(n for n in range(hit, nb + 1) if servable(n))
            assert lk.start_block + lk.num_blocks == want, (trial, hit, nb)
            if want > hit:
                for g, (first, tiers) in enumerate(lk.group_tiers):
                    a, z = group_block_ranges(want, BS, win)[g]
                    assert first == max(a, hit) and len(tiers) == z - first
                    assert list(tiers) == [0 if (0, g, j) in held else 1 for j in range(first, z)]
            for m in mems:
                m.d.clear()
    finally:
        c.close()
