"""The engine's tiers on the block manager's external-KV contract (issue 24 item 2, SmolLM2, blocks of 4): a
request whose prefix a tier holds gets its GPU blocks reserved (the manager counts them: LOADING) and waits out
of every batch while a slow store reads its KV, and the other requests keep stepping; the load is written into
the reserved blocks and reported (``finish_external``); a read that never answers is given up and its tokens
computed; an abort mid-load parks the blocks until the read ends; each write policy (through, selective:N,
back, off) stores what it says. Greedy output equal to the reference throughout."""

from __future__ import annotations

import threading

import pytest

import pagedkv

pytestmark = pytest.mark.engine

BS = 4
N_NEW = 5
LONG = list(range(200, 241))  # 41 tokens: 10 full blocks a tier can serve
SHORT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173]


def greedy(n=N_NEW):
    from pagedkv.engine.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make(engine, **kw):
    from pagedkv.engine.config import engine_configs
    from pagedkv.engine.llm import LLM

    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("num_gpu_blocks", 96)
    return LLM(engine.paged, block_size=BS, **engine_configs(**kw))


def ref(engine, p, n=N_NEW):
    return list(engine.reference_greedy(tuple(p), n).token_ids)


@pytest.fixture
def gated(monkeypatch, tmp_path):
    """The shared tier a directory whose reads wait for ``gate`` (a slow store under the test's control)."""
    from pagedkv.engine import kv_tiers
    from pagedkv.tiers import SharedDirBackend

    gate = threading.Event()
    gate.set()
    path = tmp_path / "shared"

    class Gated(SharedDirBackend):
        def read_many(self, names):
            gate.wait(60)
            return super().read_many(names)

    monkeypatch.setattr(kv_tiers, "open_shared_backend", lambda url: Gated(path))
    yield gate
    gate.set()


def test_a_slow_load_goes_into_reserved_blocks_while_the_others_step(engine, gated):
    with make(engine, kv_shared="file:///unused") as a:  # computes LONG, writes its blocks through
        assert list(a.generate([{"prompt_token_ids": LONG}], greedy(), use_tqdm=False)[0].outputs[0].token_ids) \
            == ref(engine, LONG)
        a.kv_tiers.connector.flush(30)
        a.kv_tiers.poll(a.scheduler)  # (the store plans complete)
        assert not a.block_manager.external.pending_stores
    gated.clear()  # the store is slow now: reads wait
    with make(engine, kv_shared="file:///unused") as b:
        bm = b.block_manager
        slow = b.core.make_request({"prompt_token_ids": LONG}, greedy())
        other = b.core.make_request({"prompt_token_ids": SHORT}, greedy(8))
        free0 = bm.num_free_gpu_blocks
        fetched_steps = 0
        finished = []
        for done in b._run([slow, other]):
            finished += [r.request_id for r in done]
            if b.scheduler.is_fetching(slow.request_id):
                fetched_steps += 1
                # reserved: the manager counts the blocks of the loading sequence, which is in no batch
                assert bm.external.loading_seq_ids and bm.num_free_gpu_blocks <= free0 - 10
                if other.request_id in finished:
                    gated.set()  # the other request finished while this one loaded: let the read go on
            bm.check_invariants()
        assert finished.index(other.request_id) < finished.index(slow.request_id)
        # the other request's 7 decode steps ran meanwhile (its prefill too, unless the slow one's lookup ended
        # after the first step: timing-dependent on a loaded machine)
        assert fetched_steps >= 7
        assert list(slow.result.outputs[0].token_ids) == ref(engine, LONG)
        assert list(other.result.outputs[0].token_ids) == ref(engine, SHORT, 8)
        assert slow.result.num_cached_tokens == 40 and b.scheduler.stats.external_tokens == 40
        assert b.kv_tiers.stats["written_blocks"] == 10 and not bm.external.loading_seq_ids
        # write-through plans the loaded blocks once registered: they came from the tier, nothing is rewritten
        assert b.kv_tiers.stats["store_skipped_loaded"] == 10


def test_a_read_that_never_answers_is_given_up_and_computed(engine, gated):
    with make(engine, kv_shared="file:///unused") as a:
        a.generate([{"prompt_token_ids": LONG}], greedy(), use_tqdm=False)
    gated.clear()  # never opened while b runs
    with make(engine, kv_shared="file:///unused") as b:
        b.kv_tiers.load_timeout_s = 0.5
        out = b.generate([{"prompt_token_ids": LONG}], greedy(), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == ref(engine, LONG)
        assert b.kv_tiers.stats["loads_timed_out"] == 1 and b.scheduler.stats.external_tokens == 0
        assert not b.block_manager.external.loading_seq_ids and not b.block_manager.external.parked_seq_ids
        gated.set()
        b.kv_tiers.connector.wait(10)
        b.kv_tiers.poll(b.scheduler)  # the late result is dropped
        assert b.kv_tiers.stats["written_blocks"] == 0
        b.block_manager.check_invariants()


def test_abort_mid_load_parks_the_blocks_until_the_read_ends(engine, gated):
    with make(engine, kv_shared="file:///unused") as a:
        a.generate([{"prompt_token_ids": LONG}], greedy(), use_tqdm=False)
    gated.clear()
    with make(engine, kv_shared="file:///unused") as b:
        bm, sched = b.block_manager, b.scheduler
        free0 = bm.num_free_gpu_blocks
        r = b.core.make_request({"prompt_token_ids": LONG}, greedy())
        b.core.add_request(r)
        for _ in range(200):
            b.core.step()
            if sched.is_fetching(r.request_id):
                break
            b.kv_tiers.wait(0.05)
        assert sched.is_fetching(r.request_id)
        sched.abort_request(r.request_id)
        assert bm.external.parked_seq_ids and sched.num_parked == 1  # the read may still deliver: blocks kept
        b.core.step()
        assert bm.external.parked_seq_ids
        gated.set()
        for _ in range(200):
            b.kv_tiers.wait(0.05)
            b.core.step()
            if not bm.external.parked_seq_ids:
                break
        assert not bm.external.parked_seq_ids and bm.num_free_gpu_blocks == free0 and sched.num_parked == 0
        assert b.kv_tiers.stats["loads_aborted"] == 1 and b.kv_tiers.stats["written_blocks"] == 0
        bm.check_invariants()
        out = b.generate([{"prompt_token_ids": LONG}], greedy(), use_tqdm=False)[0]  # the engine goes on
        assert list(out.outputs[0].token_ids) == ref(engine, LONG)


def _disk_keys(llm):
    llm.kv_tiers.connector.flush(30)
    llm.kv_tiers.poll(llm.scheduler)
    disk = llm.kv_tiers.connector.stores()[0]
    return disk.stats.stored


@pytest.mark.parametrize("policy", ["through", "selective:2", "back", "off"])
def test_each_write_policy_stores_what_it_says(engine, tmp_path, policy):
    want = ref(engine, LONG)
    n_full = 10
    kw = dict(kv_disk_dir=tmp_path, kv_disk_gib=0.05, kv_store=policy)
    if policy == "back":
        kw["num_gpu_blocks"] = 24  # a small pool: blocks are evicted, and written back before they go
    with make(engine, **kw) as a:
        bm = a.block_manager
        assert bm.config.store_policy == {"through": "write_through", "selective:2": "selective", "back": "write_back",
                                   "off": "none"}[policy]
        outs = [a.generate([{"prompt_token_ids": LONG}], greedy(), use_tqdm=False)[0]]
        first = _disk_keys(a)
        for i in range(2):  # the same prompt twice more (GPU hits), then other prompts that push it out
            outs.append(a.generate([{"prompt_token_ids": LONG}], greedy(), use_tqdm=False)[0])
        after_hits = _disk_keys(a)
        for j in range(4):
            a.generate([{"prompt_token_ids": [300 + 50 * j + t for t in range(41)]}], greedy(), use_tqdm=False)
        last = _disk_keys(a)
        assert all(list(o.outputs[0].token_ids) == want for o in outs)
        assert not bm.external.pending_stores
        bm.check_invariants()
    if policy == "through":
        assert first >= n_full  # every full block once computed
    elif policy == "selective:2":
        assert first == 0 and after_hits >= n_full - 1  # stored once hit twice (the 10th block is recomputed)
    elif policy == "back":
        assert first == 0 or first < n_full  # nothing is stored while it is referenced or far from eviction
        assert last > 0  # the pool's evictions were written back first
    else:
        assert last == 0
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05) as b:  # a restart: what the policy stored loads
        out = b.generate([{"prompt_token_ids": LONG}], greedy(), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == want
        loaded = b.scheduler.stats.external_tokens
        assert (loaded == 0) == (policy == "off")
