"""The Redis tier against a throwaway redis-server (tests/redis_server.py): round trip, a value corrupted or cut
short in the store, a value of another fingerprint, the store killed and restarted mid-run (every call answers
at once as failed, counted, and the tier works again once the server is back), two writers of the same block at
once (threads and processes: exactly one stores it), a full server (OOM: FULL, one warning)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv.tiers import BlockStore, GetStatus, ModelFingerprint, PutStatus, RedisBackend, codec

FP = ModelFingerprint("test-model", "float32", 16, "L2,2,B,H1,D8")
PB = 1024
SRC = str(Path(__file__).resolve().parents[1] / "src")


def keys(n: int, seed: int = 0) -> list[int]:
    return pagedkv.block_hashes(list(range(seed, seed + 16 * n)), 16)


def pay(i: int) -> np.ndarray:
    return np.full(PB // 4, i, np.float32)


@pytest.fixture
def server(tmp_path):
    from redis_server import RedisServer

    srv = RedisServer(tmp_path)
    yield srv
    srv.stop()


def test_round_trip(server):
    s = BlockStore(RedisBackend(server.url), FP, payload_bytes=PB)
    ks = keys(4, seed=1)
    assert s.put_many(ks[:3], [pay(i) for i in range(3)]) == (PutStatus.STORED,) * 3
    assert s.put_many(ks[:1], [pay(9)]) == (PutStatus.PRESENT,)
    r = s.get_many(ks)
    assert r.statuses == (GetStatus.HIT,) * 3 + (GetStatus.MISS,)
    assert [np.frombuffer(v, np.float32)[0] for v in r.values[:3]] == [0, 1, 2]
    assert s.prefix_length(ks) == 3 and s.get_many(ks, "other-tenant").hit_prefix == 0
    s.close()


def test_corrupted_cut_and_foreign_values_are_dropped(server):
    import redis

    b = RedisBackend(server.url, prefix="t:")
    s = BlockStore(b, FP)
    ks = keys(3, seed=2)
    s.put_many(ks, [pay(i) for i in range(3)])
    n = s.names(ks)
    raw = redis.Redis.from_url(server.url)
    v = bytearray(raw.get("t:" + n[0]))
    v[codec.HEADER_BYTES + 7] ^= 1
    raw.set("t:" + n[0], bytes(v))  # one bit flipped
    raw.set("t:" + n[1], raw.get("t:" + n[1])[:500])  # cut short
    other = ModelFingerprint("other", "float32", 16, "L2,2,B,H1,D8")
    raw.set("t:" + n[2], codec.encode(other.digest, n[2], pay(2).tobytes()))  # another model's value
    r = s.get_many(ks)
    assert r.statuses == (GetStatus.CORRUPT, GetStatus.CORRUPT, GetStatus.MISMATCH) and r.values == (None,) * 3
    assert raw.exists(*["t:" + x for x in n]) == 0  # all dropped from the store
    st = s.stats
    assert (st.corrupt, st.mismatched, st.hits) == (2, 1, 0)


def test_store_down_then_restarted_mid_run(tmp_path, caplog):
    from redis_server import RedisServer

    srv = RedisServer(tmp_path)
    b = RedisBackend(srv.url, socket_timeout=0.5, retry_s=0.5)
    s = BlockStore(b, FP)
    ks = keys(3, seed=3)
    s.put_many(ks, [pay(i) for i in range(3)])
    assert s.get_many(ks).hit_prefix == 3
    srv.kill()  # a crash: no shutdown
    with caplog.at_level(logging.WARNING, logger="pagedkv.tiers"):
        t0 = time.monotonic()
        assert s.get_many(ks).statuses == (GetStatus.ERROR,) * 3
        assert s.put_many(ks, [pay(0)] * 3) == (PutStatus.ERROR,) * 3
        assert s.contains_many(ks) == (False,) * 3
        first = time.monotonic() - t0
        t1 = time.monotonic()
        for _ in range(20):  # while deemed down, calls answer at once without trying
            assert s.get_many(ks).statuses == (GetStatus.ERROR,) * 3
        quick = time.monotonic() - t1
    assert first < 3.0 and quick < 0.2
    assert b.outages == 1 and b.failures >= 23
    assert len([r for r in caplog.records if "the store failed" in r.getMessage()]) == 1
    st = s.stats
    assert st.read_errors == 3 * 21 + 3 and st.write_errors == 3 and st.hits == 3
    srv2 = RedisServer(tmp_path, port=srv.port)  # back, empty (no persistence)
    try:
        time.sleep(0.55)
        assert s.get_many(ks).statuses == (GetStatus.MISS,) * 3  # reconnected by itself
        assert s.put_many(ks, [pay(i) for i in range(3)]) == (PutStatus.STORED,) * 3
        assert s.get_many(ks).hit_prefix == 3
        assert b.outages == 1
    finally:
        srv2.stop()


def test_two_writers_of_the_same_block_at_once_threads(server):
    ks = keys(20, seed=4)
    stores = [BlockStore(RedisBackend(server.url), FP) for _ in range(4)]
    go = threading.Barrier(4)
    out = [None] * 4

    def write(i):
        go.wait(10)
        out[i] = stores[i].put_many(ks, [pay(i)] * len(ks))

    ts = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    for j in range(len(ks)):  # each block stored by exactly one writer, the others told PRESENT
        col = [out[i][j] for i in range(4)]
        assert col.count(PutStatus.STORED) == 1 and col.count(PutStatus.PRESENT) == 3
    r = stores[0].get_many(ks)
    assert r.hit_prefix == 20


_WRITER = """
import sys
sys.path.insert(0, {src!r})
import numpy as np, pagedkv
from pagedkv.tiers import BlockStore, ModelFingerprint, RedisBackend
fp = ModelFingerprint("test-model", "float32", 16, "L2,2,B,H1,D8")
s = BlockStore(RedisBackend({url!r}), fp)
ks = pagedkv.block_hashes(list(range(5, 5 + 16 * 200)), 16)
got = s.put_many(ks, [np.full(256, {me}, np.float32)] * len(ks))
print("".join(str(int(g)) for g in got))
"""


def test_two_writers_of_the_same_block_at_once_processes(server):
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER.format(src=SRC, url=server.url, me=i)],
                              stdout=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(len(o) == 200 for o in outs), outs
    for j in range(200):
        col = [o[j] for o in outs]
        assert col.count(str(int(PutStatus.STORED))) == 1 and col.count(str(int(PutStatus.PRESENT))) == 2
    s = BlockStore(RedisBackend(server.url), FP)
    assert s.get_many(pagedkv.block_hashes(list(range(5, 5 + 16 * 200)), 16)).hit_prefix == 200


def test_full_server_refuses_writes_as_full(server, caplog):
    import redis

    raw = redis.Redis.from_url(server.url)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", 4 * 2**20)
    b = RedisBackend(server.url)
    s = BlockStore(b, FP)
    ks = keys(200, seed=6)
    big = np.zeros(64 * 1024 // 4, np.float32)  # 64 KiB a block: 200 blocks do not fit in 4 MiB
    with caplog.at_level(logging.WARNING, logger="pagedkv.tiers"):
        got = []
        for i in range(0, 200, 10):
            got += s.put_many(ks[i:i + 10], [big] * 10)
    assert PutStatus.STORED in got and PutStatus.FULL in got and PutStatus.ERROR not in got
    assert b.full_events == got.count(PutStatus.FULL) == s.stats.full
    assert len([r for r in caplog.records if "server is full" in r.getMessage()]) == 1
    assert s.get_many(ks[:1]).statuses == (GetStatus.HIT,)  # reads go on
    raw.config_set("maxmemory", 0)


def test_hung_store_is_bounded_by_the_socket_timeout(tmp_path):
    import os
    import signal

    from redis_server import RedisServer

    srv = RedisServer(tmp_path)
    try:
        b = RedisBackend(srv.url, socket_timeout=0.3, retry_s=5.0)
        s = BlockStore(b, FP)
        ks = keys(2, seed=7)
        s.put_many(ks, [pay(0), pay(1)])
        os.kill(srv.proc.pid, signal.SIGSTOP)  # alive but answering nothing
        try:
            t0 = time.monotonic()
            assert s.get_many(ks).statuses == (GetStatus.ERROR,) * 2
            assert time.monotonic() - t0 < 2.0
            t1 = time.monotonic()
            assert s.put_many(ks, [pay(0), pay(1)]) == (PutStatus.ERROR,) * 2  # deemed down: no new wait
            assert time.monotonic() - t1 < 0.1
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert b.outages == 1 and s.stats.read_errors == 2 and s.stats.write_errors == 2
    finally:
        srv.stop()
