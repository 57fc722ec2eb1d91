"""Stateful property tests: random operation sequences against BlockManager and a simple reference model.

The reference model keeps, per sequence, its token list and its list of *logical* blocks (plain Python objects;
two sequences share a block exactly when their lists hold the same object). It does not predict block ids: the
id of every block the manager hands out is read once from the manager and then only compared. From the model
follow, without looking inside the manager: whether each call succeeds or which exception it raises, token
counts, table lengths, which table positions are shared (after fork, copy-on-write, swaps), the number of free
GPU and CPU blocks, the copy-on-write and swap pairs, statistics, and bounds on prefix-cache hits.

On top of that a simulated KV store checks physical consistency: every slot holds the identity of the prefix
whose KV was written there (the KV of position p depends on tokens 0..p and the namespace). Each call's
copy-on-write and swap pairs are applied as copies, each new token is written at the slot the manager returns,
and after every step every sequence must read back its own prefix identities through its block table. Wrong
sharing, a missed copy-on-write, a prefix hit on another sequence's KV or a bad swap all show up there.

More examples: PAGEDKV_STATEFUL_EXAMPLES=2000 PAGEDKV_STATEFUL_STEPS=80 pytest tests/test_stateful.py
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis import event
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv import EVICTION_POLICIES, NULL_BLOCK, AllocStatus, BlockManager, block_hashes
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.errors import (
    DuplicateSequenceError,
    OutOfBlocksError,
    PromptTooLongError,
    SequenceStateError,
    UnknownSequenceError,
    InvalidArgumentError,
    PinBudgetError,
    UnknownPinError,
)

_spec = importlib.util.spec_from_file_location("_pagedkv_test_errors", Path(__file__).with_name("test_errors.py"))
_errors_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_errors_mod)
snapshot = _errors_mod.snapshot
assert_unchanged = _errors_mod.assert_unchanged

EXAMPLES = int(os.environ.get("PAGEDKV_STATEFUL_EXAMPLES", "200"))
STEPS = int(os.environ.get("PAGEDKV_STATEFUL_STEPS", "40"))

NAMESPACES = [None, None, None, "tenant", 7, b"tenant"]
VOCAB = st.integers(0, 2)  # a tiny vocabulary: equal blocks (and prefix hits) happen by chance too


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class LBlock:
    """A logical block of the model: ``phys`` is the id the manager gave it (GPU or CPU id space)."""

    __slots__ = ("phys", "gpu")

    def __init__(self, phys: int, gpu: bool) -> None:
        self.phys = int(phys)
        self.gpu = gpu

    def __repr__(self) -> str:
        return f"{'G' if self.gpu else 'C'}{self.phys}"


class MSeq:
    __slots__ = ("tokens", "keys", "ns", "blocks", "swapped", "pending", "plen", "rest")

    def __init__(self, ns, tokens, keys, blocks):
        self.ns = ns
        self.tokens = tokens  # list[int]
        self.keys = keys  # keys[p]: identity of the prefix tokens[: p + 1] in namespace ns
        self.blocks = blocks  # list[LBlock | None]; None: released by the sliding window
        self.swapped = False
        self.pending: list = []  # own blocks the last call filled (their KV counts as unwritten until the next)
        self.plen = 0  # chunked prefill: the prompt's length (fork is refused while fewer tokens are appended)
        self.rest: list = []  # chunked prefill: the prompt tokens not appended yet

    def clone(self) -> "MSeq":
        c = MSeq(self.ns, list(self.tokens), list(self.keys), list(self.blocks))
        c.swapped = self.swapped
        return c

    @property
    def nrel(self) -> int:
        n = 0
        while n < len(self.blocks) and self.blocks[n] is None:
            n += 1
        return n


MISSING = object()


class PagedKVMachine(RuleBasedStateMachine):
    PREFIX = False
    WINDOW = False
    MAX_EVENTS = 100_000
    SMALL_PATH = True  # small batches take the plain-Python step (False: always the vectorised one)
    TIER = False  # the CPU tier of the prefix cache (when there is a CPU pool)
    RETAIN = False  # an eviction policy drawn from EVICTION_POLICIES, priorities, session hints and pins

    # ------------------------------------------------------------------ setup
    @initialize(
        bs=st.integers(1, 4),
        gpu=st.sampled_from([1, 2, 3, 4, 6, 8, 8, 12, 16]),
        cpu=st.sampled_from([0, 0, 2, 4, 8, 12]),
        window=st.integers(1, 9),
        watermark=st.sampled_from([0.0, 0.0, 0.0, 0.1, 0.25]),
        policy=st.sampled_from(EVICTION_POLICIES),
        budget=st.integers(0, 6),
    )
    def setup(self, bs, gpu, cpu, window, watermark, policy="lru", budget=0):
        self.bs, self.G, self.C = bs, gpu, cpu
        self.W = window if self.WINDOW else None
        self.wm = int(watermark * gpu)
        self.bm = BlockManager(
            gpu, bs, num_cpu_blocks=cpu, enable_prefix_caching=self.PREFIX, sliding_window=self.W, watermark=watermark,
            enable_kv_events=self.PREFIX, max_kv_events=self.MAX_EVENTS,
            cpu_prefix_cache=self.TIER and self.PREFIX and cpu > 0,
            **({"eviction_policy": policy, "pin_budget_blocks": budget} if self.RETAIN else {}),
        )
        self.pins: dict[int, tuple] = {}  # pin id -> (namespace, tokens, tokens pinned, GPU blocks, withdrawn ones)
        self.written: list[tuple] = []  # (namespace, tokens) of sequences freed with cache=True (their KV written)
        self.index: set[int] = set()  # block hashes a router knows, fed only by KV events (GPU tier)
        self.cpu_index: set[int] = set()  # the same for the CPU tier
        if not self.SMALL_PATH:
            self.bm._small_batch = 0  # drive the vectorised step on small batches too
        self.seqs: dict[object, MSeq] = {}
        self.next_id = 0
        self.intern: dict[tuple, int] = {}
        self.kv_gpu: dict[int, int] = {}
        self.kv_cpu: dict[int, int] = {}
        self.ever_full: set[int] = set()  # prefix keys of every block that was ever completely written
        self.stats = Counter()
        self.history: list[tuple] = []  # (namespace, tokens) of freed sequences, to allocate again

    # ------------------------------------------------------------------ model helpers
    def key(self, parent, tok: int) -> int:
        k = (parent, tok)
        v = self.intern.get(k)
        if v is None:
            v = self.intern[k] = len(self.intern)
        return v

    def root(self, ns):
        return ("ns", type(ns).__name__, ns)

    def keys_for(self, ns, tokens, start_keys=()):
        keys = list(start_keys)
        parent = keys[-1] if keys else self.root(ns)
        for t in tokens[len(keys):]:
            parent = self.key(parent, t)
            keys.append(parent)
        return keys

    def live(self, gpu: bool) -> dict[int, LBlock]:
        """phys -> logical block, for the live blocks of one pool (checks phys ids are not shared by two)."""
        out: dict[int, LBlock] = {}
        for s in self.seqs.values():
            if s.swapped == gpu:
                continue
            for L in s.blocks:
                if L is not None:
                    assert L.gpu == gpu
                    assert out.setdefault(L.phys, L) is L, f"two logical blocks on physical block {L.phys}"
        return out

    def held_pins(self) -> set:
        """GPU blocks pins hold: their pinned content is still cached (an aborted write withdraws it)."""
        return {b for *_, blocks, lost in self.pins.values() for b in blocks if b not in lost}

    def free_gpu(self) -> int:
        live = self.live(True)
        parked = self.held_pins() - set(live)  # pinned, idle: not free
        return self.G - len(live) - len(parked)

    def free_cpu(self) -> int:
        return self.C - len(self.live(False))

    def content(self, L: LBlock, j: int):
        """Prefix key of logical block L at table position j if it is full for its holders, else None."""
        bs = self.bs
        for s in self.seqs.values():
            if j < len(s.blocks) and s.blocks[j] is L and len(s.tokens) >= (j + 1) * bs:
                return s.keys[(j + 1) * bs - 1]
        return None

    def live_contents(self) -> set:
        out = set()
        bs = self.bs
        for s in self.seqs.values():
            if s.swapped:
                continue
            for j, L in enumerate(s.blocks):
                if L is not None and len(s.tokens) >= (j + 1) * bs:
                    out.add(s.keys[(j + 1) * bs - 1])
        return out

    def write(self, s: MSeq, positions, slots) -> None:
        """The engine writes the KV of ``positions`` of ``s`` at ``slots`` (GPU)."""
        bs = self.bs
        for p, slot in zip(positions, slots):
            self.kv_gpu[int(slot)] = s.keys[p]
            if (p + 1) % bs == 0:
                self.ever_full.add(s.keys[p])

    def copy_block(self, src_store, src, dst_store, dst) -> None:
        bs = self.bs
        for o in range(bs):
            v = src_store.get(src * bs + o, MISSING)
            if v is MISSING:
                dst_store.pop(dst * bs + o, None)
            else:
                dst_store[dst * bs + o] = v

    def bootstrap(self, data) -> None:
        """Rules that need a sequence allocate one when there is none, instead of doing nothing."""
        prompt = data.draw(st.lists(VOCAB, min_size=1, max_size=max(1, min(6, (self.G - self.wm) * self.bs))))
        self.allocate(prompt=prompt, share=0, base=1, ns=None, dup=1, la=0)

    def new_id(self, reuse: bool):
        if reuse and self.seqs:
            return next(iter(self.seqs))
        self.next_id += 1
        return ("s", self.next_id) if self.next_id % 3 == 0 else self.next_id

    def unknown_id(self):
        return ("never", self.next_id + 1000)

    def expect_failure(self, exc_type, fn, *args, **kwargs):
        """Run a call that must raise ``exc_type`` and must not change the manager."""
        before = snapshot(self.bm)
        with pytest.raises(exc_type):
            fn(*args, **kwargs)
        assert_unchanged(self.bm, before, f"{fn.__name__} raised {exc_type.__name__}")

    # ------------------------------------------------------------------ append prediction
    def plan(self, sids, counts, la):
        """Sequential model of an append: (fits, releases, cows, needs) where releases is {sid: first..stop},
        cows the (sid, col) pairs that must be copied, needs each sequence's table length afterwards."""
        bs, W = self.bs, self.W
        holders = Counter()
        for s in self.seqs.values():
            if not s.swapped:
                for L in s.blocks:
                    if L is not None:
                        holders[id(L)] += 1
        freed = 0
        releases = {}
        if W is not None:
            for sid in sids:
                s = self.seqs[sid]
                target = max(len(s.tokens) - W + 1, 0) // bs
                a = s.nrel
                if target > a:
                    releases[sid] = (a, target)
                    for j in range(a, target):
                        L = s.blocks[j]
                        holders[id(L)] -= 1
                        freed += holders[id(L)] == 0
        cows = []
        needs = []
        new = 0
        for sid, k in zip(sids, counts):
            s = self.seqs[sid]
            ntok, nb = len(s.tokens), len(s.blocks)
            end = ntok + k
            for col in range(ntok // bs, min((end + la - 1) // bs, nb - 1) + 1):  # (lookahead slots too)
                L = s.blocks[col]
                if holders[id(L)] > 1:
                    holders[id(L)] -= 1
                    cows.append((sid, col))
            need = max(cdiv(end + la, bs), nb)
            needs.append(need)
            new += need - nb
        fits = new + len(cows) <= self.free_gpu() + freed
        return fits, releases, cows, needs

    def do_append(self, sids, counts, flat_tokens, la, call):
        """Run an append (decode_step or append_slots) through ``call`` and check it against the plan."""
        fits, releases, cows, needs = self.plan(sids, counts, la)
        event(f"{call.__name__}: {'ok' if fits else 'out of blocks'}")
        if releases:
            event(f"{call.__name__}: window releases")
        if cows:
            event(f"{call.__name__}: copy-on-write" + (" (a block copied twice)" if len(set(
                id(self.seqs[s].blocks[c]) for s, c in cows)) < len(cows) else ""))
        if not fits:
            self.expect_failure(OutOfBlocksError, call)
            return None
        res_slots, res_tables, res_lens, res_cow = call()
        self.sync_tier()
        bs = self.bs
        # copy-on-write pairs: exactly the predicted (sequence, column) positions change block
        old = {(sid, col): self.seqs[sid].blocks[col] for sid, col in cows}
        real_cow = sorted(map(tuple, np.asarray(res_cow).reshape(-1, 2).tolist()))
        assert len(real_cow) == len(cows), f"cow pairs {real_cow}, expected positions {cows}"
        self.stats["cow"] += len(cows)
        # update the model
        i = 0
        expected_cow = []
        for sid, k, need in zip(sids, counts, needs):
            s = self.seqs[sid]
            if sid in releases:
                a, z = releases[sid]
                for j in range(a, z):
                    s.blocks[j] = None
            table = self.bm.block_table(sid).tolist()
            assert len(table) == need, f"table of {sid!r} has {len(table)} blocks, expected {need}"
            for col in range(len(s.blocks)):
                L = s.blocks[col]
                if (sid, col) in old:
                    assert table[col] != old[(sid, col)].phys
                    s.blocks[col] = LBlock(table[col], True)
                    expected_cow.append((old[(sid, col)].phys, table[col]))
                elif L is None:
                    assert table[col] == NULL_BLOCK
                else:
                    assert table[col] == L.phys, f"{sid!r} col {col}: block changed without copy-on-write"
            s.blocks.extend(LBlock(b, True) for b in table[len(s.blocks):])
            new_toks = flat_tokens[i : i + k]
            i += k
            ntok = len(s.tokens)
            s.pending = [L for L in s.blocks[ntok // bs : (ntok + k) // bs] if L is not None]
            s.tokens.extend(new_toks)
            s.keys = self.keys_for(s.ns, s.tokens, s.keys)
            exp_slots = [s.blocks[p // bs].phys * bs + p % bs for p in range(ntok, ntok + k)]
            got = np.asarray(res_slots)
            assert got.dtype == np.int64
            offset = sum(counts[: sids.index(sid)])
            assert got[offset : offset + k].tolist() == exp_slots
        assert sorted(expected_cow) == real_cow
        if res_tables is not None:
            assert res_lens.tolist() == [len(self.seqs[s].tokens) for s in sids]
            width = max(needs) if needs else 0
            assert res_tables.shape == (len(sids), width)
            for r, sid in enumerate(sids):
                s = self.seqs[sid]
                exp = [L.phys if L is not None else NULL_BLOCK for L in s.blocks]
                assert res_tables[r].tolist() == exp + [NULL_BLOCK] * (width - len(exp))
        # the engine: copy-on-write copies first, then the new tokens' KV
        for src, dst in real_cow:
            self.copy_block(self.kv_gpu, src, self.kv_gpu, dst)
        got = np.asarray(res_slots).tolist()
        i = 0
        for sid, k in zip(sids, counts):
            s = self.seqs[sid]
            n = len(s.tokens)
            self.write(s, range(n - k, n), got[i : i + k])
            i += k
        return fits

    # ------------------------------------------------------------------ rules
    @rule(
        prompt=st.lists(VOCAB, min_size=1, max_size=8),
        share=st.sampled_from([0, 0, 1, 2, 3, 4, 6, 8, 1000, 1000]),
        base=st.integers(0, 1000),
        ns=st.sampled_from(NAMESPACES),
        dup=st.integers(0, 15),
        la=st.integers(0, 3),
        chunk=st.sampled_from([None, None, None, None, 1, 2, 3, 5]),
    )
    def allocate(self, prompt, share, base, ns, dup, la, chunk=None):
        bs, bm = self.bs, self.bm
        sources = [(s.ns, s.tokens) for s in self.seqs.values()] + self.history[-6:]
        if share and sources:  # start with (part of) a live or freed sequence's tokens, usually same namespace
            src_ns, src_tokens = sources[base % len(sources)]
            prompt = src_tokens[:share] + prompt
            ns = src_ns if base % 4 else ns
        if base % 6:  # mostly prompts that can fit the pool at all
            prompt = prompt[: max(1, (self.G - self.wm) * bs)]
        sid = self.new_id(reuse=dup == 0)
        n = len(prompt)
        nb = cdiv(n, bs)
        status = bm.can_allocate(prompt, namespace=ns)
        status_la = bm.can_allocate(prompt, la, namespace=ns)
        kw = {"namespace": ns} if chunk is None else {"namespace": ns, "num_new_tokens": chunk}
        if sid in self.seqs:
            self.expect_failure(DuplicateSequenceError, bm.allocate, sid, prompt, **kw)
            return
        if nb > self.G - self.wm:
            assert status is AllocStatus.NEVER
            if chunk is not None and self.W is not None and chunk < n and \
                    min(nb, cdiv(self.W - 1 + chunk, bs) + 1) <= self.G - self.wm:
                # a windowed manager admits it in chunks (issue 23 C; tests/test_findability.py runs one through)
                assert bm.can_allocate(prompt, namespace=ns, num_new_tokens=chunk) is not AllocStatus.NEVER
                return
            if chunk is not None:  # a chunk of a prompt that can never be completed is refused all the same
                assert bm.can_allocate(prompt, namespace=ns, num_new_tokens=chunk) is AllocStatus.NEVER
            self.expect_failure(PromptTooLongError, bm.allocate, sid, prompt, **kw)
            return
        assert status is not AllocStatus.NEVER
        keys = self.keys_for(ns, prompt)
        free = self.free_gpu()
        live_before = self.live(True)
        # prefix-hit bounds: at most the leading blocks whose content was ever fully written
        max_hit = 0
        if self.PREFIX:
            while max_hit < (n - 1) // bs and keys[(max_hit + 1) * bs - 1] in self.ever_full:
                max_hit += 1
        live_set = self.live_contents()
        for pns, ptoks, _, blocks, lost in self.pins.values():  # pinned idle hits take no free block either
            pkeys = self.keys_for(pns, ptoks)
            live_set |= {pkeys[(j + 1) * bs - 1] for j, b in enumerate(blocks) if b not in lost}
        max_live = sum(1 for j in range(max_hit) if keys[(j + 1) * bs - 1] in live_set)
        must_ok = nb <= free
        must_fail = nb - max_live > free
        need_la = cdiv(n + la, bs)
        if not self.PREFIX:
            assert status is (AllocStatus.OK if free - nb >= self.wm else AllocStatus.LATER)
            exp_la = (
                AllocStatus.NEVER if need_la > self.G - self.wm
                else AllocStatus.OK if free - need_la >= self.wm else AllocStatus.LATER
            )
            assert status_la is exp_la
        else:
            assert (status_la is AllocStatus.NEVER) == (need_la > self.G - self.wm)
            if free - need_la >= self.wm:
                assert status_la is AllocStatus.OK
        if status is AllocStatus.OK or status_la is AllocStatus.OK:
            assert not must_fail
            must_ok = True
        if chunk is not None:  # the hit plus one chunk: need bounds over every possible hit h <= max_hit
            must_ok = cdiv(min(n, max_hit * bs + chunk), bs) <= free
            must_fail = cdiv(min(chunk, n - max_hit * bs), bs) > free
            status_c = bm.can_allocate(prompt, namespace=ns, num_new_tokens=chunk)
            assert status_c is not AllocStatus.NEVER
            if status_c is AllocStatus.OK:
                assert not must_fail
                must_ok = True
            if status is AllocStatus.OK:
                assert status_c is AllocStatus.OK  # a chunk never needs more than the whole prompt
            look = bm.lookup_prefix(prompt, namespace=ns, num_new_tokens=chunk)
        if must_fail:
            self.expect_failure(OutOfBlocksError, bm.allocate, sid, prompt, **kw)
            return
        self.drain_events()
        predicted = 0
        if self.PREFIX:  # what a router predicts from the events alone
            hashes = block_hashes(prompt, bs, ns)
            while predicted < (n - 1) // bs and (hashes[predicted] in self.index or
                                                 hashes[predicted] in self.cpu_index):
                predicted += 1
        free_before = bm.num_free_gpu_blocks
        try:
            hit = bm.allocate(sid, prompt, **kw)
        except OutOfBlocksError:
            assert not must_ok, "allocate raised OutOfBlocksError although the prompt fits"
            assert status is not AllocStatus.OK
            event("allocate: out of blocks")
            return
        event("allocate: prefix hit" if hit else "allocate: no hit")
        self.sync_tier()
        if self.W is None:
            assert hit == predicted * bs, f"the events' index predicted {predicted * bs}, allocate gave {hit}"
        else:  # a block whose parent the window released, then eviction dropped, can linger: a stale hint
            assert hit <= predicted * bs, f"allocate hit {hit} beyond the events' index ({predicted * bs})"

        assert isinstance(hit, int) and hit % bs == 0 and 0 <= hit <= max_hit * bs
        full_prompt = prompt
        if chunk is not None:  # the sequence holds the hit plus one chunk; the rest comes by decode_step
            assert look.num_cached_tokens == hit
            assert look.num_new_blocks == free_before - bm.num_free_gpu_blocks
            held = hit + min(chunk, n - hit)
            prompt, n = prompt[:held], held
            nb = cdiv(n, bs)
            keys = keys[:n]
            event("allocate: a chunk" if n < len(full_prompt) else "allocate: a chunk, the whole prompt")
        table = bm.block_table(sid).tolist()
        assert bm.num_tokens(sid) == n
        assert len(table) == nb
        blocks = []
        live_hits = 0
        parked = self.held_pins() - set(live_before)  # pinned idle blocks: a hit on one takes no free block
        for j, b in enumerate(table):
            if j < hit // bs and b in live_before:
                L = live_before[b]
                assert self.content(L, j) == keys[(j + 1) * bs - 1], "prefix hit on a block of other content"
                live_hits += 1
                blocks.append(L)
            else:
                assert b not in live_before, f"allocate handed out block {b}, which a live sequence holds"
                live_hits += j < hit // bs and b in parked
                blocks.append(LBlock(b, True))
        assert nb - live_hits <= free
        s = self.seqs[sid] = MSeq(ns, list(prompt), keys, blocks)
        s.pending = blocks[hit // bs : n // bs]
        if n < len(full_prompt):
            s.plen, s.rest = len(full_prompt), list(full_prompt[n:])
        if self.PREFIX:  # findability: every full block the call holds is found once it returns (issue 23 A)
            want = min(n // bs, (len(full_prompt) - 1) // bs) * bs
            got = bm.lookup_prefix(full_prompt, namespace=ns).num_cached_tokens
            assert got >= want, f"allocate({sid!r}) returned but lookup_prefix finds {got} of its {want} tokens"
            self.stats["qtok"] += len(full_prompt)  # (the whole prompt is looked up)
            self.stats["htok"] += hit
            self.stats["qblk"] += (len(full_prompt) - 1) // bs
            self.stats["hblk"] += hit // bs
        slots = bm.slot_mapping(sid, hit, n)
        assert slots.tolist() == [blocks[p // bs].phys * bs + p % bs for p in range(hit, n)]
        # positions < hit are already on the GPU: checked by the KV invariant after this step
        self.write(s, range(hit, n), slots.tolist())

    @rule(data=st.data(), cut=st.integers(1, 40), tail=st.lists(VOCAB, min_size=1, max_size=3))
    def allocate_again(self, data, cut, tail):
        """A prompt that repeats the start of a live or freed sequence (same namespace): prefix-cache hits."""
        sources = [(s.ns, s.tokens) for s in self.seqs.values() if len(s.tokens) > 1] + self.history[-6:]
        if not sources:
            return self.bootstrap(data)
        ns, tokens = data.draw(st.sampled_from(sources), label="source")
        self.allocate(prompt=tokens[: max(cut, self.bs)] + tail, share=0, base=1, ns=ns, dup=1, la=0)

    @rule(data=st.data())
    def decode_step(self, data):
        gpu_ids = [sid for sid, s in self.seqs.items() if not s.swapped]
        if not gpu_ids:
            return self.bootstrap(data)
        sids = data.draw(st.lists(st.sampled_from(gpu_ids), unique=True, max_size=len(gpu_ids)), label="batch")
        form = data.draw(st.sampled_from(["1d", "1d", "list", "2d", "ragged", "flat"]), label="form")
        la = data.draw(st.sampled_from([0, 0, 0, 1, 2, 5]), label="lookahead")
        b = len(sids)
        if form in ("1d", "list"):
            counts = [1] * b
        elif form == "2d":
            counts = [data.draw(st.integers(1, 3), label="k")] * b
        else:
            counts = data.draw(st.lists(st.integers(1, 3), min_size=b, max_size=b), label="counts")
        flat = data.draw(st.lists(VOCAB, min_size=sum(counts), max_size=sum(counts)), label="tokens")
        if form == "1d":
            toks = np.asarray(flat, dtype=data.draw(st.sampled_from([np.int64, np.int32]), label="dtype"))
        elif form == "list":
            toks = list(flat)
        elif form == "2d":
            toks = np.asarray(flat, dtype=np.int64).reshape(b, counts[0] if b else 1)
        elif form == "flat":  # flat tokens + num_new_tokens
            toks = np.asarray(flat, dtype=np.int64)
        else:
            toks, i = [], 0
            for k in counts:
                toks.append(flat[i : i + k])
                i += k
        if b == 0:
            res = self.bm.decode_step([], np.zeros(0, dtype=np.int64), la)
            assert res.slot_mapping.size == 0 and res.block_tables.shape[0] == 0
            return
        if form not in ("ragged", "flat"):
            can = self.bm.can_append_slots(sids, la, num_new_tokens=counts[0])
            assert can == self.plan(sids, counts, la)[0], "can_append_slots disagrees with the model"
        kw = {"num_new_tokens": np.asarray(counts)} if form == "flat" else {}

        def call():
            r = self.bm.decode_step(sids, toks, la, **kw)
            return r.slot_mapping, r.block_tables, r.seq_lens, r.cow

        call.__name__ = "decode_step"
        self.do_append(sids, counts, flat, la, call)

    @rule(data=st.data())
    def prefill_chunk(self, data):
        """Chunked prefill: the next chunk of partly prefilled prompts, appended by one decode_step (flat tokens
        and counts); identical prompts admitted in bursts find the blocks each chunk fills."""
        part = [sid for sid, s in self.seqs.items() if s.rest and not s.swapped]
        if not part:
            return self.bootstrap(data)
        sids = data.draw(st.lists(st.sampled_from(part), unique=True, min_size=1, max_size=len(part)), label="batch")
        counts = [min(len(self.seqs[sid].rest), data.draw(st.integers(1, 6), label="chunk")) for sid in sids]
        flat = [t for sid, c in zip(sids, counts) for t in self.seqs[sid].rest[:c]]
        toks = np.asarray(flat, dtype=np.int64)
        before = {sid: len(self.seqs[sid].tokens) for sid in sids}

        def call():
            r = self.bm.decode_step(sids, toks, 0, num_new_tokens=np.asarray(counts))
            return r.slot_mapping, r.block_tables, r.seq_lens, r.cow

        call.__name__ = "decode_step (prefill chunk)"
        bs = self.bs

        def found(sid):  # (a chunk's blocks are findable when the prefix before it still is: see kv_model)
            t, row = self.bm._t, self.bm._t.row_of[sid]
            if not self.bm._cache.live_parent(int(t.ccid[row]), int(t.ckey[row])):
                return False
            held = t.table[row, t.nrel[row] : t.nreg[row]]
            if (self.bm._cache.cid[held[held >= 0]] == 0).any():  # (a deduplicated copy: see kv_model._found)
                return False
            s = self.seqs[sid]
            full = s.tokens + s.rest
            want = min(len(s.tokens) // bs, (len(full) - 1) // bs) * bs
            return self.bm.lookup_prefix(full, namespace=s.ns).num_cached_tokens >= want

        intact = {sid: self.PREFIX and self.W is None and found(sid) for sid in sids}
        self.do_append(sids, counts, flat, 0, call)
        bs = self.bs
        for sid, c in zip(sids, counts):
            s = self.seqs[sid]
            if len(s.tokens) > before[sid]:
                full = s.tokens + s.rest[c:]
                del s.rest[:c]
                event("prefill chunk: the last" if not s.rest else "prefill chunk")
                if intact[sid]:  # findability: the blocks the chunk filled are found once it returns
                    want = min(len(s.tokens) // bs, (len(full) - 1) // bs) * bs
                    got = self.bm.lookup_prefix(full, namespace=s.ns).num_cached_tokens
                    assert got >= want, f"a chunk of {sid!r} returned but lookup_prefix finds {got} of {want} tokens"

    @rule(data=st.data(), toks=st.lists(VOCAB, min_size=1, max_size=5), la=st.sampled_from([0, 0, 1, 3]))
    def append_slots(self, data, toks, la):
        gpu_ids = [sid for sid, s in self.seqs.items() if not s.swapped]
        if not gpu_ids:
            return self.bootstrap(data)
        sid = data.draw(st.sampled_from(gpu_ids), label="seq")
        can = self.bm.can_append_slots([sid], la, num_new_tokens=len(toks))
        assert can == self.plan([sid], [len(toks)], la)[0]

        def call():
            before = self.bm.stats.cow_copies
            cow = self.bm.append_slots(sid, toks, la)
            assert isinstance(cow, list) and all(isinstance(x, int) for p in cow for x in p)
            assert self.bm.stats.cow_copies == before + len(cow)
            n = len(self.seqs[sid].tokens)
            slots = self.bm.slot_mapping(sid, n, n + len(toks))
            return slots, None, None, np.asarray(cow, dtype=np.int64).reshape(-1, 2)

        call.__name__ = "append_slots"
        self.do_append([sid], [len(toks)], list(toks), la, call)

    @rule(data=st.data(), dup=st.integers(0, 10))
    def fork(self, data, dup):
        if not self.seqs:
            return self.bootstrap(data)
        parent = data.draw(st.sampled_from(list(self.seqs)), label="parent")
        child = self.new_id(reuse=dup == 0)
        if child in self.seqs:
            self.expect_failure(DuplicateSequenceError, self.bm.fork, parent, child)
            return
        if len(self.seqs[parent].tokens) < self.seqs[parent].plen:  # partly prefilled: refused
            event("fork: refused, partly prefilled")
            self.expect_failure(SequenceStateError, self.bm.fork, parent, child)
            return
        self.bm.fork(parent, child)
        self.seqs[parent].pending = []  # fork confirms the parent's KV
        self.seqs[child] = self.seqs[parent].clone()
        assert self.bm.block_table(child).tolist() == self.bm.block_table(parent).tolist()

    @rule()
    def fork_unknown(self):
        self.expect_failure(UnknownSequenceError, self.bm.fork, self.unknown_id(), self.next_id + 5000)

    @rule(data=st.data(), cache=st.booleans())
    def free(self, data, cache):
        if not self.seqs:
            return self.bootstrap(data)
        sid = data.draw(st.sampled_from(list(self.seqs)), label="seq")
        s = self.seqs[sid]
        if not cache and self.PREFIX and not s.swapped:
            others = [o for o in self.seqs.values() if o is not s and not o.swapped]
            if any(L is M for L in s.pending for o in others for M in o.blocks):
                event("free(cache=False): refused, a dependent holds its unwritten blocks")
                self.expect_failure(SequenceStateError, self.bm.free, sid, cache=False)
                return
        self.bm.free(sid, cache=cache)
        if not cache and self.pins:  # withdrawn content is no longer held by its pin (it still counts in the budget)
            mapping = self.bm._cache.mapping()
            for ns, toks, n, blocks, lost in self.pins.values():
                for b, k in zip(blocks, block_hashes(toks, self.bs, ns)):
                    if mapping.get(k) != b:
                        lost.add(b)
        self.history.append((self.seqs[sid].ns, list(self.seqs[sid].tokens)))
        if cache:
            self.written.append(self.history[-1])
        del self.seqs[sid]
        assert sid not in self.bm
        self.expect_failure(UnknownSequenceError, self.bm.free, sid)  # double free

    @rule(data=st.data())
    def swap_out(self, data):
        gpu_ids = [sid for sid, s in self.seqs.items() if not s.swapped]
        if not gpu_ids:
            return self.bootstrap(data)
        sids = data.draw(st.lists(st.sampled_from(gpu_ids), unique=True, min_size=1, max_size=len(gpu_ids)))
        uniq: dict[int, LBlock] = {}
        for sid in sids:
            for L in self.seqs[sid].blocks:
                if L is not None:
                    uniq.setdefault(id(L), L)
        fits = len(uniq) <= self.free_cpu()
        assert self.bm.can_swap_out(sids) == fits
        event(f"swap_out: {'ok' if fits else 'out of CPU blocks'}")
        if not fits:
            self.expect_failure(OutOfBlocksError, self.bm.swap_out, sids)
            return
        pairs = self.bm.swap_out(sids)
        self.sync_tier()
        assert len(pairs) == len(uniq)
        g2c = dict(pairs)
        assert len(g2c) == len(pairs) and len(set(g2c.values())) == len(pairs)
        assert set(g2c) == {L.phys for L in uniq.values()}
        for g, c in pairs:
            self.copy_block(self.kv_gpu, g, self.kv_cpu, c)
        moved = {i: LBlock(g2c[L.phys], False) for i, L in uniq.items()}
        for sid in sids:
            s = self.seqs[sid]
            s.blocks = [None if L is None else moved[id(L)] for L in s.blocks]
            s.swapped = True
            s.pending = []
        self.stats["out"] += len(uniq)

    @rule(data=st.data(), la=st.sampled_from([0, 0, 1, 4]))
    def swap_in(self, data, la):
        cpu_ids = [sid for sid, s in self.seqs.items() if s.swapped]
        if not cpu_ids:
            return
        sids = data.draw(st.lists(st.sampled_from(cpu_ids), unique=True, min_size=1, max_size=len(cpu_ids)))
        bs = self.bs
        uniq: dict[int, tuple[LBlock, int]] = {}
        for sid in sids:
            for j, L in enumerate(self.seqs[sid].blocks):
                if L is not None:
                    uniq.setdefault(id(L), (L, j))
        u = len(uniq)
        extra = sum(max(cdiv(len(self.seqs[s].tokens) + la, bs) - len(self.seqs[s].blocks), 0) for s in sids)
        free = self.free_gpu()
        live_before = self.live(True)
        live_set = self.live_contents() if self.PREFIX else set()
        contents = [self.content(L, j) if self.PREFIX else None for L, j in uniq.values()]
        max_live = sum(1 for c in contents if c is not None and c in live_set)
        # fewest GPU blocks it can take: full blocks of equal content (swapped out separately, so on two CPU
        # blocks) may come back to one cached GPU block; those still cached for a live sequence cost nothing
        min_need = sum(1 for c in contents if c is None) + len({c for c in contents if c is not None} - live_set)
        status = self.bm.can_swap_in(sids, la)
        need_max = u + extra
        assert (status is AllocStatus.NEVER) == (need_max > self.G - self.wm)
        if free - need_max >= self.wm:
            assert status is AllocStatus.OK
        if free - (need_max - max_live) < self.wm:
            assert status is not AllocStatus.OK
        must_ok = u <= free or status is AllocStatus.OK
        if min_need > free:
            assert not must_ok
            self.expect_failure(OutOfBlocksError, self.bm.swap_in, sids)
            return
        try:
            pairs = self.bm.swap_in(sids)
        except OutOfBlocksError:
            assert not must_ok, "swap_in raised OutOfBlocksError although the blocks fit"
            event("swap_in: out of blocks")
            return
        self.sync_tier()
        c2g = dict(pairs)
        assert len(c2g) == len(pairs) and len(set(c2g.values())) == len(pairs)
        if not self.PREFIX:
            assert len(pairs) == u
        for c, g in pairs:
            self.copy_block(self.kv_cpu, c, self.kv_gpu, g)
        # where did each CPU block go?
        dest: dict[int, int] = {}
        for sid in sids:
            table = self.bm.block_table(sid).tolist()
            s = self.seqs[sid]
            assert len(table) == len(s.blocks)
            for L, b in zip(s.blocks, table):
                if L is None:
                    assert b == NULL_BLOCK
                else:
                    assert dest.setdefault(id(L), b) == b, "one CPU block came back as two GPU blocks"
        new: dict[int, LBlock] = {}
        from_cache: dict[int, tuple] = {}  # GPU id -> (logical block, (position, content)) taken from the evictor
        for i, (L, j) in uniq.items():
            g = dest[i]
            if L.phys in c2g:
                assert c2g[L.phys] == g
                assert g not in live_before, f"swap_in copied into block {g}, which a live sequence holds"
                new[i] = LBlock(g, True)
            else:  # reused a GPU block still caching the same content
                key = self.content(L, j)
                assert key is not None, "swap_in reused a GPU block for a partial block"
                if g in live_before:
                    assert self.content(live_before[g], j) == key
                    new[i] = live_before[g]
                    event("swap_in: reused a live cached block")
                else:
                    if g in from_cache:  # two CPU blocks of equal content came back to one cached block
                        assert from_cache[g][1] == (j, key), "two CPU blocks of other content share a GPU block"
                        event("swap_in: two CPU blocks came back to one cached block")
                    else:
                        from_cache[g] = (LBlock(g, True), (j, key))
                    new[i] = from_cache[g][0]
                    event("swap_in: reused an evictable cached block")
        assert len(pairs) + len(from_cache) <= free
        for sid in sids:
            s = self.seqs[sid]
            s.blocks = [None if L is None else new[id(L)] for L in s.blocks]
            s.swapped = False
        self.stats["in"] += u

    @rule(data=st.data(), priority=st.integers(-2, 2), session=st.sampled_from([None, 0, 1, "chat"]))
    def set_retention(self, data, priority, session):
        if not self.RETAIN or not self.seqs:
            return
        sid = data.draw(st.sampled_from(list(self.seqs)), label="seq")
        self.bm.retention.set_retention(sid, priority=priority, session=session)

    @rule(data=st.data(), cut=st.integers(1, 40))
    def pin_prefix(self, data, cut):
        if not self.RETAIN or not self.written:
            return
        ns, toks = data.draw(st.sampled_from(self.written), label="written")
        toks = toks[:cut]
        before = (self.bm.retention.num_pinned_blocks, self.bm.retention.pins)
        mapping = self.bm._cache.mapping()
        keys = block_hashes(toks, self.bs, ns)
        cached = []
        for k in keys:  # the GPU prefix of its full blocks (a pin holds those)
            if k not in mapping:
                break
            cached.append(mapping[k])
        pinned = {b for *_, blocks, _ in self.pins.values() for b in blocks}
        new = len(set(cached) - pinned)
        if not self.bm.config.pin_budget_blocks:
            self.expect_failure(InvalidArgumentError, self.bm.retention.pin_prefix, toks, namespace=ns)
            return
        if cached and len(pinned) + new > self.bm.config.pin_budget_blocks:
            event("pin_prefix: past the budget, refused")
            self.expect_failure(PinBudgetError, self.bm.retention.pin_prefix, toks, namespace=ns)
            assert (self.bm.retention.num_pinned_blocks, self.bm.retention.pins) == before
            return
        pin = self.bm.retention.pin_prefix(toks, namespace=ns)
        assert pin.num_blocks == len(cached) and pin.num_tokens == len(cached) * self.bs
        if cached:
            event("pin_prefix: pinned")
            self.pins[pin.pin_id] = (ns, toks, pin.num_tokens, cached, set())
        assert self.bm.retention.num_pinned_blocks == len(pinned | set(cached))

    @rule(data=st.data())
    def unpin(self, data):
        if not self.RETAIN:
            return
        if not self.pins:
            if self.bm.config.pin_budget_blocks:
                self.expect_failure(UnknownPinError, self.bm.retention.unpin, 12345)
            return
        pid = data.draw(st.sampled_from(list(self.pins)), label="pin")
        self.bm.retention.unpin(pid)
        del self.pins[pid]
        self.expect_failure(UnknownPinError, self.bm.retention.unpin, pid)

    @rule()
    def reset_prefix_cache(self):
        self.pins.clear()  # the cached content is gone, and the pins with it
        n = self.bm.reset_prefix_cache()
        assert isinstance(n, int) and 0 <= n <= self.G
        if not self.PREFIX:
            assert n == 0

    @rule(data=st.data())
    def slot_mapping(self, data):
        if not self.seqs:
            return self.bootstrap(data)
        sid = data.draw(st.sampled_from(list(self.seqs)), label="seq")
        s = self.seqs[sid]
        bs = self.bs
        cap = len(s.blocks) * bs
        start = data.draw(st.integers(0, cap + 1), label="start")
        end = data.draw(st.integers(start, cap + 2), label="end")
        if end > cap:
            self.expect_failure(InvalidArgumentError, self.bm.slot_mapping, sid, start, end)
        elif s.swapped or any(s.blocks[p // bs] is None for p in range(start, end)):
            self.expect_failure(SequenceStateError, self.bm.slot_mapping, sid, start, end)
        else:
            got = self.bm.slot_mapping(sid, start, end)
            assert got.dtype == np.int64
            assert got.tolist() == [s.blocks[p // bs].phys * bs + p % bs for p in range(start, end)]

    @rule(data=st.data())
    def bad_batches(self, data):
        """Appending to a swapped-out sequence or an unknown one changes nothing."""
        swapped = [sid for sid, s in self.seqs.items() if s.swapped]
        if swapped:
            sid = data.draw(st.sampled_from(swapped))
            self.expect_failure(SequenceStateError, self.bm.decode_step, [sid], np.array([1]))
            self.expect_failure(SequenceStateError, self.bm.append_slots, sid, [1])
            self.expect_failure(SequenceStateError, self.bm.swap_out, [sid])
        gpu = [sid for sid, s in self.seqs.items() if not s.swapped]
        if gpu:
            sid = data.draw(st.sampled_from(gpu))
            self.expect_failure(SequenceStateError, self.bm.swap_in, [sid])
        self.expect_failure(UnknownSequenceError, self.bm.decode_step, [self.unknown_id()], np.array([1]))

    # ------------------------------------------------------------------ checks after every step
    def sync_tier(self) -> None:
        """The engine's part of a step with the CPU tier: its demotions (GPU -> CPU), then its promotions
        (CPU -> GPU), before anything else of the step is copied or written."""
        dem, pro = self.bm.take_copies()
        if not self.bm.config.cpu_prefix_cache:
            assert dem.size == 0 and pro.size == 0
            return
        if dem.size or pro.size:
            event("CPU tier: " + ("demotions " if dem.size else "") + ("promotions" if pro.size else ""))
        for g, c in dem.tolist():
            self.copy_block(self.kv_gpu, g, self.kv_cpu, c)
        for c, g in pro.tolist():
            self.copy_block(self.kv_cpu, c, self.kv_gpu, g)

    def drain_events(self) -> None:
        """Apply the manager's KV events to the router's index, as a KV-aware router would."""
        for e in self.bm.events.take():
            if isinstance(e, BlockStored):
                assert e.block_size == self.bs and len(e.token_ids) == self.bs * len(e.block_hashes)
                (self.index if e.medium == "GPU" else self.cpu_index).update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                idx = self.index if e.medium == "GPU" else self.cpu_index
                assert set(e.block_hashes) <= idx, "removed a block the index never stored"
                idx.difference_update(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                self.index.clear()
                self.cpu_index.clear()

    @invariant()
    def pins_hold(self):
        """A pinned prefix is never evicted: each pin's blocks still hold its keys (checked through the map)."""
        if not self.pins:
            return
        mapping = self.bm._cache.mapping()
        for ns, toks, n, blocks, lost in self.pins.values():
            keys = block_hashes(toks, self.bs, ns)[: len(blocks)]
            got = [mapping.get(k) for k in keys]
            assert all(g == b for g, b in zip(got, blocks) if b not in lost), "a pinned block was evicted"
            if not lost:
                assert self.bm.lookup_prefix(list(toks) + [0], namespace=ns).num_cached_tokens >= n

    @invariant()
    def consistent(self):
        bm, bs = self.bm, self.bs
        bm.check_invariants()
        if self.PREFIX:
            self.drain_events()
            assert self.index == set(bm._cache.mapping()), "the events' index differs from the cache's keys"
            assert self.cpu_index == (set(bm._tier.map) if bm.config.cpu_prefix_cache else set())
        assert len(bm) == len(self.seqs)
        assert bm.seq_ids == tuple(self.seqs)  # allocation order
        for sid, s in self.seqs.items():
            assert sid in bm
            assert bm.num_tokens(sid) == len(s.tokens)
            assert bm.is_swapped(sid) == s.swapped
            table = bm.block_table(sid).tolist()
            assert table == [NULL_BLOCK if L is None else L.phys for L in s.blocks], f"table of {sid!r}"
            assert len(table) >= cdiv(len(s.tokens), bs)
            if self.W is not None:  # released exactly what no future query can see, and never more
                assert s.nrel * bs <= max(len(s.tokens) - self.W, 0)
            assert all(L is None for L in s.blocks[: s.nrel]) and all(L is not None for L in s.blocks[s.nrel :])
            for L in s.blocks:
                assert L is None or L.gpu == (not s.swapped)
        assert bm.num_free_gpu_blocks == self.free_gpu()
        assert bm.stats.num_free_cpu_blocks == self.free_cpu()
        assert bm.stats.gpu_usage == pytest.approx(1 - self.free_gpu() / self.G)
        st_ = bm.stats
        assert st_.cow_copies == self.stats["cow"]
        assert st_.swapped_out_blocks == self.stats["out"]
        assert st_.swapped_in_blocks == self.stats["in"]
        assert (st_.prefix_query_tokens, st_.prefix_hit_tokens) == (self.stats["qtok"], self.stats["htok"])
        assert (st_.prefix_query_blocks, st_.prefix_hit_blocks) == (self.stats["qblk"], self.stats["hblk"])
        # physical consistency: every visible position reads back its own prefix identity
        for sid, s in self.seqs.items():
            store = self.kv_cpu if s.swapped else self.kv_gpu
            for p in range(len(s.tokens)):
                L = s.blocks[p // bs]
                if L is not None:
                    got = store.get(L.phys * bs + p % bs, MISSING)
                    assert got == s.keys[p], (
                        f"{sid!r} position {p}: slot {L.phys * bs + p % bs} holds {got!r}, not its own KV "
                        f"({s.keys[p]!r}); {'swapped' if s.swapped else 'on GPU'}"
                    )


def _machine(prefix: bool, window: bool, max_events: int = 100_000, small: bool = True, tier: bool = False,
             retain: bool = False):
    name = (f"Machine_{'cache' if prefix else 'nocache'}_{'window' if window else 'full'}_{max_events}_{small}_{tier}"
            f"_{retain}")
    cls = type(name, (PagedKVMachine,), {"PREFIX": prefix, "WINDOW": window, "MAX_EVENTS": max_events,
                                         "SMALL_PATH": small, "TIER": tier, "RETAIN": retain})
    cls.TestCase.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    return cls


_MACHINES = {  # name: _machine's arguments
    "NoCacheFull": dict(prefix=False, window=False),
    "NoCacheWindow": dict(prefix=False, window=True),
    "CacheFull": dict(prefix=True, window=False),
    "CacheWindow": dict(prefix=True, window=True),
    "CacheEventOverflow": dict(prefix=True, window=False, max_events=3),  # overflows often: resyncs keep the index exact
    # the CPU tier of the prefix cache, with swap, forks, windows and event overflows
    "CpuTierFull": dict(prefix=True, window=False, tier=True),
    "CpuTierWindow": dict(prefix=True, window=True, tier=True),
    "CpuTierOverflow": dict(prefix=True, window=False, max_events=3, tier=True),
    # every eviction policy, request priorities, session hints and pinned prefixes (pagedkv.retention.eviction,
    # pagedkv.retention.steering)
    "RetentionFull": dict(prefix=True, window=False, retain=True),
    "RetentionWindow": dict(prefix=True, window=True, retain=True),
    "RetentionCpuTier": dict(prefix=True, window=False, tier=True, retain=True),
}
# Every machine runs with the append's one fast path (the plain-Python small-batch step, manager/_small.py) on, and
# each one without a window again with it off (Test...Vectorised: _small_batch = 0, the vectorised plan and commit
# only); with a window the small step is never taken, so the switch changes nothing there.
for _name, _kw in _MACHINES.items():
    globals()[f"Test{_name}"] = _machine(**_kw).TestCase
    if not _kw["window"]:
        globals()[f"Test{_name}Vectorised"] = _machine(**_kw, small=False).TestCase


def test_the_fast_path_switch_reaches_the_machines():
    """A machine built with ``small=False`` takes no plain-Python step: its manager's small-batch bound is 0; the
    others keep SMALL_BATCH."""
    from pagedkv.manager._small import SMALL_BATCH

    for small, want in ((True, SMALL_BATCH), (False, 0)):
        m = _machine(True, False, small=small)()
        m.setup(bs=2, gpu=8, cpu=0, window=1, watermark=0.0)
        assert m.bm._small_batch == want
        m.teardown()


# ---------------------------------------------------------------------- regressions found by the machine above
def test_regression_two_writers_of_a_block_with_three_holders():
    bm = BlockManager(20, 4, watermark=0)
    bm.allocate("a", [1, 2, 3])
    bm.fork("a", "b")
    bm.fork("a", "c")
    res = bm.decode_step(["a", "b"], np.array([5, 6]))  # both copy; "c" keeps the original
    assert len(res.cow) == 2 and len(set(res.cow[:, 0].tolist())) == 1
    bm.check_invariants()
    assert bm.num_free_gpu_blocks == 17


def test_regression_two_cpu_blocks_return_to_one_cached_block():
    bm = BlockManager(20, 2, num_cpu_blocks=20, enable_prefix_caching=True, watermark=0)
    bm.allocate("A", [1, 2, 3])
    bm.append_slots("A", [4])
    bm.append_slots("A", [5])
    assert bm.allocate("B", [1, 2, 7]) == 2  # shares A's first block
    bm.swap_out(["A"])  # the first block is copied, B keeps it on the GPU
    bm.swap_out(["B"])  # now the GPU block waits in the evictor, cached; two CPU blocks hold its content
    bm.check_invariants()
    free = bm.num_free_gpu_blocks
    bm.swap_in(["A", "B"])  # both come back to the one cached block, which leaves the evictor once
    bm.check_invariants()
    assert bm.block_table("A")[0] == bm.block_table("B")[0]
    assert bm.num_free_gpu_blocks == free - 4  # shared block + A's two others + B's other


def test_regression_forks_released_by_the_window_in_the_same_step():
    bm = BlockManager(3, 1, sliding_window=1, watermark=0)
    bm.allocate(1, [0])
    bm.allocate(2, [0])
    bm.fork(1, 3)
    assert bm.can_append_slots([1, 2, 3])  # the block 1 and 3 both release frees a block for the step
    bm.decode_step([1, 2, 3], np.array([0, 0, 0]))
    bm.check_invariants()


def test_regression_one_row_grows_two_blocks_another_none():
    bm = BlockManager(8, 2, watermark=0)
    bm.allocate("a", [0, 0])
    bm.allocate("b", [0])
    bm.append_slots("b", [1], num_lookahead_slots=3)  # b's table already has 3 blocks
    res = bm.decode_step(["a", "b"], np.array([0, 0]), num_lookahead_slots=2)  # a needs 2 new blocks, b none
    bm.check_invariants()
    assert [len(bm.block_table(s)) for s in "ab"] == [3, 3]
    assert res.block_tables.shape == (2, 3)


def test_regression_free_without_cache_spares_a_sequence_that_deduplicated_against_its_block():
    # the machine's minimal sequence (TestCacheEventOverflow seed 254211839138671293063525750353203220472,
    # TestCpuTierWindow seed 195989952258087655753789136826040958894)
    bm = BlockManager(6, 1, enable_prefix_caching=True, watermark=0, enable_kv_events=True)
    bm.allocate(1, [0])
    bm.allocate(2, [0])
    bm.allocate(3, [0])
    assert bm.allocate(4, [0, 0]) == 1  # block 1 of 4 ([0, 0]) is cached by this call, its KV not yet written
    bm.append_slots(1, [0, 0])  # 1 writes [0, 0] itself: registration chains its next block after 4's content
    t1, t4 = bm.block_table(1).tolist(), bm.block_table(4).tolist()
    assert t4[1] not in t1  # 1 holds none of 4's unwritten blocks: it does not depend on them
    bm.events.take()
    bm.free(4, cache=False)  # used to raise SequenceStateError naming 1
    removed = [h for e in bm.events.take() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    hashes = block_hashes([0, 0, 0], 1)
    assert sorted(removed) == sorted(hashes[1:])  # 4's block and 1's block chained after it are withdrawn
    assert bm.block_table(1).tolist() == t1  # 1 keeps its blocks (uncached)
    bm.check_invariants()
    assert bm.lookup_prefix([0, 0, 0, 0]).num_cached_tokens == 1  # nothing beyond the withdrawn content
    bm.append_slots(1, [0])  # 1's chain is broken: its new full block is not cached (it could not be reached)
    assert bm.events.take() == []
    bm.check_invariants()


def test_regression_free_without_cache_still_refuses_a_prefix_hit_dependent():
    bm = BlockManager(6, 1, enable_prefix_caching=True, watermark=0)
    bm.allocate(1, [0])
    bm.allocate(4, [0, 0])
    assert bm.allocate(5, [0, 0, 1]) == 2  # 5 holds 4's unwritten block
    before = snapshot(bm)
    with pytest.raises(SequenceStateError, match=r"\[5\]"):
        bm.free(4, cache=False)
    assert_unchanged(bm, before, "free(cache=False) with a prefix-hit dependent")
