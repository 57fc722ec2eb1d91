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
from pagedkv.tiers import Backend, BlockStore, DiskBackend, ModelFingerprint, PutStatus, SharedDirBackend
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
    disk.put_many(keys[:3], [payload(i) for i in range(3)], "ns")  # blocks 0-2 on disk
    shared.put_many(keys[3:5], [payload(i) for i in range(3, 5)], "ns")  # 3-4 in the shared tier; 5 nowhere
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
    disk.put_many(pagedkv.block_hashes(toks, BS, "a"), [payload(i) for i in range(3)], "a")
    assert c.request_load("r", toks, "b", hit_blocks=0)  # another tenant's blocks are never loaded
    (r,) = wait_loads(c)
    assert r.ok and r.payloads == () and r.num_asked == 0
    with pytest.raises(InvalidArgumentError):
        c.request_load("x", toks, None, 0) and c.request_load("x", toks, None, 0)


def test_a_corrupted_value_fails_the_load_with_the_good_leading_blocks(tiers, tmp_path):
    c, disk, _ = tiers
    toks = tokens(4)
    keys = pagedkv.block_hashes(toks, BS)
    disk.put_many(keys, [payload(i) for i in range(4)])
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
        assert c.store(keys, [payload(i) for i in range(3)], None)
        assert c.flush(10)
        (s,) = c.counters()
        assert s.store_errors == 3 and s.stored_blocks == 0 and c.take_events() == []
    finally:
        c.close()


def test_stores_go_to_every_tier_once_with_events_of_their_medium(tiers):
    c, disk, shared = tiers
    toks = tokens(4)
    keys = pagedkv.block_hashes(toks, BS)
    assert c.store(keys[1:3], [payload(1), payload(2)], None, toks[BS:3 * BS], keys[0])
    assert c.flush(10)
    ev = c.take_events()
    assert [(e.medium, e.block_hashes, e.parent_block_hash, e.token_ids) for e in ev] == [
        ("DISK", keys[1:3], keys[0], toks[BS:3 * BS]), ("SHARED", keys[1:3], keys[0], toks[BS:3 * BS])]
    assert disk.contains_many(keys) == (False, True, True, False)
    assert shared.contains_many(keys) == (False, True, True, False)
    c.store(keys[1:4], [payload(1), payload(2), payload(3)], None, toks[BS:4 * BS], keys[0])
    c.flush(10)
    ev = c.take_events()  # the shared tier held 1-2 already (PRESENT): only block 3 is news there
    assert [(e.medium, e.block_hashes) for e in ev if e.medium == "SHARED"] == [("SHARED", keys[3:4])]
    assert c.counters()[1].stored_blocks == 3


def test_a_tier_slower_than_computing_is_skipped_then_probed(tmp_path):
    disk = BlockStore(DiskBackend(tmp_path / "d", 1 << 20), FP, PB)
    c = TierConnector([("DISK", disk)], BS, max_load_ms_per_block=5.0, initial_load_ms=50.0, probe_every=3)
    try:
        toks = tokens(2)
        disk.put_many(pagedkv.block_hashes(toks, BS), [payload(0), payload(1)])
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
