"""The disk and shared KV tiers through the engine (issue 24 items 3-5, SmolLM2): greedy output equal to the
contiguous reference when the prompt's KV comes from the disk tier after an LLM restart (a new LLM over the same
``kv_disk_dir``), and from the shared store (two LLMs at once, one writes, the other reads: a shared directory
and Redis); faults: the store down (requests go on, computing), a value corrupted on disk (dropped, counted,
computed), the disk full (one warning, a metric); the KV events of what the tiers stored carry their medium."""

from __future__ import annotations

import errno
import logging
import re
import time

import pytest

import pagedkv

pytestmark = pytest.mark.engine

BS = 4
N_NEW = 5
# prompts of 9..41 tokens: 2..10 full blocks of 4; the last one twice (the second finds the first's loaded blocks)
PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173],
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198, 504, 3575, 282, 4649, 314, 30],
    list(range(200, 241)),
    list(range(200, 241)),
]


def greedy():
    from pagedkv.engine.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)


def make(engine, **kw):
    from pagedkv.engine.config import engine_configs
    from pagedkv.engine.llm import LLM

    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("num_gpu_blocks", 96)
    return LLM(engine.paged, block_size=BS, **engine_configs(**kw))


def run(llm, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    llm.block_manager.check_invariants()
    return outs


def expected(engine, prompts=PROMPTS):
    return [list(engine.reference_greedy(tuple(p), N_NEW).token_ids) for p in prompts]


def full_blocks(p):
    return (len(p) - 1) // BS  # what a tier can serve: the last token is always computed


def test_disk_tier_after_an_llm_restart_gives_the_reference(engine, tmp_path):
    want = expected(engine)
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05, enable_kv_events=True) as a:
        outs = run(a)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert a.scheduler.stats.external_tokens == 0
        a.kv_tiers.connector.flush(30)
        ev = a.kv_tiers.take_events()
        assert ev and {e.medium for e in ev} == {"DISK"}
        stored = [k for e in ev for k in e.block_hashes]
        for p in PROMPTS[:3]:  # every full prompt block, under the prefix cache's own keys
            assert set(pagedkv.block_hashes(p, BS)[: full_blocks(p)]) <= set(stored)
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05) as b:  # a restart: a fresh GPU pool
        outs = run(b)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        st = b.scheduler.stats
        # the three distinct prompts come from disk; the duplicate too (its own reserved blocks, when it is
        # admitted while the first one's are still loading) or from the blocks the first one loaded
        distinct = sum(full_blocks(p) for p in PROMPTS[:3])
        assert BS * distinct <= st.external_tokens <= BS * (distinct + full_blocks(PROMPTS[3]))
        assert [o.num_cached_tokens for o in outs] == [BS * full_blocks(p) for p in PROMPTS]
        (d,) = b.kv_tiers.connector.counters()
        assert d.hit_blocks >= distinct and d.failed_blocks == 0
        assert b.kv_tiers.stats["written_blocks"] == st.external_tokens // BS


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_shared_store_between_two_llms_gives_the_reference(engine, tmp_path, kind):
    if kind == "redis":
        from redis_server import RedisServer

        srv = RedisServer(tmp_path)
        url = srv.url
    else:
        srv = None
        url = (tmp_path / "shared").as_uri()
    try:
        want = expected(engine)
        with make(engine, kv_shared=url, enable_kv_events=True) as a, make(engine, kv_shared=url) as b:
            assert [list(o.outputs[0].token_ids) for o in run(a, PROMPTS[:3])] == want[:3]
            a.kv_tiers.connector.flush(30)
            assert {e.medium for e in a.kv_tiers.take_events()} == {"SHARED"}
            outs = run(b)  # (a second replica at the same time)
            assert [list(o.outputs[0].token_ids) for o in outs] == want
            b.kv_tiers.connector.flush(30)
            assert b.kv_tiers.take_events() == []  # without enable_kv_events none are kept
            distinct = sum(full_blocks(p) for p in PROMPTS[:3])  # (the duplicate may load its own copy)
            assert BS * distinct <= b.scheduler.stats.external_tokens <= BS * (distinct + full_blocks(PROMPTS[3]))
            assert b.kv_tiers.connector.counters()[0].hit_blocks >= sum(full_blocks(p) for p in PROMPTS[:3])
    finally:
        if srv is not None:
            srv.stop()


def test_store_down_requests_go_on_computing(engine, tmp_path):
    from redis_server import free_port

    want = expected(engine)
    with make(engine, kv_shared=f"redis://127.0.0.1:{free_port()}") as llm:  # nothing listens there
        outs = run(llm)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        llm.kv_tiers.connector.flush(30)
        (s,) = llm.kv_tiers.connector.counters()
        assert s.hit_blocks == 0 and s.stored_blocks == 0 and s.store_errors > 0
        assert llm.scheduler.stats.external_tokens == 0


def test_corrupted_value_on_disk_is_dropped_counted_and_computed(engine, tmp_path):
    from pagedkv.tiers import _files

    p = PROMPTS[2]
    want = expected(engine, [p])
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05) as a:
        run(a, [p])
        a.kv_tiers.connector.flush(30)
        names = a.kv_tiers.connector.stores()[0].names(pagedkv.block_hashes(p, BS))
    path = _files.value_path(str(tmp_path), names[3])  # block 3's value: one byte of its payload flipped
    with open(path, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0x40]))
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05) as b:
        outs = run(b, [p])
        assert [list(o.outputs[0].token_ids) for o in outs] == want  # never served: computed from block 3 on
        assert b.scheduler.stats.external_tokens == 3 * BS  # the good leading blocks 0-2 were used
        disk = b.kv_tiers.connector.stores()[0]
        assert disk.stats.corrupt == 1 and b.kv_tiers.stats["loads_failed"] == 1
        assert b.kv_tiers.connector.counters()[0].failed_blocks >= 1


def test_disk_full_warns_once_and_counts(engine, tmp_path, monkeypatch, caplog):
    from pagedkv.tiers import _files

    def enospc(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_files, "_write_all", enospc)
    want = expected(engine)
    with caplog.at_level(logging.WARNING, logger="pagedkv.tiers"):
        with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05) as llm:
            outs = run(llm)
            assert [list(o.outputs[0].token_ids) for o in outs] == want
            llm.kv_tiers.connector.flush(30)
            (d,) = llm.kv_tiers.connector.counters()
            assert d.store_full > 0 and d.stored_blocks == 0
            assert llm.kv_tiers.connector.stores()[0].backend.disk_full_events > 0
    assert len([r for r in caplog.records if "full" in r.getMessage()]) == 1


def test_tier_options_are_checked(engine, tmp_path):
    from pagedkv.errors import InvalidArgumentError

    for kw in [dict(kv_disk_dir=tmp_path), dict(kv_disk_dir=tmp_path, kv_disk_gib=0),
               dict(kv_disk_gib=1.0), dict(kv_shared="http://x"), dict(kv_shared="file://host/dir"),
               dict(kv_disk_dir=tmp_path, kv_disk_gib=1.0, enable_prefix_caching=False),
               dict(kv_disk_dir=tmp_path, kv_disk_gib=1.0, sliding_window=8),
               dict(kv_disk_dir=tmp_path, kv_disk_gib=1.0, kv_store="sideways"),
               dict(kv_disk_dir=tmp_path, kv_disk_gib=1.0, kv_store="selective:0")]:
        with pytest.raises(InvalidArgumentError):
            make(engine, **kw)
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05):
        with pytest.raises(pagedkv.tiers.TierInUseError):  # one engine per disk directory
            make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05)


def test_server_restarted_over_its_disk_tier_loads_and_counts(engine, tmp_path):
    """A server answers a prompt, stops; a new server over the same disk directory answers it with the same text
    from the loaded blocks, and /metrics counts the tier's hits, its load latency histogram and no failures."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    from pagedkv.server.launch import make_server

    prompt = "Disk tiers keep the prefix cache across restarts, so that a long system prompt is computed once."
    texts = []
    for i in range(2):
        llm = make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05)
        srv = make_server(llm, model_name="m", max_waiting=8).start_in_thread()
        try:
            r = httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 5,
                                                              "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            deadline = time.monotonic() + 30
            while srv.engine.llm.scheduler.has_unfinished():
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.1)
            m = httpx.get(srv.url + "/metrics", timeout=10).text
        finally:
            srv.close()
            llm.close()
        hits = float(re.search(r'^pagedkv:kv_tier_hit_blocks_total\{[^}]*medium="DISK"[^}]*\} (\S+)$', m, re.M)
                     .group(1))
        failed = float(re.search(r'^pagedkv:kv_tier_failed_blocks_total\{[^}]*\} (\S+)$', m, re.M).group(1))
        assert failed == 0
        if i == 0:
            tiers = getattr(llm.kv_tiers, "inner", None) or llm.kv_tiers  # (the server wraps them in its KV port)
            assert hits == 0 and tiers.stats["stored_blocks"] > 0
        else:
            assert hits > 0 and llm.scheduler.stats.external_tokens > 0
            assert re.search(r'^pagedkv:kv_tier_load_seconds_count\{[^}]*\} 1\.0$', m, re.M)
    assert texts[0] == texts[1]


def test_decode_filled_blocks_are_stored_and_a_next_turn_loads_them_after_a_restart(engine, tmp_path):
    """Issue 24 (tiers' gaps, items 1 and 3): the blocks a decode fills are stored with their check digests
    (chained from the prompt's), so a conversation's next turn, whose prompt continues the first answer, loads the
    answer's blocks from the disk tier after a restart; greedy output equal to the reference; nothing skipped
    unchecked. The store plans' events carry parents and tokens; the restarted engine publishes what its disk
    index found, and a router's index learns it."""
    from pagedkv.engine.sampling import SamplingParams

    p1, n1 = PROMPTS[1], 12  # 22 prompt tokens (5 full blocks) + 11 generated tokens fed back: 8 full blocks
    sp = SamplingParams(temperature=0, max_tokens=n1, ignore_eos=True)
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05, enable_kv_events=True) as a:
        (o1,) = a.generate([{"prompt_token_ids": p1}], sp, use_tqdm=False)
        answer = list(o1.outputs[0].token_ids)
        assert answer == list(engine.reference_greedy(tuple(p1), n1).token_ids)
        a.kv_tiers.connector.flush(30)
        fed = len(p1) + n1 - 1  # (the last sampled token is never fed: its block is not full in the cache)
        assert a.kv_tiers.stats["store_skipped_unchecked"] == 0
        assert a.kv_tiers.stats["stored_blocks"] == fed // BS
        # the store plans' BlockStored events (medium DISK) carry each run's parent key and tokens (vLLM's fields)
        seq = p1 + answer
        keys = pagedkv.block_hashes(seq[:fed], BS)
        got = []
        for e in a.kv_tiers.take_events():
            assert e.medium == "DISK"
            i0 = keys.index(e.block_hashes[0])
            n = len(e.block_hashes)
            assert e.block_hashes == keys[i0:i0 + n] and e.parent_block_hash == (keys[i0 - 1] if i0 else None)
            assert e.token_ids == seq[i0 * BS:(i0 + n) * BS]
            got += e.block_hashes
        assert sorted(got) == sorted(keys)
    turn2 = p1 + answer + [198, 1, 520]
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05, enable_kv_events=True) as b:  # a restart
        # the blocks the disk index found are published once as stored (medium DISK): a router learns them
        from pagedkv.cluster import MemoryIndex

        found = b.kv_tiers.take_events()
        assert {(e.medium, type(e).__name__) for e in found} == {("DISK", "BlockStored")}
        assert sorted(k for e in found for k in e.block_hashes) == sorted(keys)
        ix = MemoryIndex()
        ix.apply_all("b", found)
        assert ix.longest_prefix(pagedkv.block_hashes(turn2, BS), "DISK") == {"b": fed // BS}
        assert ix.longest_prefix(pagedkv.block_hashes(turn2, BS), "GPU") == {}
        (o2,) = run(b, [turn2])
        assert list(o2.outputs[0].token_ids) == list(engine.reference_greedy(tuple(turn2), N_NEW).token_ids)
        assert o2.num_cached_tokens == BS * (fed // BS) > BS * (len(p1) // BS)  # the answer's blocks too
        assert b.scheduler.stats.external_tokens == BS * (fed // BS)
        b.kv_tiers.connector.flush(30)
        assert b.kv_tiers.stats["store_skipped_unchecked"] == 0


def test_write_back_with_the_cpu_tier_stores_what_the_cpu_pool_drops(engine, tmp_path, monkeypatch):
    """Issue 24 (tiers' gaps, item 2): kv_store="back" with a CPU tier: a GPU eviction is a demotion, and the
    blocks the CPU pool drops are stored first (copied out of the CPU KV cache): every block the CPU tier evicts
    is on disk, only demoted blocks are stored, and a restart loads them (greedy output equal)."""
    qs = [list(range(1000 * i + 200, 1000 * i + 241)) for i in range(1, 5)]  # 10 full blocks each (+ decode)
    kw = dict(kv_disk_dir=tmp_path, kv_disk_gib=0.05, kv_store="back", num_gpu_blocks=16, num_cpu_blocks=16,
              cpu_prefix_cache=True)
    with make(engine, enable_kv_events=True, **kw) as a:
        assert a.block_manager.config.store_policy == "write_back"
        bm, media = a.kv_tiers._bm, []
        take = type(bm.external).take_store_plan  # (every plan the engine takes, through the external part)
        monkeypatch.setattr(type(bm.external), "take_store_plan",
                            lambda ext: (lambda p: media.append(p and p.medium) or p)(take(ext)))
        demoted, dropped = set(), set()
        for q in qs:  # one at a time: each pushes the previous ones' blocks GPU -> CPU -> out
            (o,) = run(a, [q])
            assert list(o.outputs[0].token_ids) == expected(engine, [q])[0]
            for e in a.block_manager.events.take():
                if getattr(e, "medium", None) == "CPU":
                    (demoted if type(e).__name__ == "BlockStored" else dropped).update(e.block_hashes)
        a.kv_tiers.connector.flush(30)
        a.kv_tiers.poll(a.scheduler)
        stored = {k for e in a.kv_tiers.take_events() if type(e).__name__ == "BlockStored" for k in e.block_hashes}
        assert dropped and dropped <= stored <= demoted  # what left the CPU pool was stored first; nothing else
        assert set(media) - {None} == {"CPU"}  # every plan read CPU blocks (copied out of the CPU KV cache)
        assert a.kv_tiers.stats["store_skipped_unchecked"] == 0
        assert set(pagedkv.block_hashes(qs[0], BS)) <= dropped  # the first prompt's blocks left the node ...
    with make(engine, **kw) as b:  # ... and a restart loads them from disk
        (o,) = run(b, [qs[0]])
        assert list(o.outputs[0].token_ids) == expected(engine, [qs[0]])[0]
        assert o.num_cached_tokens == b.scheduler.stats.external_tokens == BS * full_blocks(qs[0])


def test_identical_prompts_admitted_while_one_loads_load_once(engine, tmp_path):
    """Issue 24 (tiers' gaps, item 4): two identical prompts (and one that continues them) added at once after a
    restart: the first one's run is loaded, the others wait for that load to end and hit its blocks; every block
    is read once; greedy output equal."""
    p = PROMPTS[2]  # 41 tokens: 10 full blocks
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05) as a:
        run(a, [p])
    longer = p + [7, 8, 9, 10, 11]
    prompts = [p, p, longer]
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05) as b:
        outs = run(b, prompts)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected(engine, prompts)
        assert [o.num_cached_tokens for o in outs] == [BS * full_blocks(p)] * 3  # (p's blocks: what disk holds)
        assert b.scheduler.stats.external_tokens == BS * full_blocks(p)  # read once, not three times
        (d,) = b.kv_tiers.connector.counters()
        assert d.hit_blocks == full_blocks(p) and d.lookups == 3
        assert b.kv_tiers.stats["loads_deferred"] == 2 and b.kv_tiers.stats["loads"] == 1
