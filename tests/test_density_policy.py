"""The ``density`` eviction policy (pagedkv.retention.density): the evictor against a plain reference model, the
online hit-density estimate against a brute-force computation, LRU's exact order without hints, and a golden run
through the manager where what it learnt keeps returning conversations that LRU loses."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import BlockManager
from pagedkv.blocks.evictor import LRUEvictor
from pagedkv.retention.density import ANONYMOUS, SHARED, DensityEvictor, HitDensity
from pagedkv.retention.eviction import make_evictor

import evictor_drive


class RefDensity:
    """Releases ``[class, clock, first serial, [(block, serial)...]]`` in creation order; live ones ordered by the
    evictor's own density estimate (tested apart below), then creation; within a release push order. A push joins
    the newest release when it is alive and has the same class and clock."""

    def __init__(self, ev: DensityEvictor):
        self.ev, self.rels, self.hinted, self.serial, self.cur = ev, [], {}, 0, {}
        self.own, self.shared, self.born = {}, {}, {}  # per block: last hinting session, its shared hits, first hint
        self.pend = set()

    def hint(self, blocks, session):  # after ev.hint: read the class and clock it gave
        for b in blocks:
            self.hinted[b] = (self.ev.est.sessions[session][3], self.ev.est.clock)
            if b in self.pend:  # hinted, never pushed since: new content
                self.own.pop(b, None), self.shared.pop(b, None), self.born.pop(b, None)
            self.pend.add(b)
            if b in self.own and self.own[b] != session:
                self.shared[b] = self.shared.get(b, 0) + 1
            if b not in self.own:
                self.born[b] = self.ev.est.clock
            self.own[b] = session

    def _live(self, rel):
        return [b for b, c in rel[3] if self.cur.get(b) == c]

    def push_many(self, blocks):
        now = self.ev.est.clock
        entries = []
        for b in blocks:
            self.serial += 1
            k, t = self.hinted.pop(b, (ANONYMOUS, -1))
            self.pend.discard(b)
            k = SHARED if self.shared.get(b) else (k if t == now else ANONYMOUS)
            entries.append((b, self.serial, k))
            self.cur[b] = self.serial
        for k in dict.fromkeys(e[2] for e in entries):
            group = [(b, c) for b, c, kk in entries if kk == k]
            last = self.rels[-1] if self.rels else None
            if last is not None and self._live(last) and (last[0], last[1]) == (k, now) and k != SHARED:
                last[3] += group
            else:
                rate = None
                if k == SHARED:
                    rate = (min(self.shared[b] for b, _ in group), max(self.born[b] for b, _ in group))
                self.rels.append([k, now, group[0][1], group, rate])

    def discard(self, b):
        del self.cur[b]

    def order(self):
        live = [r for r in self.rels if self._live(r)]
        est = self.ev.est
        d = [r[4][0] / (est.clock - r[4][1] + 1.0) if r[0] == SHARED
             else float(est.density(np.array([r[0]]), np.array([r[1]]))[0]) for r in live]
        idx = sorted(range(len(live)), key=lambda i: (d[i], live[i][2]))
        return [b for i in idx for b in self._live(live[i])]

    def pop(self):
        b = self.order()[0]
        del self.cur[b]
        for m in (self.own, self.shared, self.born):  # evicted: its content, and what was known of it, leaves
            m.pop(b, None)
        return b


def _density_hint(x, absent, inside):
    """A hint for up to 3 blocks not in the evictor (or one in it), one of 4 sessions."""
    return (absent[: 1 + x % 3] or [inside[x % len(inside)]], x % 4)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 24), operations=evictor_drive.ops(evictor_drive.KINDS + ("hint",), max_size=250))
def test_density_matches_its_reference(n, operations):
    # a table refreshed at every hint, over bins of one tick: the order changes all the time
    ev = DensityEvictor(n, bin_width=1, bins=6, every=1, prior=1.0)
    evictor_drive.drive(ev, RefDensity(ev), n, operations, _density_hint)


@settings(max_examples=100, deadline=None)
@given(operations=evictor_drive.ops(("push", "push_many", "discard", "pop", "pop_many"), max_size=200))
def test_density_without_hints_is_lru(operations):
    n = 16
    evictor_drive.drive(DensityEvictor(n), evictor_drive.LRUReference(LRUEvictor(n)), n, operations)


def _brute_table(releases, clock, B, T, prior, K=ANONYMOUS):
    """The densities from first principles: releases (class, clock, gap or None), loops only."""
    risk = [[0.0] * (T + 1) for _ in range(K)]
    ev = [[0.0] * (T + 1) for _ in range(K)]
    for k, t, g in releases:
        age = min((clock - t) // B, T)
        for b in range(age + 1):
            if g is None or b <= g // B:
                risk[k][b] += 1
        if g is not None and g // B <= T:
            ev[k][g // B] += 1
    pooled = [sum(ev[k][b] for k in range(K)) / max(sum(risk[k][b] for k in range(K)), 1) for b in range(T + 1)]
    table = np.zeros((K + 1, T + 1))
    for k in range(K):
        S = [1.0]
        for b in range(T + 1):
            h = min(max((ev[k][b] + prior * pooled[b]) / (risk[k][b] + prior), 0.0), 1.0)
            S.append(S[-1] * (1 - h))
        for a in range(T + 1):
            best = 0.0
            for H in range(a + 1, T + 2):
                den = sum(S[a:H]) * B
                if den > 0:
                    best = max(best, (S[a] - S[H]) / den)
            table[k, a] = best
    return table


@settings(max_examples=25, deadline=None)
@given(seq=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40)), min_size=1, max_size=60),
       B=st.integers(1, 3), prior=st.sampled_from([0.5, 2.0, 20.0]))
def test_hit_density_matches_brute_force(seq, B, prior):
    T = 5
    est = HitDensity(bin_width=B, bins=T, every=10**9, prior=prior)
    last: dict = {}
    releases = []  # [class, clock, gap]
    for session, nblocks in seq:
        k, c = est.tick(session, nblocks)
        if session in last:
            releases[last[session]][2] = c - releases[last[session]][1]
            turn = est.sessions[session][0]
            assert turn >= 2
        last[session] = len(releases)
        releases.append([k, c, None])
    est.refresh()
    assert np.allclose(est.table, _brute_table(releases, est.clock, B, T, prior))
    assert est.table[ANONYMOUS].max() == 0


def test_hit_density_class_and_window():
    assert HitDensity.klass(1, 0) == 0 and HitDensity.klass(1, 1) == 1 and HitDensity.klass(1, 5) == 3
    assert HitDensity.klass(2, -3) == 16 and HitDensity.klass(9, 10**9) == 3 * 16 + 15
    est = HitDensity(bin_width=1, bins=4, every=10**9, window=10)
    for i in range(30):
        est.tick(i % 3, 2)
    est.refresh()
    assert len(est._rel_t) == 10 and min(est._rel_t) > est.clock - 10  # older releases forgotten
    assert all(t > est.clock - 10 for _, t, _ in est._ret)


def _chats(policy, rounds=400, pool=6):
    """Four chats returning every 8 releases (one block each, the same prompt every turn) between one-off prompts;
    a pool of 6 blocks. Returns the chat turns' hit tokens over the last 100 releases."""
    bm = BlockManager(pool, 2, enable_prefix_caching=True, eviction_policy=policy, watermark=0)
    hits = 0
    for i in range(rounds):
        if i % 2:
            c = (i // 2) % 4
            sid, prompt, session = f"c{i}", [1000 * (c + 1), 1000 * (c + 1) + 1, 7], f"chat{c}"
        else:
            sid, prompt, session = f"o{i}", [5 * i + 100_000, 5 * i + 100_001, 9], f"one-off{i}"
        got = bm.allocate(sid, prompt)
        if i % 2 and i >= rounds - 100:
            hits += got
        bm.retention.set_retention(sid, session=session)
        bm.free(sid)
        if i % 50 == 0:
            bm.check_invariants()
    bm.check_invariants()
    return hits


def test_density_learns_to_keep_returning_conversations():
    """LRU keeps the last 6 releases, and a chat's block is 8 releases old when it comes back: no hit. ``density``
    learns (at its first refresh, 256 releases in) that a chat's fourth-or-later turn comes back within 8 releases
    while one-offs never do, and keeps the four chats: every chat turn of the last 100 releases hits. (Golden
    figures.)"""
    assert _chats("lru") == 0
    assert _chats("density") == 50 * 2  # 50 chat turns, one block of 2 tokens each
    assert _chats("density", rounds=250) == 0  # before the first refresh: nothing learnt, LRU's order


def test_make_evictor_density():
    ev = make_evictor("density", 5)
    assert isinstance(ev, DensityEvictor) and len(ev) == 0 and ev.pop_many(0).size == 0
    assert not math.isnan(ev.est.table.sum())


@pytest.mark.parametrize("fast_learning", [False, True])
def test_kv_content_model_with_density(monkeypatch, fast_learning):
    """The KV-content model (tests/kv_model.py: several calls a step, the copy plan, every live sequence's KV read
    back) with the density policy forced, with the default estimate and with one refreshed at every hint over
    bins of one release (so the learnt order, not LRU's, decides evictions)."""
    import dataclasses
    import random

    import kv_model
    from pagedkv.retention import density

    if fast_learning:
        monkeypatch.setattr(density.HitDensity.__init__, "__defaults__", (1, 8, 1, 1.0, 1 << 15, 1 << 16))
    runs = 0
    for seed in range(12):
        cfg = kv_model.Config.draw(random.Random(seed))
        if not cfg.prefix:
            continue
        cfg = dataclasses.replace(cfg, policy="density")
        r = kv_model.run(seed, 200, cfg=cfg)
        assert r.violations == 0, f"seed {seed}: {r.messages[:3]}"
        runs += 1
    assert runs >= 6


def test_integer_sessions_2k_and_2k_plus_1_stay_apart():
    """Regression (found by test_density_matches_its_reference): the session's hash was kept as ``hash | 1``, so
    integer sessions 2 and 3 were one session and a block hinted by both was not counted as shared."""
    ev = DensityEvictor(4, bin_width=1, bins=6, every=1, prior=1.0)
    ev.hint(np.array([0]), 2)
    ev.push(0)
    ev.discard(0)
    ev.hint(np.array([0]), 3)  # a second session takes the block back: shared
    assert ev.shd[0] == 1
    ev.hint(np.array([1]), 0)  # session 0 (hash 0) is a session too
    ev.push(1)
    ev.discard(1)
    ev.hint(np.array([1]), 1)
    assert ev.shd[1] == 1
