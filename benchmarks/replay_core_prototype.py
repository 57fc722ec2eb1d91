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


def main1():
    # python benchmarks/replay_core_prototype.py TRACE [CAPACITY ...]: prototype then BlockManager, per capacity
    from pagedkv.replay import load_trace, replay_sequence

    tr = load_trace(sys.argv[1])
    for C in [int(x) for x in sys.argv[2:]] or [300_000, 1_000_000, 3_000_000, 10_000_000]:
        a = replay_sequence(tr, C, manager_cls=Batched, impl="prototype")
        b = replay_sequence(tr, C)
        print(json.dumps(dict(capacity=C, prototype_hit_tokens=a.hit_tokens, hit_tokens=b.hit_tokens,
                              prototype_s=round(a.seconds, 2), blockmanager_s=round(b.seconds, 2),
                              evictions=(a.evictions, b.evictions))), flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Step 2 of the prototype: chained keys computed for a whole prompt at once, lookup through map(dict.get).
#
#   h_i   = xxh3_64(token bytes of block i)                       (C-level map: no Python frame per block)
#   key_i = P**(i+1) * root + sum_{t<=i} h_t * P**(i-t)  mod 2**64 (a polynomial over the prefix, computed as
#           P**i * (P * root + cumsum(h_t * Q**t)) with Q = P**-1 mod 2**64, vectorised in uint64)
#
# A key is still only a hint: a hit is verified (tokens equal, parent content id equal), vectorised.
from itertools import repeat  # noqa: E402

import xxhash  # noqa: E402

from pagedkv.prefix_cache import _slices  # noqa: E402

_P = np.uint64(0x9E3779B97F4A7C15 | 1)
_Q = np.uint64(pow(int(_P), -1, 2**64))
_xxh3 = xxhash.xxh3_64_intdigest


def _powers(base, n):
    out = np.empty(n, dtype=np.uint64)
    out[0] = 1
    if n > 1:
        out[1:] = base
        np.cumprod(out[1:], out=out[1:])
    return out


class BatchedKeys(Batched):
    _POW_N = 1 << 16

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._pp = _powers(_P, self._POW_N)
        self._qq = _powers(_Q, self._POW_N)
        self._row_keys = {}
        self._last_keys = None

    def _keys(self, arr, root_key):
        bs = self._bs
        m = arr.size // bs
        raw = arr[: m * bs].tobytes()
        w = 4 * bs
        h = np.fromiter(map(_xxh3, map(raw.__getitem__, _slices(m, w))), dtype=np.uint64, count=m)
        with np.errstate(over="ignore"):
            s = np.cumsum(h * self._qq[:m], dtype=np.uint64)
            return self._pp[:m] * (np.uint64(root_key) * _P + s)

    def _lookup(self, arr, root):
        cache = self._cache
        keys = self._keys(arr, root[1])
        self._last_keys = keys
        ncand = (arr.size - 1) // self._bs
        got = list(map(cache._map.get, keys[:ncand].tolist(), repeat(-1)))
        k = got.index(-1) if -1 in got else ncand
        if k == 0:
            return [], root
        blocks = np.array(got[:k], dtype=np.int64)
        bs = self._bs
        ok = (cache.tok[blocks] == arr[: k * bs].reshape(k, bs)).all(axis=1)
        parents = np.empty(k, dtype=np.int64)
        parents[0] = root[0]
        parents[1:] = cache.cid[blocks[:-1]]
        ok &= cache.pcid[blocks] == parents
        if not ok.all():
            k = int(np.argmin(ok))
            if k == 0:
                return [], root
            blocks = blocks[:k]
        last = int(blocks[-1])
        return blocks.tolist(), (int(cache.cid[last]), int(keys[k - 1]))

    def allocate(self, seq_id, token_ids, *, namespace=None):
        hit = super().allocate(seq_id, token_ids, namespace=namespace)
        self._row_keys[self._row_of[seq_id]] = self._last_keys
        return hit

    def free(self, seq_id, *, cache=True):
        row = self._row(seq_id)
        keys = self._row_keys.pop(row, None)
        c = self._cache
        if cache and c is not None and not self._swapped[row] and keys is not None:
            full, j = min(int(self._ntok[row]) // self._bs, keys.size), int(self._nreg[row])
            pcid = int(self._ccid[row])
            if full > j and pcid != 0:
                blocks = self._table[row, j:full].astype(np.int64)
                kl = keys[j:full].tolist()
                bl = blocks.tolist()
                mp = c._map
                if not np.count_nonzero(c.cid[blocks]):
                    got = list(map(mp.setdefault, kl, bl))
                    if got == bl:  # all new: vectorised writes
                        n = len(bl)
                        new = np.arange(c._serial + 1, c._serial + n + 1, dtype=np.int64)
                        c._serial += n
                        c.cid[blocks] = new
                        c.key[blocks] = keys[j:full]
                        par = np.empty(n, dtype=np.int64)
                        par[0] = pcid
                        par[1:] = new[:-1]
                        c.pcid[blocks] = par
                        self._ccid[row], self._ckey[row] = int(new[-1]), kl[-1]
                    else:  # undo, then block by block
                        for k_, g, b in zip(kl, got, bl):
                            if g == b:
                                mp.pop(k_, None)
                        self._register_keys(row, blocks, kl, pcid)
                else:
                    self._register_keys(row, blocks, kl, pcid)
            self._nreg[row] = full
        BlockManager.free(self, seq_id, cache=cache and keys is None)

    def _register_keys(self, row, blocks, kl, pcid):
        c = self._cache
        for b, k_ in zip(blocks.tolist(), kl):
            if pcid == 0:
                break
            cb = int(c.cid[b])
            if cb:
                pcid = cb
                continue
            other = c._map.get(k_)
            if other is None:
                c._serial += 1
                c.cid[b], c.key[b], c.pcid[b] = c._serial, k_, pcid
                c._map[k_] = b
                pcid = c._serial
            elif c.pcid[other] == pcid and np.array_equal(c.tok[other], c.tok[b]):
                pcid = int(c.cid[other])
            else:
                pcid = 0
        self._ccid[row] = pcid


def main2():
    from pagedkv.replay import load_trace, replay_sequence

    tr = load_trace(sys.argv[2])
    for C in [int(x) for x in sys.argv[3:]] or [300_000, 1_000_000, 3_000_000, 10_000_000]:
        a = replay_sequence(tr, C, manager_cls=BatchedKeys, impl="prototype2")
        b = replay_sequence(tr, C)
        print(json.dumps(dict(capacity=C, prototype2_hit_tokens=a.hit_tokens, hit_tokens=b.hit_tokens,
                              prototype2_s=round(a.seconds, 2), blockmanager_s=round(b.seconds, 2),
                              evictions=(a.evictions, b.evictions))), flush=True)


if __name__ == "__main__":
    main2() if sys.argv[1:2] == ["--keys"] else main1()
