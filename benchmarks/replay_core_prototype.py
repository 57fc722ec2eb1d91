"""Measurement-only prototype, not part of pagedkv: what batched core operations would do to a replay point.

Written against manager.py / prefix_cache.py as of commit 6f6b1a4 (it overrides private methods, so it will need
updating once the core changes); nothing imports it.

A subclass of BlockManager whose free() registers the row's new full blocks with one register_chains() call,
whose evictor is a FIFO ring with lazy deletion (push/pop of n blocks = a few numpy calls), and whose _take evicts
n blocks at once. Same LRU order (release order; hits leave the list) as LRUEvictor.
"""
import sys, time, json
import numpy as np
from pagedkv import BlockManager


class RingEvictor:
    def __init__(self, num_blocks):
        self.n = num_blocks
        self.ring = np.zeros(2 * num_blocks + 16, dtype=np.int64)
        self.pos = np.full(num_blocks, -1, dtype=np.int64)
        self.head = self.tail = 0
        self._len = 0

    def __len__(self):
        return self._len

    def _compact(self):
        seg = self.ring[self.head:self.tail]
        live = seg[self.pos[seg] == np.arange(self.head, self.tail)]
        self.ring[: live.size] = live
        self.pos[live] = np.arange(live.size)
        self.head, self.tail = 0, live.size

    def push_many(self, blocks):
        k = blocks.size
        if self.tail + k > self.ring.size:
            self._compact()
        self.ring[self.tail:self.tail + k] = blocks
        self.pos[blocks] = np.arange(self.tail, self.tail + k)
        self.tail += k
        self._len += k

    def push(self, b):
        self.push_many(np.array([b]))

    def discard(self, b):
        self.pos[b] = -1
        self._len -= 1

    def pop_many(self, n):
        out = []
        got = 0
        h = self.head
        while got < n:
            end = min(h + max(2 * (n - got), 64), self.tail)
            seg = self.ring[h:end]
            ok = np.flatnonzero(self.pos[seg] == np.arange(h, end))
            need = n - got
            if ok.size >= need:
                take = ok[:need]
                out.append(seg[take])
                h += int(take[-1]) + 1
                got = n
            else:
                out.append(seg[ok])
                got += ok.size
                h = end
        blocks = np.concatenate(out) if len(out) > 1 else out[0]
        self.pos[blocks] = -1
        self.head = h
        self._len -= n
        return blocks

    def pop(self):
        return int(self.pop_many(1)[0])

    def __iter__(self):
        seg = self.ring[self.head:self.tail]
        return iter(seg[self.pos[seg] == np.arange(self.head, self.tail)].tolist())


class Batched(BlockManager):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        if self._cache is not None:
            self._cache.evictor = RingEvictor(self._gpu.num_blocks)

    def free(self, seq_id, *, cache=True):
        row = self._row(seq_id)
        if cache and self._cache is not None and not self._swapped[row] and self._window is None:
            full, j = int(self._ntok[row]) // self._bs, int(self._nreg[row])
            if full > j and self._ccid[row] != 0:
                got = self._cache.register_chains(self._table[row, j:full].astype(np.int64), np.array([full - j]),
                                                  self._ccid[row:row + 1], self._ckey[row:row + 1])
                if got is not None:
                    self._ccid[row], self._ckey[row] = got[0][0], got[1][0]
                    self._nreg[row] = full
        super().free(seq_id, cache=cache)

    def _park_gpu(self, zero):
        cached = self._cache.cid[zero] != 0
        self._cache.evictor.push_many(zero[cached].astype(np.int64))
        self._gpu.give(zero[~cached])

    def _take(self, n):
        pool = self._gpu
        k = min(n, pool._nfree)
        ids = pool.take(k)
        if k < n:
            c = self._cache
            extra = c.evictor.pop_many(n - k)
            mp = c._map
            list(map(mp.__delitem__, c.key[extra].tolist()))
            c.cid[extra] = 0
            c.evictions += n - k
            extra = extra.astype(np.int32)
            pool._ref[extra] = 1
            ids = np.concatenate((ids, extra))
        return ids


if __name__ == "__main__":
    # python benchmarks/replay_core_prototype.py TRACE [CAPACITY ...]: prototype then BlockManager, per capacity
    from pagedkv.replay import load_trace, replay_sequence

    tr = load_trace(sys.argv[1])
    for C in [int(x) for x in sys.argv[2:]] or [300_000, 1_000_000, 3_000_000, 10_000_000]:
        a = replay_sequence(tr, C, manager_cls=Batched, impl="prototype")
        b = replay_sequence(tr, C)
        print(json.dumps(dict(capacity=C, prototype_hit_tokens=a.hit_tokens, hit_tokens=b.hit_tokens,
                              prototype_s=round(a.seconds, 2), blockmanager_s=round(b.seconds, 2),
                              evictions=(a.evictions, b.evictions))), flush=True)
