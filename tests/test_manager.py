"""Unit tests of every BlockManager method, and the feature combinations against a simulated KV store."""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
from no_torch import NO_TORCH as _NO_TORCH

import pagedkv
from pagedkv import NULL_BLOCK, AllocStatus, BlockManager
from pagedkv.blocks import prefix_cache as pc_mod
from pagedkv.errors import SequenceStateError

from test_errors import assert_unchanged, snapshot


class KVStore:
    """A fake KV cache: each physical slot holds the (token, position) whose KV was written there. Applying the
    manager's copy-on-write and swap pairs and reading back through block tables checks that every sequence
    sees exactly its own tokens."""

    def __init__(self, bm):
        self.bm = bm
        self.gpu = {}
        self.cpu = {}
        self.tokens = {}  # seq -> token list (the truth)

    def _copy(self, src_store, src, dst_store, dst):
        bs = self.bm.block_size
        for o in range(bs):
            if src * bs + o in src_store:
                dst_store[dst * bs + o] = src_store[src * bs + o]
            else:
                dst_store.pop(dst * bs + o, None)

    def allocate(self, seq, toks, **kw):
        hit = self.bm.allocate(seq, toks, **kw)
        self.tokens[seq] = list(toks)
        slots = self.bm.slot_mapping(seq, hit, len(toks))
        for p, s in zip(range(hit, len(toks)), slots):
            self.gpu[int(s)] = (toks[p], p)
        return hit

    def step(self, seqs, toks, la=0):
        res = self.bm.decode_step(seqs, toks, la)
        for s, d in res.cow:
            self._copy(self.gpu, s, self.gpu, d)
        flat = np.asarray(toks).reshape(len(seqs), -1)
        i = 0
        for seq, row in zip(seqs, flat):
            for t in row:
                p = len(self.tokens[seq])
                self.gpu[int(res.slot_mapping[i])] = (int(t), p)
                self.tokens[seq].append(int(t))
                i += 1
        return res

    def fork(self, parent, child):
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def free(self, seq):
        self.bm.free(seq)
        del self.tokens[seq]

    def swap_out(self, seqs):
        for g, c in self.bm.swap_out(seqs):
            self._copy(self.gpu, g, self.cpu, c)

    def swap_in(self, seqs):
        for c, g in self.bm.swap_in(seqs):
            self._copy(self.cpu, c, self.gpu, g)

    def verify(self):
        bm = self.bm
        bs = bm.block_size
        w = bm.config.sliding_window
        for seq, toks in self.tokens.items():
            if bm.is_swapped(seq):
                continue
            t = bm.block_table(seq)
            lo = 0 if w is None else max(0, len(toks) - w)
            for p in range(lo, len(toks)):
                b = int(t[p // bs])
                assert b != NULL_BLOCK, (seq, p)
                assert self.gpu.get(b * bs + p % bs) == (toks[p], p), (seq, p)
        bm.check_invariants()


# ---------------------------------------------------------------------------------------------- basics
def test_allocate_and_read_back():
    bm = BlockManager(10, 4)
    assert bm.allocate("s", [1, 2, 3, 4, 5]) == 0
    assert bm.num_tokens("s") == 5
    assert bm.block_table("s").tolist() == [0, 1]
    assert bm.slot_mapping("s", 0, 5).tolist() == [0, 1, 2, 3, 4]
    assert "s" in bm and len(bm) == 1 and bm.seq_ids == ("s",)
    assert bm.num_free_gpu_blocks == 8
    assert bm.stats.gpu_usage == pytest.approx(0.2)
    bm.free("s")
    assert bm.num_free_gpu_blocks == 10 and "s" not in bm
    bm.check_invariants()


def test_properties_are_read_only_and_results_immutable():
    bm = BlockManager(10, 4, num_cpu_blocks=3)
    for name in ("num_gpu_blocks", "num_cpu_blocks", "block_size", "num_free_gpu_blocks", "num_free_cpu_blocks",
                 "gpu_usage", "stats"):
        with pytest.raises(AttributeError):
            setattr(bm, name, 1)
    bm.allocate("s", [1, 2, 3])
    t = bm.block_table("s")
    with pytest.raises(ValueError):
        t[0] = 5
    res = bm.decode_step(["s"], np.array([4]))
    with pytest.raises(AttributeError):
        res.cow = None
    with pytest.raises(AttributeError):
        bm.stats.evictions = 3


def test_core_does_not_import_torch():
    code = _NO_TORCH + "import pagedkv, pagedkv.scheduler, pagedkv.manager, pagedkv.tiers.cpu, pagedkv.events"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decode_step_shapes_and_k_tokens():
    bm = BlockManager(32, 4)
    bm.allocate("a", range(3))
    bm.allocate("b", range(6))
    res = bm.decode_step(["a", "b"], np.array([[7, 8], [9, 10]]))
    assert res.slot_mapping.dtype == np.int64 and res.slot_mapping.shape == (4,)
    assert res.block_tables.dtype == np.int32 and res.block_tables.shape == (2, 2)
    assert res.seq_lens.tolist() == [5, 8]
    # a = [0], b = [1, 2]. a: positions 3, 4 -> block 0 slot 3, new block 3 slot 0; b: 6, 7 in block 2
    assert res.slot_mapping.tolist() == [3, 3 * 4 + 0, 2 * 4 + 2, 2 * 4 + 3]
    ragged = bm.decode_step(["a", "b"], [[1], [2, 3, 4]])
    assert ragged.seq_lens.tolist() == [6, 11]
    assert ragged.slot_mapping.tolist() == [3 * 4 + 1, 4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2]
    empty = bm.decode_step([], np.zeros(0, np.int64))
    assert empty.slot_mapping.shape == (0,) and empty.block_tables.shape == (0, 0)
    bm.check_invariants()


@pytest.mark.parametrize("caching", [False, True])
def test_flat_tokens_with_counts_equal_the_ragged_form(caching):
    rng = np.random.default_rng(3)
    ragged_bm = BlockManager(256, 4, enable_prefix_caching=caching, watermark=0)
    flat_bm = BlockManager(256, 4, enable_prefix_caching=caching, watermark=0)
    for bm in (ragged_bm, flat_bm):
        for s in range(5):
            bm.allocate(s, [s, 1, 2, 3, 4, 5][: 2 + s])
    for step in range(12):
        counts = rng.integers(1, 6, size=5)
        ragged = [rng.integers(0, 100, size=int(c)).tolist() for c in counts]
        a = ragged_bm.decode_step(list(range(5)), ragged, num_lookahead_slots=step % 3)
        flat = np.concatenate([np.asarray(r) for r in ragged])
        b = flat_bm.decode_step(list(range(5)), flat, num_lookahead_slots=step % 3, num_new_tokens=counts)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        flat_bm.check_invariants()
    # all counts 1: the flat form takes the one-token path
    a = ragged_bm.decode_step(list(range(5)), [[7]] * 5)
    b = flat_bm.decode_step(list(range(5)), np.full(5, 7), num_new_tokens=[1] * 5)
    np.testing.assert_array_equal(a.slot_mapping, b.slot_mapping)
    assert ragged_bm.stats.num_cached_blocks == flat_bm.stats.num_cached_blocks


def test_decode_step_memo_follows_changes_of_the_batch():
    bm = BlockManager(64, 4)
    for s in "abc":
        bm.allocate(s, [1, 2])
    ids = ["a", "b", "c"]
    bm.decode_step(ids, np.array([1, 1, 1]))
    bm.free("b")
    with pytest.raises(pagedkv.UnknownSequenceError):
        bm.decode_step(ids, np.array([1, 1, 1]))
    bm.allocate("b", [5])
    res = bm.decode_step(ids, np.array([1, 1, 1]))
    assert res.seq_lens.tolist() == [4, 2, 4]
    ids.remove("b")  # mutating the caller's list must not confuse the memo
    assert bm.decode_step(ids, np.array([1, 1])).seq_lens.tolist() == [5, 5]


def test_lookahead_slots_are_reserved_and_never_cached():
    bm = BlockManager(32, 4, enable_prefix_caching=True, watermark=0)
    bm.allocate("s", range(3))
    bm.append_slots("s", [3], num_lookahead_slots=5)  # 4 tokens + 5 slots -> 3 blocks
    assert bm.num_tokens("s") == 4
    assert len(bm.block_table("s")) == 3
    assert bm.slot_mapping("s", 4, 12).shape == (8,)
    with pytest.raises(pagedkv.InvalidArgumentError):
        bm.slot_mapping("s", 4, 13)
    # accepted draft tokens land in the reserved slots: no new blocks
    before = bm.block_table("s").tolist()
    bm.append_slots("s", [10, 11, 12])
    assert bm.block_table("s").tolist() == before
    bm.free("s")
    # only block 0 (4 real tokens, written) was cached; block 1 held lookahead slots when the sequence ended
    assert bm.stats.num_cached_blocks == 1


def test_prefix_hit_is_block_aligned_and_leaves_a_token_to_compute():
    bm = BlockManager(32, 4, enable_prefix_caching=True, watermark=0)
    prompt = list(range(100, 108))  # exactly two blocks
    bm.allocate("a", prompt)
    bm.decode_step(["a"], np.array([1]))  # the prompt's KV is written: its blocks enter the cache
    assert bm.allocate("b", prompt) == 4  # the last block is recomputed so that logits can be produced
    assert bm.allocate("c", prompt + [9]) == 8
    assert bm.allocate("d", prompt[:3]) == 0
    assert bm.allocate("e", [0] + prompt[1:]) == 0
    st = bm.stats
    assert st.prefix_hit_tokens == 12 and st.prefix_hit_blocks == 3
    assert st.prefix_query_tokens == 8 + 8 + 9 + 3 + 8
    assert 0 < st.hit_rate < 1
    bm.check_invariants()


def test_burst_sharing_prompt_blocks_are_findable_as_soon_as_allocate_returns():
    bm = BlockManager(32, 4, enable_prefix_caching=True, watermark=0)
    p = list(range(5 * 4 + 3))  # 5 full blocks + 3 tokens
    assert bm.allocate("a", p) == 0
    assert bm.allocate("b", p) == 20  # same step: b shares a's 5 full blocks, computed once
    assert bm.block_table("b")[:5].tolist() == bm.block_table("a")[:5].tolist()
    assert bm.block_table("b")[5] != bm.block_table("a")[5]  # the partial block is b's own
    assert bm.num_free_gpu_blocks == 32 - 7
    st = bm.stats
    assert (st.prefix_hit_tokens, st.prefix_hit_blocks) == (20, 5)
    bm.check_invariants()


def test_burst_sharing_a_block_filled_by_a_step_is_findable_after_the_step():
    bm = BlockManager(32, 4, enable_prefix_caching=True, watermark=0)
    bm.allocate("a", [1, 2, 3, 4, 5, 6, 7])
    assert bm.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    bm.decode_step(["a"], np.array([8]))  # a's block 1 is now full: same content as b's block 1, cached first
    assert bm.allocate("c", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert bm.block_table("c")[1] == bm.block_table("b")[1] != bm.block_table("a")[1]
    bm.decode_step(["a"], np.array([9]))
    bm.decode_step(["a"], np.array([9]))
    bm.decode_step(["a"], np.array([9]))
    bm.decode_step(["a"], np.array([9]))  # a's block 2 [9 9 9 9] is cached after a's chain (b's block 1)
    assert bm.allocate("e", [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 1]) == 12
    bm.free("e")
    bm.append_slots("c", [1, 2, 3, 4], num_lookahead_slots=3)  # fills block 2; lookahead-only block 3 never cached
    assert bm.allocate("d", [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 9]) == 12
    bm.check_invariants()


def test_free_without_cache_withdraws_the_blocks_of_the_last_call():
    bm = BlockManager(32, 4, enable_prefix_caching=True, watermark=0)
    bm.allocate("a", range(9))
    bm.free("a", cache=False)  # aborted before its prefill ran: nothing of it stays cached
    assert bm.stats.num_cached_blocks == 0
    assert bm.allocate("b", range(9)) == 0
    bm.decode_step(["b"], np.array([1]))  # the step ran: b's prompt blocks are confirmed
    bm.decode_step(["b"], np.array([2]))
    bm.decode_step(["b"], np.array([3]))  # fills block 2, not yet written
    assert bm.stats.num_cached_blocks == 3
    bm.free("b", cache=False)
    assert bm.stats.num_cached_blocks == 2  # only the block of the last call is withdrawn
    assert bm.allocate("c", list(range(9)) + [1, 2, 3, 4]) == 8
    bm.check_invariants()


def test_free_without_cache_refuses_to_strand_a_dependent_sequence():
    bm = BlockManager(32, 4, enable_prefix_caching=True, watermark=0)
    p = list(range(9))
    bm.allocate("a", p)
    assert bm.allocate("b", p) == 8  # b relies on KV that a's prefill writes
    before = snapshot(bm)
    with pytest.raises(SequenceStateError, match="'b'"):
        bm.free("a", cache=False)
    assert_unchanged(bm, before, "free(cache=False) with a dependent")
    bm.free("b", cache=False)  # reverse order of allocation always works
    bm.free("a", cache=False)
    assert bm.stats.num_cached_blocks == 0 and bm.num_free_gpu_blocks == 32
    bm.check_invariants()
    # once a later call touched "a", its prompt's KV counts as written and b may depend on it
    bm.allocate("a", p)
    bm.fork("a", "a2")  # fork confirms the parent
    assert bm.allocate("b", p) == 8
    bm.free("a", cache=False)
    bm.free("a2", cache=False)
    assert bm.stats.num_cached_blocks == 2
    bm.check_invariants()


def test_namespaces_never_share():
    bm = BlockManager(32, 4, enable_prefix_caching=True, watermark=0)
    bm.allocate("a", range(9), namespace="tenant-1")
    bm.free("a")
    assert bm.allocate("b", range(9), namespace="tenant-2") == 0
    assert bm.allocate("c", range(9)) == 0
    assert bm.allocate("d", range(9), namespace="tenant-1") == 8
    with pytest.raises(pagedkv.InvalidArgumentError):
        bm.allocate("e", range(9), namespace=3.5)


def test_keys_are_deterministic_across_processes():
    code = (
        "from pagedkv import BlockManager;bm=BlockManager(4,4,enable_prefix_caching=True,watermark=0);"
        "bm.allocate('s',list(range(9)),namespace='ns');bm.free('s');print(sorted(bm._cache.mapping()))"
    )
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": str(seed), **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}).stdout
            for seed in (1, 2)}
    assert len(outs) == 1 and outs.pop().strip()


def test_hash_collisions_never_hand_out_another_sequences_kv(monkeypatch):
    monkeypatch.setattr(pc_mod, "_xxh3", lambda data, seed=0: 42)  # every key collides
    bm = BlockManager(64, 2, enable_prefix_caching=True, watermark=0)
    kv = KVStore(bm)
    kv.allocate("a", [1, 2, 3, 4, 5])
    kv.step(["a"], np.array([6]))
    assert bm.stats.num_cached_blocks == 1  # only the first full block got the single key
    assert kv.allocate("b", [3, 4, 1, 2, 5]) == 0  # same key, other content: miss
    assert kv.allocate("c", [9, 9, 3, 4, 5]) == 0
    assert kv.allocate("d", [1, 2, 3, 4, 7]) == 2  # genuine hit on block 0 only
    kv.step(["b", "c", "d"], np.array([1, 1, 1]))
    kv.verify()


def test_can_allocate_watermark_and_shared_blocks():
    bm = BlockManager(100, 4, enable_prefix_caching=True, watermark=0.1)
    assert bm.config.watermark_blocks == 10
    assert bm.can_allocate(range(4 * 90)) is AllocStatus.OK
    assert bm.can_allocate(range(4 * 91)) is AllocStatus.NEVER
    assert bm.can_allocate(range(4 * 88), num_lookahead_slots=9) is AllocStatus.NEVER
    bm.allocate("a", range(4 * 80 + 1))
    bm.decode_step(["a"], np.array([0]))  # a's 80 full prompt blocks are cached and held by a
    assert bm.can_allocate(range(1000, 1000 + 4 * 9)) is AllocStatus.OK
    assert bm.can_allocate(range(1000, 1000 + 4 * 10)) is AllocStatus.LATER
    # the same prompt shares 80 live blocks: only its last block is new
    assert bm.can_allocate(range(4 * 80 + 1)) is AllocStatus.OK


def test_fork_shares_everything_and_frees_independently():
    bm = BlockManager(16, 4, watermark=0)
    bm.allocate("p", range(10))
    for c in ("c1", "c2", "c3"):
        bm.fork("p", c)
    assert bm._gpu.ref[bm.block_table("p")].tolist() == [4, 4, 4]
    assert bm.num_free_gpu_blocks == 13
    bm.free("p")
    assert bm.num_free_gpu_blocks == 13
    for c in ("c1", "c2", "c3"):
        bm.free(c)
    assert bm.num_free_gpu_blocks == 16
    bm.check_invariants()


def test_can_append_slots_counts_cow_and_new_blocks():
    bm = BlockManager(4, 4, watermark=0)
    bm.allocate("p", range(6))  # 2 blocks
    bm.fork("p", "c")
    bm.allocate("q", range(8))  # 2 blocks: pool full
    assert not bm.can_append_slots(["p"])  # needs a copy-on-write block
    assert bm.can_append_slots([])
    with pytest.raises(pagedkv.OutOfBlocksError):
        bm.decode_step(["p", "c"], np.array([1, 2]))
    bm.free("q")
    assert bm.can_append_slots(["p", "c"])  # one copy suffices: the last writer keeps the block
    assert not bm.can_append_slots(["p", "c"], num_lookahead_slots=8)
    bm.decode_step(["p", "c"], np.array([1, 2]))
    assert bm.num_free_gpu_blocks == 1


def test_reset_prefix_cache():
    bm = BlockManager(16, 4, enable_prefix_caching=True, watermark=0)
    bm.allocate("a", range(9))
    bm.free("a")
    bm.allocate("b", range(100, 109))
    bm.decode_step(["b"], np.array([1]))
    assert bm.stats.num_cached_blocks == 4
    assert bm.reset_prefix_cache() == 2
    assert bm.stats.num_cached_blocks == 0 and bm.num_free_gpu_blocks == 13
    assert bm.allocate("c", range(9)) == 0
    # b lived through the reset: its blocks are never cached again; c, allocated after it, caches as usual
    bm.decode_step(["b", "c"], np.array([2, 3]))
    bm.decode_step(["b", "c"], np.array([4, 5]))
    assert bm.stats.num_cached_blocks == 2  # c's two full prompt blocks
    bm.free("b")
    assert bm.stats.num_cached_blocks == 2
    assert bm.allocate("d", [*range(100, 109), 1, 2, 4, 9]) == 0
    bm.check_invariants()
    assert BlockManager(4, 4).reset_prefix_cache() == 0


def test_swap_round_trip_with_prefix_cache_reuses_still_cached_blocks():
    bm = BlockManager(16, 4, num_cpu_blocks=16, enable_prefix_caching=True, watermark=0)
    kv = KVStore(bm)
    kv.allocate("a", list(range(10)))
    kv.step(["a"], np.array([10]))
    kv.swap_out(["a"])
    assert bm.is_swapped("a") and bm.stats.num_cached_blocks == 2
    assert bm.can_swap_in(["a"]) is AllocStatus.OK
    before = bm.stats.swapped_in_blocks
    kv.swap_in(["a"])
    assert bm.stats.swapped_in_blocks - before == 3
    assert bm.stats.num_free_cpu_blocks == 16
    kv.verify()
    kv.step(["a"], np.array([11]))
    kv.verify()


def test_can_swap_statuses():
    bm = BlockManager(10, 4, num_cpu_blocks=2, watermark=0)
    bm.allocate("a", range(9))  # 3 blocks
    assert not bm.can_swap_out(["a"])
    with pytest.raises(pagedkv.OutOfBlocksError):
        bm.swap_out(["a"])
    bm2 = BlockManager(4, 4, num_cpu_blocks=8, watermark=0)
    bm2.allocate("a", range(12))
    bm2.swap_out(["a"])
    bm2.allocate("b", range(8))
    assert bm2.can_swap_in(["a"]) is AllocStatus.LATER
    assert bm2.can_swap_in(["a"], num_lookahead_slots=5) is AllocStatus.NEVER
    bm2.free("b")
    assert bm2.can_swap_in(["a"]) is AllocStatus.OK


# ------------------------------------------------------------------------------ feature combinations
@pytest.mark.parametrize(
    "caching,window,lookahead,bs",
    list(itertools.product([False, True], [None, 6], [0, 3], [1, 2, 4])),
)
def test_combinations_keep_every_sequence_consistent(caching, window, lookahead, bs):
    """prefix caching x sliding window x lookahead x fork x swap, against the simulated KV store."""
    rng = np.random.default_rng(bs * 7 + lookahead + (window or 0) + caching)
    bm = BlockManager(400, bs, num_cpu_blocks=400, enable_prefix_caching=caching, sliding_window=window,
                      watermark=0)
    kv = KVStore(bm)
    shared = [int(x) for x in rng.integers(0, 5, 9)]
    for i in range(4):
        kv.allocate(f"s{i}", shared + [int(x) for x in rng.integers(0, 5, i + 1)])
    kv.verify()
    live = [f"s{i}" for i in range(4)]
    for step in range(24):
        if step == 3:
            kv.fork("s0", "f0")
            kv.fork("s0", "f1")
            live += ["f0", "f1"]
        if step == 6:
            kv.swap_out(["s0", "f0"])
            live = [s for s in live if s not in ("s0", "f0")]
        if step == 9:
            kv.swap_in(["f0", "s0"])
            live += ["s0", "f0"]
        if step == 12:
            kv.free("s1")
            live.remove("s1")
            kv.allocate("n1", shared + [4])
            live.append("n1")
        k = 2 if step % 5 == 4 else 1
        toks = rng.integers(0, 5, (len(live), k)) if k > 1 else rng.integers(0, 5, len(live))
        kv.step(live, toks, lookahead)
        kv.verify()
        if window is not None:
            for s in live:
                assert (bm.block_table(s) >= 0).sum() <= -(-(window + lookahead + k) // bs) + 2
    for s in list(kv.tokens):
        kv.free(s)
    bm.check_invariants()
    assert bm.num_free_gpu_blocks == 400 and bm.stats.num_free_cpu_blocks == 400
