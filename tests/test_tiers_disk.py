"""The disk tier: bounded LRU with its invariants after each step, restarts (index rebuilt, temporary files of a
crashed write cleaned), and its faults: a crash mid-store (a real process killed between write and rename),
disk full (an injected ENOSPC, and a byte budget too small), a value corrupted or cut short on disk, a value of
another fingerprint or namespace, a file deleted behind its back, a second opener, threads at once."""

from __future__ import annotations

import collections
import errno
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import pagedkv
from pagedkv.tiers import (BlockStore, DiskBackend, GetStatus, ModelFingerprint, PutStatus, TierInUseError,
                           codec, store_names)
from pagedkv.tiers import _files

FP = ModelFingerprint("test-model", "float32", 16, "L2,2,B,H1,D8")
PB = 2 * 2 * 16 * 1 * 8 * 4  # payload bytes of one block: 1024
VB = PB + codec.OVERHEAD_BYTES  # bytes of one stored value
SRC = str(Path(__file__).resolve().parents[1] / "src")


def keys(n: int, seed: int = 0) -> list[int]:
    return pagedkv.block_hashes(list(range(seed, seed + 16 * n)), 16)


def payload(k: int) -> np.ndarray:
    return np.full(PB // 4, k % 1000, dtype=np.float32)


def check_hits(store: BlockStore, ks, ns=None) -> None:
    r = store.get_many(ks, ns)
    assert r.statuses == (GetStatus.HIT,) * len(ks)
    for k, v in zip(ks, r.values):
        assert np.array_equal(np.frombuffer(v, np.float32), payload(k))


def tmp_files(root) -> list[str]:
    return [p.name for p in Path(root).rglob("*.tmp")]


def test_round_trip_and_restart(tmp_path):
    b = DiskBackend(tmp_path, 100 * VB)
    s = BlockStore(b, FP, payload_bytes=PB)
    ks = keys(5)
    assert s.put_many(ks, [payload(k) for k in ks]) == (PutStatus.STORED,) * 5
    b.check_invariants()
    check_hits(s, ks)
    assert b.used_bytes == 5 * VB and b.num_values == 5
    b.close()
    b2 = DiskBackend(tmp_path, 100 * VB)  # a restart: the index comes from the files
    assert b2.num_values == 5 and b2.used_bytes == 5 * VB and b2.cleaned_tmp == 0
    b2.check_invariants()
    check_hits(BlockStore(b2, FP, payload_bytes=PB), ks)
    b2.close()


def test_lru_bound_golden(tmp_path):
    b = DiskBackend(tmp_path, 3 * VB)
    s = BlockStore(b, FP)
    a, bb, c, d, e = keys(5)
    for k in (a, bb, c):
        s.put_many([k], [payload(k)])
        b.check_invariants()
    s.get_many([a])  # a becomes the most recent: b is the least
    assert s.put_many([d], [payload(d)]) == (PutStatus.STORED,)
    b.check_invariants()
    assert s.contains_many([a, bb, c, d]) == (True, False, True, True)
    assert not os.path.exists(_files.value_path(b.path, s.names([bb])[0]))  # its file is gone
    s.put_many([c], [payload(c)])  # a re-put refreshes too (PRESENT)
    s.put_many([e], [payload(e)])  # evicts a
    assert s.contains_many([a, c, d, e]) == (False, True, True, True)
    assert b.evictions == 2 and b.used_bytes == 3 * VB
    b.check_invariants()
    b.close()
    # a restart with a smaller bound keeps the most recently stored values
    b2 = DiskBackend(tmp_path, 2 * VB)
    assert BlockStore(b2, FP).contains_many([c, d, e]) == (False, True, True)
    b2.check_invariants()
    b2.close()


def test_value_larger_than_the_bound_is_refused(tmp_path):
    b = DiskBackend(tmp_path, VB - 1)
    s = BlockStore(b, FP)
    k = keys(1)
    assert s.put_many(k, [payload(k[0])]) == (PutStatus.TOO_LARGE,)
    assert b.used_bytes == 0 and not list(Path(tmp_path).rglob("*.kv")) and s.stats.too_large == 1
    b.check_invariants()
    b.close()


def test_second_opener_is_refused(tmp_path):
    b = DiskBackend(tmp_path, VB)
    with pytest.raises(TierInUseError):
        DiskBackend(tmp_path, VB)
    b.close()
    DiskBackend(tmp_path, VB).close()


_CRASH = """
import os, sys
sys.path.insert(0, {src!r})
import numpy as np
import pagedkv
from pagedkv.tiers import BlockStore, DiskBackend, ModelFingerprint
from pagedkv.tiers import _files
fp = ModelFingerprint("test-model", "float32", 16, "L2,2,B,H1,D8")
s = BlockStore(DiskBackend({root!r}, 1 << 20), fp)
ks = pagedkv.block_hashes(list(range(32)), 16)
s.put_many(ks[:1], [np.zeros(256, np.float32)])          # a complete value
real_write = _files._write_all
def half_then_die(fd, data):                             # the process dies mid-write of the second value
    real_write(fd, bytes(data)[: len(data) // 2])
    os._exit(17)
_files._write_all = half_then_die
s.put_many(ks[1:], [np.ones(256, np.float32)])
"""


def test_crash_mid_store_is_never_read_back(tmp_path):
    root = tmp_path / "tier"
    r = subprocess.run([sys.executable, "-c", _CRASH.format(src=SRC, root=str(root))], timeout=60)
    assert r.returncode == 17
    assert len(tmp_files(root)) == 1  # the cut write's temporary file is there
    b = DiskBackend(root, 1 << 20)
    assert b.cleaned_tmp == 1 and tmp_files(root) == [] and b.num_values == 1
    s = BlockStore(b, FP)
    ks = keys(2)
    r = s.get_many(ks)
    assert r.statuses == (GetStatus.HIT, GetStatus.MISS)
    assert np.array_equal(np.frombuffer(r.values[0], np.float32), np.zeros(256, np.float32))
    b.check_invariants()
    b.close()


def test_disk_full_stops_storing_warns_once_and_counts(tmp_path, monkeypatch, caplog):
    b = DiskBackend(tmp_path, 100 * VB, full_retry_s=0.3)
    s = BlockStore(b, FP)
    ks = keys(6)
    s.put_many(ks[:1], [payload(ks[0])])
    tries = []

    def enospc(fd, data):
        tries.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_files, "_write_all", enospc)
    with caplog.at_level(logging.WARNING, logger="pagedkv.tiers"):
        assert s.put_many(ks[1:3], [payload(k) for k in ks[1:3]]) == (PutStatus.FULL, PutStatus.FULL)
        assert len(tries) == 1  # the first failure stops storing: the second value was not tried
        assert b.disk_full and b.disk_full_events == 2
        assert s.put_many(ks[3:4], [payload(ks[3])]) == (PutStatus.FULL,) and len(tries) == 1
    warnings = [r for r in caplog.records if "disk is full" in r.getMessage()]
    assert len(warnings) == 1
    assert tmp_files(tmp_path) == [] and b.used_bytes == VB  # nothing left behind, nothing reserved
    b.check_invariants()
    check_hits(s, ks[:1])  # reads go on
    assert s.stats.full == 3
    time.sleep(0.35)  # after the retry period storing resumes (here the disk has room again)
    monkeypatch.undo()
    assert not b.disk_full
    with caplog.at_level(logging.WARNING, logger="pagedkv.tiers"):
        assert s.put_many(ks[4:5], [payload(ks[4])]) == (PutStatus.STORED,)
    check_hits(s, [ks[0], ks[4]])
    b.check_invariants()
    b.close()


def test_other_io_errors_are_errors_not_full(tmp_path, monkeypatch):
    b = DiskBackend(tmp_path, 100 * VB)
    s = BlockStore(b, FP)
    k = keys(2)
    monkeypatch.setattr(_files, "_write_all", lambda fd, d: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    assert s.put_many(k[:1], [payload(k[0])]) == (PutStatus.ERROR,)
    monkeypatch.undo()
    assert not b.disk_full and s.put_many(k[1:], [payload(k[1])]) == (PutStatus.STORED,)
    b.check_invariants()
    b.close()


@pytest.mark.parametrize("damage", ["flip", "cut", "empty"])
def test_corrupted_or_cut_value_is_dropped_counted_and_recomputed(tmp_path, damage):
    b = DiskBackend(tmp_path, 100 * VB)
    s = BlockStore(b, FP)
    ks = keys(3)
    s.put_many(ks, [payload(k) for k in ks])
    path = _files.value_path(b.path, s.names(ks[1:2])[0])
    data = bytearray(Path(path).read_bytes())
    if damage == "flip":
        data[codec.HEADER_BYTES + 100] ^= 0x10  # one bit of the KV payload
    elif damage == "cut":
        data = data[: len(data) // 2]
    else:
        data = b""
    Path(path).write_bytes(bytes(data))
    r = s.get_many(ks)
    assert r.statuses == (GetStatus.HIT, GetStatus.CORRUPT, GetStatus.HIT) and r.values[1] is None
    assert r.hit_prefix == 1
    assert s.stats.corrupt == 1 and not os.path.exists(path)  # dropped from the disk and the index
    assert s.contains_many(ks[1:2]) == (False,)
    b.check_invariants()
    assert s.put_many(ks[1:2], [payload(ks[1])]) == (PutStatus.STORED,)  # computed again, stored again
    check_hits(s, ks)
    b.check_invariants()
    b.close()


def test_other_fingerprint_or_namespace_never_loads(tmp_path):
    b = DiskBackend(tmp_path, 100 * VB)
    mine, gemma = BlockStore(b, FP), BlockStore(b, ModelFingerprint("gemma", "float32", 16, "L2,2,B,H1,D8"))
    ks = keys(2)
    mine.put_many(ks, [payload(k) for k in ks], namespace="tenant-a")
    assert gemma.get_many(ks, "tenant-a").statuses == (GetStatus.MISS,) * 2  # other model: other names
    assert mine.get_many(ks, "tenant-b").statuses == (GetStatus.MISS,) * 2  # other tenant: other names
    assert mine.get_many(ks).statuses == (GetStatus.MISS,) * 2
    # a value of another model or tenant planted under this block's name (a collision, a copied file)
    for other_fp, other_ns in ((gemma, "tenant-a"), (mine, "tenant-b")):
        target = _files.value_path(b.path, mine.names(ks[:1], "tenant-a")[0])
        forged = codec.encode(other_fp.fingerprint.digest, other_fp.names(ks[:1], other_ns)[0], payload(ks[0]))
        Path(target).write_bytes(forged)
        r = mine.get_many(ks, "tenant-a")
        assert r.statuses[0] is GetStatus.MISMATCH and r.values[0] is None
        assert not os.path.exists(target)
        mine.put_many(ks[:1], [payload(ks[0])], namespace="tenant-a")
    assert mine.stats.mismatched == 2
    b.check_invariants()
    b.close()


def test_file_deleted_behind_its_back_is_a_miss(tmp_path):
    b = DiskBackend(tmp_path, 100 * VB)
    s = BlockStore(b, FP)
    ks = keys(2)
    s.put_many(ks, [payload(k) for k in ks])
    os.unlink(_files.value_path(b.path, s.names(ks[:1])[0]))
    assert s.get_many(ks).statuses == (GetStatus.MISS, GetStatus.HIT)
    assert b.num_values == 1 and b.used_bytes == VB
    b.check_invariants()
    b.close()


def test_threads_at_once(tmp_path):
    b = DiskBackend(tmp_path, 40 * VB, fsync=False)
    s = BlockStore(b, FP, payload_bytes=PB)
    ks = keys(120)
    bad, errors = [], []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                pick = [ks[i] for i in rng.choice(len(ks), size=4, replace=False)]
                if rng.random() < 0.5:
                    s.put_many(pick, [payload(k) for k in pick])
                else:
                    r = s.get_many(pick)
                    for k, st_, v in zip(pick, r.statuses, r.values):
                        if st_ is GetStatus.HIT and not np.array_equal(np.frombuffer(v, np.float32), payload(k)):
                            bad.append(k)
                        elif st_ not in (GetStatus.HIT, GetStatus.MISS):
                            bad.append((k, st_))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not bad
    b.check_invariants()
    st_ = s.stats
    assert st_.hits > 0 and st_.stored > 40 and b.evictions > 0 and st_.corrupt == st_.read_errors == 0
    assert tmp_files(tmp_path) == []
    b.close()


class DiskMachine(RuleBasedStateMachine):
    """The disk tier against a model LRU of capacity 4 values, across puts, gets, discards and restarts."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        self.b = DiskBackend(self.dir.name, 4 * VB, fsync=False)
        self.s = BlockStore(self.b, FP)
        self.model: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.ks = keys(8)

    def teardown(self):
        self.b.close()
        self.dir.cleanup()

    @rule(i=st.integers(0, 7))
    def put(self, i):
        k = self.ks[i]
        got = self.s.put_many([k], [payload(k)])[0]
        if k in self.model:
            assert got is PutStatus.PRESENT
            self.model.move_to_end(k)
        else:
            assert got is PutStatus.STORED
            self.model[k] = None
            while len(self.model) > 4:
                self.model.popitem(last=False)

    @rule(i=st.integers(0, 7))
    def get(self, i):
        k = self.ks[i]
        r = self.s.get_many([k])
        if k in self.model:
            assert r.statuses == (GetStatus.HIT,)
            assert np.array_equal(np.frombuffer(r.values[0], np.float32), payload(k))
            self.model.move_to_end(k)
        else:
            assert r.statuses == (GetStatus.MISS,)

    @rule(i=st.integers(0, 7))
    def discard(self, i):
        k = self.ks[i]
        self.b.discard_many(self.s.names([k]))
        self.model.pop(k, None)

    @rule()
    def restart(self):
        # after a restart the order is the store order (modification times), which gets do not change: only
        # the set of values is compared, and the model takes the disk's order
        self.b.close()
        self.b = DiskBackend(self.dir.name, 4 * VB, fsync=False)
        self.s = BlockStore(self.b, FP)
        held = [k for k in self.ks if self.s.contains_many([k])[0]]
        assert set(held) == set(self.model)
        names = {n: k for k, n in zip(self.ks, self.s.names(self.ks))}
        self.model = collections.OrderedDict((names[n], None) for n in self.b._index)  # noqa: SLF001

    @invariant()
    def consistent(self):
        self.b.check_invariants()
        assert self.b.num_values == len(self.model)


TestDiskMachine = DiskMachine.TestCase
TestDiskMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_another_process_cannot_open_a_held_directory(tmp_path):
    b = DiskBackend(tmp_path, VB)
    code = (f"import sys; sys.path.insert(0, {SRC!r})\n"
            "from pagedkv.tiers import DiskBackend, TierInUseError\n"
            f"try:\n    DiskBackend({str(tmp_path)!r}, 1024)\nexcept TierInUseError:\n    sys.exit(5)\n")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 5
    b.close()
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_a_closed_backend_answers_failed(tmp_path):
    b = DiskBackend(tmp_path, 10 * VB)
    s = BlockStore(b, FP)
    k = keys(1)
    s.put_many(k, [payload(k[0])])
    b.close()
    b.close()  # idempotent
    assert s.get_many(k).statuses == (GetStatus.ERROR,)
    assert s.put_many(k, [payload(k[0])]) == (PutStatus.ERROR,)
    assert s.contains_many(k) == (False,)
    b2 = DiskBackend(tmp_path, 10 * VB)  # the next owner finds the value
    check_hits(BlockStore(b2, FP), k)
    b2.close()


def test_chain_keys_of_the_values_found_at_a_restart(tmp_path):
    """A BlockStore tags each value it stores with its chain key (the tag log); a restart gives back the chain
    keys of the values found (what the engine publishes as stored, medium DISK), not those evicted meanwhile; the
    log is compacted to the values found; a record cut by a crash is ignored; and with track_removals a value
    found at start and evicted after it is published as removed by chain key."""
    b = DiskBackend(tmp_path, 4 * VB)
    s = BlockStore(b, FP, payload_bytes=PB)
    ks = keys(6)
    assert s.restored_keys() == []
    for k in ks[:5]:  # one at a time: distinct modification times, the restart's order
        s.put_many([k], [payload(k)])
        time.sleep(0.01)
    assert b.num_values == 4  # ks[0] evicted
    b.close()
    log = tmp_path / "tags.log"
    with open(log, "ab") as f:
        f.write(b"\x01" * 10)  # a record cut short by a crash
    b2 = DiskBackend(tmp_path, 4 * VB)
    s2 = BlockStore(b2, FP, payload_bytes=PB, track_removals=True)
    assert s2.restored_keys() == ks[1:5]
    assert log.stat().st_size == 4 * 24  # compacted: the values found, nothing else
    s2.put_many([ks[5]], [payload(ks[5])])  # evicts the oldest value found at start
    assert s2.take_removed() == [ks[1]]
    b2.close()
    b3 = DiskBackend(tmp_path, 4 * VB)
    assert BlockStore(b3, FP).restored_keys() == ks[2:6]
    b3.check_invariants()
    b3.close()


def test_each_refused_value_is_logged(tmp_path, caplog):
    # issue 34: corrupt values were counted but never logged; now one warning line per refused value, naming it
    caplog.set_level(logging.WARNING, logger="pagedkv.tiers")
    b = DiskBackend(tmp_path, 100 * VB)
    s = BlockStore(b, FP)
    ks = keys(3)
    s.put_many(ks, [payload(k) for k in ks])
    names = s.names(ks)
    for n in names[1:]:
        Path(_files.value_path(b.path, n)).write_bytes(b"garbage")
    assert s.get_many(ks).statuses == (GetStatus.HIT, GetStatus.CORRUPT, GetStatus.CORRUPT)
    lines = [r.getMessage() for r in caplog.records if "refused the stored KV block" in r.getMessage()]
    assert len(lines) == 2 and all(n in ln and "corrupt" in ln for n, ln in zip(names[1:], lines))
    b.close()
