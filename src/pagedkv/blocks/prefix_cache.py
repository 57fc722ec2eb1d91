"""Prefix cache: content-addressed full blocks and the eviction order of the unreferenced ones.

A full block is identified by a chained key::

    root  = xxh3_64("pagedkv-ns:" + namespace)
    key_0 = xxh3_64(token bytes of block 0, seed=root)
    key_i = xxh3_64(token bytes of block i, seed=key_{i-1})

xxh3 is deterministic across processes and machines (no built-in ``hash()``). A key is only a lookup hint. Each
cached content also gets a *content id* (``cid``, a positive serial number, never reused; namespace roots have
negative ones), and a hit requires the candidate block's stored tokens to equal the query's and its stored
parent cid to be the cid verified one block earlier. A hash collision therefore costs a miss, never another
sequence's KV.

Everything is flat and indexed by block id; there is no object per block::

    tok   int32[num_blocks, block_size]  token ids written in the block (mirrors the KV; the manager writes it)
    key   uint64[num_blocks]             chained key of a cached block
    cid   int64[num_blocks]              content id of a cached block, 0 when the block is not cached
    pcid  int64[num_blocks]              content id of its parent (a root's for block 0 of a prompt)
    succ  int32[num_blocks]              the next block of the run the block was registered in (-1: none)
    dl    bool[num_blocks]               the block is cached but *dict-less* (see Runs)
    dupc  int64[num_blocks]              content id of which a held, uncached block is a copy (see Copies)
    LRUEvictor: stamp int32[num_blocks], a push log of 1.25 x num_blocks (block, stamp) int32 pairs: the LRU
                                         order of the unreferenced cached blocks

plus the dict ``key -> block id`` of the cached blocks (content-keyed) that are not dict-less.

Runs. A prompt's new full blocks form one chain, registered at once (:meth:`PrefixCache.register_run`): only
its first block enters the dict; each later one is *dict-less*, found as ``succ`` of its predecessor, which is the
block caching its parent content. A lookup walks a prompt from its root, so it reaches a dict-less block through
that predecessor::

    dict:  key_h -> b7                       run b7 -> b3 -> b12 -> b5   (succ; dl: b3, b12, b5)
    walk:  root ... hit(h-1) --dict--> b7 --succ--> b3 --succ--> b12 ...  (each candidate's key, parent cid
                                                                          and tokens still checked)

A dict operation on a random 64-bit key costs one to three cache misses: two per block (insert, then delete at
eviction) were about half of a trace replay's time; a run costs one probe per block (is the key cached?) and one
insert and one delete per prompt. Invariants (checked by ``check_invariants``): every cached block has a key of
its own; a dict-less block is ``succ`` of the cached block whose content is its parent; every other cached block
is in the dict. Evicting a block deletes its key unless it is dict-less, and puts its dict-less successor (the run
goes on without it) into the dict. Every method that reads the dict as the whole index first calls
:meth:`PrefixCache.flush` (a dict insert per dict-less block, what registering it cost before): only prompt
registration, eviction and the manager's lookup walk work with runs, so a workload of prompts allocated and freed
keeps them, and a decode step after an allocation pays the inserts the allocation saved.

This module keeps what a request calls (recording a copy too: Copies in :mod:`.cache_periphery`); the cold parts
(a copy's inheritance at eviction, orphans, KV events, swap-in's adoption, withdrawal, the namespace sweep, the
reset) are its base class :class:`~pagedkv.blocks.cache_periphery.CachePeriphery`.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np
import xxhash

from ..errors import InvalidArgumentError, InvalidTokensError
from ..events import BlockStored
from .cache_periphery import CachePeriphery
from .evictor import LRUEvictor

__all__ = ["LRUEvictor", "PrefixCache", "PromptKeys", "block_hashes", "block_key"]

_xxh3 = xxhash.xxh3_64_intdigest
_SWEEP_MIN = 1024  # namespaces kept before the first release sweep
_slice_memo: dict[int, list[slice]] = {}


def block_key(parent_key: int, data: bytes) -> int:
    """Key of a block with token bytes ``data`` whose parent has key ``parent_key``."""
    return _xxh3(data, seed=parent_key)


def _root_key(namespace: object, group: int = 0) -> int:
    data = _encode_namespace(namespace)
    if group:  # a KV cache group's chains start from their own root (group 0's are the bare namespace's)
        data = b"g%d:" % group + data
    return _xxh3(b"pagedkv-ns:" + data)


def _check_group(group) -> int:
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 0:
        raise InvalidArgumentError(f"group must be an int >= 0, got {group!r}")
    return int(group)


def _full_blocks(token_ids, block_size, group) -> tuple[np.ndarray, int]:
    """``token_ids`` as a checked 1-D int array and its count of full blocks (a chain's input: block_hashes,
    pagedkv.tiers.check_digests). Raises InvalidArgumentError (block size, group) or InvalidTokensError."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 0:
        raise InvalidArgumentError(f"group must be an int >= 0, got {group!r}")
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidTokensError(f"token_ids must be a 1-D sequence of ints, got {arr.dtype} of shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 2**31 - 1):
        raise InvalidTokensError("token_ids must lie in [0, 2**31)")
    n = arr.size // block_size
    return arr, n


def block_hashes(token_ids, block_size: int = 16, namespace: object = None, group: int = 0) -> list[int]:
    """The prefix-cache keys of the full blocks of ``token_ids`` (``len // block_size`` of them), as a
    BlockManager with this ``block_size`` computes them and as its KV events name the blocks: what a router
    computes for a request it has not routed yet. Deterministic across processes. O(len(token_ids)).

    ``group``: the KV cache group of a :class:`pagedkv.HybridBlockManager` whose keys to compute (its events'
    ``group_idx``). Each group's chain starts from a root of its own, so the same tokens have different keys in
    different groups; group 0 (the default) has the keys of a single-group BlockManager. The derivation (a
    public contract; docs/guide/kv-groups.md): ``root_g = xxh3_64(b"pagedkv-ns:" + b"g<g>:" + enc(namespace))``
    for g > 0 (group 0 without the ``g<g>:`` tag), ``key_i = xxh3_64(int32 bytes of block i, seed=key_{i-1})``."""
    arr, n = _full_blocks(token_ids, block_size, group)
    data = arr[: n * block_size].astype(np.int32).tobytes()
    out, k = [], _root_key(namespace, int(group))
    for sl in _slices(n, 4 * block_size):
        k = _xxh3(data[sl], seed=k)
        out.append(k)
    return out


class PromptKeys(list):
    """A prompt's block keys in group 0 (a list equal to :func:`block_hashes`), which also computes, on demand
    and once each, its keys in other KV cache groups (:meth:`group`): what a router scoring replicas of a hybrid
    model needs (:meth:`pagedkv.cluster.index.MemoryIndex.longest_prefix`). Anything that takes a list of
    hashes takes it unchanged. Checks as :func:`block_hashes`; O(len(token_ids)) per group asked.

    ``hit_blocks``: the most blocks a prefix hit can cover, ``(len(token_ids) - 1) // block_size`` (an engine
    computes at least the prompt's last token), where a hybrid hit's windows must end."""

    __slots__ = ("_args", "_groups", "hit_blocks")

    def __init__(self, token_ids, block_size: int = 16, namespace: object = None) -> None:
        arr = np.asarray(token_ids)
        super().__init__(block_hashes(arr, block_size, namespace))
        self._args = (arr, block_size, namespace)
        self._groups: dict[int, list[int]] = {0: self}
        self.hit_blocks = max(arr.size - 1, 0) // block_size

    def group(self, g: int) -> list[int]:
        """The keys of the same blocks in KV cache group ``g`` (``block_hashes(..., group=g)``)."""
        got = self._groups.get(g)
        if got is None:
            arr, bs, ns = self._args
            got = self._groups[_check_group(g)] = block_hashes(arr, bs, ns, group=g)
        return got


def _chain(datas, key: int) -> list[int]:
    """The chained keys of the blocks ``datas`` (token bytes, in order) after the parent key ``key``: key_i =
    xxh3(datas[i], seed=key_{i-1}). One C-level pass, no Python bytecode per block: ``map`` reads each seed from
    the list it is extending (a list iterator sees the items appended while it runs)."""
    keys = [key]
    keys += map(_xxh3, datas, keys)
    del keys[0]
    return keys


def _extend_chain(keys: list, datas: list, stop: int, seed: int) -> None:
    """Extend ``keys`` (the chained keys of ``datas[:len(keys)]``, the first seeded by ``seed``) in place to the
    keys of ``datas[:stop]``: :func:`_chain` without its copies (the seeds are read, through a list iterator set
    to the last key, from the list being extended)."""
    a = len(keys)
    if a >= stop or a >= len(datas):
        return
    if not a:
        keys.append(_xxh3(datas[0], seed=seed))
        a = 1
    it = iter(keys)
    it.__setstate__(a - 1)
    keys += map(_xxh3, itertools.islice(datas, a, stop), it)


def _slices(n: int, width: int) -> list[slice]:
    """``[slice(0, width), slice(width, 2 * width), ...]``, ``n`` of them (memoised per width)."""
    got = _slice_memo.get(width)
    if got is None or len(got) < n:
        size = max(n, 2 * len(got) if got else 64)
        got = _slice_memo[width] = [slice(i * width, (i + 1) * width) for i in range(size)]
    return got[:n]


class _GroupNS:
    """The namespace of one KV cache group's rows in a :class:`pagedkv.HybridBlockManager` (internal): a user
    namespace tagged with its group (index, spec kind, window). Group 0 encodes like the bare namespace (its keys
    are :func:`block_hashes`'), group g > 0 as ``b"g<g>:" + encoding``, a prefix no bare namespace's encoding
    has, so the groups' chains start from distinct roots and their keys never coincide. KV events unwrap it."""

    __slots__ = ("namespace", "group", "kind", "window", "_data", "family")

    def __init__(self, namespace: object, group: int, kind: str, window: int | None, ngroups: int) -> None:
        self.namespace, self.group, self.kind, self.window = namespace, group, kind, window
        data = _encode_namespace(namespace)
        # the encodings of this namespace in every group (a live sequence keeps all of its groups' roots)
        self.family = (data,) + tuple(b"g%d:" % g + data for g in range(1, ngroups))
        self._data = self.family[group]

    def __eq__(self, other: object) -> bool:
        return type(other) is _GroupNS and other._data == self._data

    def __hash__(self) -> int:
        return hash(self._data)

    def __repr__(self) -> str:
        return f"_GroupNS({self.namespace!r}, group={self.group})"


def _stored_event(keys: list, parent: int | None, toks: list, bs: int, medium: str, ns: object) -> BlockStored:
    """A BlockStored for blocks of namespace ``ns`` (a bare namespace, or a group's :class:`_GroupNS`)."""
    if type(ns) is _GroupNS:
        return BlockStored(keys, parent, toks, bs, None, medium, ns.namespace, ns.group, ns.kind, ns.window)
    return BlockStored(keys, parent, toks, bs, None, medium, ns)


def _encode_namespace(namespace: object) -> bytes:
    if namespace is None:
        return b""
    if isinstance(namespace, str):
        return b"s:" + namespace.encode("utf-8")
    if isinstance(namespace, bytes):
        return b"b:" + namespace
    if isinstance(namespace, int) and not isinstance(namespace, bool):
        return b"i:" + str(namespace).encode()
    if type(namespace) is _GroupNS:
        return namespace._data
    raise InvalidArgumentError(f"namespace must be None, str, bytes or int, got {type(namespace).__name__}")


class PrefixCache(CachePeriphery):
    """Per-block content state (see the module docstring), the map ``key -> block`` and the evictor.

    Internal to pagedkv. A *parent* is passed as ``(cid, key)``; ``cid == 0`` means a broken chain (nothing
    after it is cached).

    **Shared state**: the public attributes the manager's parts read, and where noted write, on their hot paths
    (the per-block arrays, never rebound, and their memoryviews; ``map``, ``ndl``, ``roots``, ``serial``,
    ``ns_list``, ``block_size``, ``evictor``, ``tier``; the KV-event emitters): docs/design.md, "The manager in
    parts". Only this class changes ``map``; while ``ndl`` is non-zero a reader of the whole index calls
    :meth:`flush`.
    """

    __slots__ = ("map", "tok", "key", "cid", "pcid", "evictor", "roots", "serial", "evictions", "_width",
                 "cid_mv", "tok_mv", "key_mv", "pcid_mv", "tier", "fresh", "fresh_serial", "events", "event_overflows", "_ev_max", "_ev_lost", "pkey", "nsid", "_ns_ids", "ns_list", "block_size",
                 "_root_serial", "_ns_free", "sweep_at", "grouped", "void", "dl", "succ", "ndl", "_runs",
                 "_runs_keep", "succ_mv", "dl_mv", "pool", "dupc", "dupc_mv",
                 "dups", "has_copies", "_sweep_min")

    # the helpers CachePeriphery's methods use (it cannot import this module)
    _encode = staticmethod(_encode_namespace)
    _block_key = staticmethod(block_key)
    _stored_event = staticmethod(_stored_event)
    _group_of = staticmethod(lambda ns: ns.group if type(ns) is _GroupNS else None)

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.map: dict[int, int] = {}
        self.tok = np.zeros((num_blocks, block_size), dtype=np.int32)
        self.key = np.zeros(num_blocks, dtype=np.uint64)
        self.cid = np.zeros(num_blocks, dtype=np.int64)
        self.pcid = np.zeros(num_blocks, dtype=np.int64)
        self.cid_mv = memoryview(self.cid)  # element access for the plain-Python paths
        self.tok_mv = memoryview(self.tok)
        self.key_mv, self.pcid_mv = memoryview(self.key), memoryview(self.pcid)
        self.evictor = LRUEvictor(num_blocks)
        # dict-less blocks (see "Runs" in the module docstring): dl[b] marks a cached block that is not in map, found
        # as succ[p] of its run predecessor p; ndl counts them, _runs lists the runs' blocks for flush()
        self.dl = np.zeros(num_blocks, dtype=bool)
        self.succ = np.full(num_blocks, -1, dtype=np.int32)
        self.dl_mv, self.succ_mv = memoryview(self.dl), memoryview(self.succ)
        self.ndl = 0
        # held, uncached copies of cached contents (see Copies): dupc[b] = the content id block b copies, dups
        # content id -> its copies (records checked against dupc when used)
        self.dupc = np.zeros(num_blocks, dtype=np.int64)
        self.dupc_mv = memoryview(self.dupc)
        self.dups: dict[int, list[int]] = {}
        self.has_copies = False  # a copy was recorded since the last reset (dupc may be non-zero)
        self._runs: list[np.ndarray] = []
        self._runs_keep = 64  # prune _runs (drop the runs with no dict-less block left) past this length
        self.roots: dict[bytes, tuple[int, int]] = {}  # encoded namespace -> (cid < 0, key)
        self.serial = 0  # last content id handed out
        self.evictions = 0
        self._width = 4 * block_size  # bytes of one block's tokens
        self.void = np.dtype((np.void, self._width))  # one block's tokens as one item: .tolist() gives its bytes
        self.block_size = block_size
        # the CPU tier (cpu_tier.CpuTier) when on: evicted blocks spill into it; ``fresh`` stamps each block with
        # the step serial at which it was cached (a block cached in the current step is never demoted)
        self.tier = None
        # the GPU pool of these blocks (set by Blocks; None: neither): registration records a held block whose
        # content another block caches as its copy, and eviction hands the content to a held copy
        self.pool = None
        self.fresh, self.fresh_serial = None, 0
        self.events: list | None = None  # KV events (enable_events): None when off (each emission point: one test)
        self.event_overflows = 0
        self._ev_max, self._ev_lost = 0, False
        self.pkey = self.nsid = None  # per-block parent key and namespace index, kept only for events
        self._ns_ids: dict[bytes, int] = {}
        self.ns_list: list[object] = []
        self._ns_free: list[int] = []  # released slots of ns_list
        self._root_serial = 0  # roots handed out (a root's cid is -serial; never reused)
        self.sweep_at = self._sweep_min = _SWEEP_MIN  # the manager releases unused namespaces past sweep_at
        self.grouped = False  # a KV cache group's namespace was seen: removals carry their group (emit_removed)

    # ------------------------------------------------------------------ namespaces
    def root(self, namespace: object, intern: bool = True) -> tuple[int, int]:
        """``(cid, key)`` of a namespace's root; block 0 of a prompt chains from it. With ``intern=False`` a
        namespace seen for the first time is not stored (the caller calls :meth:`intern` once it commits)."""
        data = _encode_namespace(namespace)
        r = self.roots.get(data)
        if r is None:
            r = (-(self._root_serial + 1), _xxh3(b"pagedkv-ns:" + data))
            if intern:
                self.roots[data] = r
                self._root_serial += 1
        return r

    def intern(self, namespace: object) -> bool:
        """Store a namespace's root (see :meth:`root`); True if it was new."""
        n = len(self.roots)
        self.root(namespace, intern=True)
        return len(self.roots) != n

    def __len__(self) -> int:
        """Cached blocks (referenced or not)."""
        return len(self.map) + self.ndl

    # ------------------------------------------------------------------ registration
    def register(self, block: int, pcid: int, pkey: int, namespace: object = None, emit: bool = True) -> tuple[int, int]:
        """Cache ``block`` (full, its KV and ``tok`` written) after parent ``(pcid, pkey)``. Returns the
        ``(cid, key)`` that now stands for this content: the block's own (new, or the one it already had), or
        that of another block already caching the same content (this block then stays uncached). ``(0, 0)``
        when the chain ends here: a broken parent, or a hash collision with other content."""
        cid = self.cid_mv  # (element access: a third of a numpy scalar's cost)
        if pcid == 0:
            return 0, 0
        if self.ndl:
            self.flush()
        c = cid[block]
        if c:
            return c, self.key_mv[block]
        data = self.tok[block].tobytes()
        key = _xxh3(data, seed=pkey)
        other = self.map.get(key)
        if other is None:
            t = self.tier.find_keyed(pcid, key, data) if self.tier is not None else -1
            if t >= 0:  # the CPU tier holds this content: the block takes its identity (chains stay whole)
                new = int(self.tier.cpu_id[0, t])
            else:
                self.serial += 1
                new = self.serial
            cid[block], self.key_mv[block], self.pcid_mv[block] = new, key, pcid
            self.map[key] = block
            if self.has_copies:  # (a recorded copy cached itself: the content it copied left, or gave way)
                self.dupc_mv[block] = 0
            if self.fresh is not None:
                self.fresh[block] = self.fresh_serial
            if emit and self.events is not None:
                self.emit_stored([block], [key], pcid, pkey, namespace)
            return new, key
        if self.tok[other].tobytes() == data:
            if self.pcid_mv[other] == pcid:  # same content cached by another block: share its identity
                c = cid[other]
                if self.pool is not None:
                    self.note_copy(block, c, key, pcid)
                    if self.events is not None:  # (its parent and namespace, as a cached block's)
                        self.pkey[block], self.nsid[block] = pkey, self._ns_index(namespace)
                return c, key
            if self.live_parent(pcid, pkey):  # other's parent content is not the one cached: it cannot be reached
                if self.pool is not None and self._parked(other):
                    # a pinned orphan stays cached (the pin holds that very block; freeing it would hand a block
                    # lookup_prefix did not count to the allocation): the same key is the same prefix, so it is
                    # chained under the live parent, and this block becomes its copy
                    self.pcid_mv[other] = pcid
                else:
                    self._uncache(other)  # (an orphan: its parent left the cache); this block replaces it
                return self.register(block, pcid, pkey, namespace, emit)
        return 0, 0

    def note_copy(self, block: int, c: int, key: int, pcid: int) -> None:
        """Record the held, uncached ``block`` as a copy of content ``c`` (key ``key``, parent ``pcid``; see Copies):
        ``key`` and ``pcid`` are kept in the block's entries (uncached, no map entry) so that the copy carries the
        content's identity when it is swapped out. O(1) amortised: a list of copies drops its stale records when
        it reaches 8."""
        self.dupc_mv[block] = c
        self.key_mv[block], self.pcid_mv[block] = key, pcid
        self.has_copies = True
        got = self.dups.get(c)
        if got is None:
            self.dups[c] = [block]
            return
        if len(got) >= 8:
            dupc = self.dupc_mv
            got[:] = [d for d in got if dupc[d] == c and d != block]
        got.append(block)

    def forget_copies(self, blocks: np.ndarray) -> None:
        """Uncached ``blocks`` return to the free ring: they copy nothing any more. O(len(blocks)) once a copy was
        recorded (since the last reset), else one test."""
        if self.has_copies:
            self.dupc[blocks] = 0

    def register_chains(self, blocks: np.ndarray, counts: np.ndarray, pcids: np.ndarray,
                        pkeys: np.ndarray, namespaces: list | None = None,
                        keys: list | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`register` for several chains at once: chain ``r`` is the next ``counts[r]`` blocks of
        ``blocks`` (in order, each the parent of the next) after parent ``(pcids[r], pkeys[r])``. Returns the
        ``(cid, key)`` of each chain's last block, or None, having changed nothing, unless every chain is intact,
        every block is new and uncached and every key is distinct and absent (then the caller goes block by
        block with :meth:`register`).

        That common case costs a gather of the tokens, xxh3 per block through C-level ``map`` (a Python loop
        along chains longer than one block), one ``map(dict.setdefault, ...)`` pass that inserts the keys and
        detects any present one, and four vectorised writes: well under a microsecond a block. ``keys``: the
        blocks' chained keys when the caller has them already (a prompt's, computed by its lookup; they must be
        exactly what this call would compute from the blocks' tokens): no gather, no hashing."""
        n = blocks.size
        cid = self.cid
        # (count_nonzero costs a fraction of .any() / .all() / .min() on small arrays)
        if not n or np.count_nonzero(pcids) != pcids.size or np.count_nonzero(cid[blocks]) or blocks.min() < 0:
            return None
        if keys is None:
            # each block's token bytes, one bytes object per block straight from numpy (a void item each)
            datas = self.tok[blocks].view(self.void).ravel().tolist()
            if n == counts.size:  # one block per chain: the per-step case
                keys = list(map(_xxh3, datas, pkeys.tolist()))
            elif counts.size == 1:  # one chain (a prompt): chained in C, see _chain
                keys = _chain(datas, int(pkeys[0]))
            else:
                keys, it = [], iter(datas)
                for k, m in zip(pkeys.tolist(), counts.tolist()):
                    keys += _chain(itertools.islice(it, m), k)
        if self.ndl:
            self.flush()
        mp, bl = self.map, blocks.tolist()
        if self.tier is not None and self.tier.map and any(map(self.tier.map.__contains__, keys)):
            return None  # a content the CPU tier holds: block by block, taking its identity
        got = list(map(mp.setdefault, keys, bl))  # inserts the absent keys, returns the present ones' blocks
        if got != bl:  # a key was present or repeats (a repeated block repeats its key): undo this call's inserts
            for k, g, b in zip(keys, got, bl):
                if g == b:
                    mp.pop(k, None)
            return None
        new = np.arange(self.serial + 1, self.serial + n + 1, dtype=np.int64)
        self.serial += n
        karr = np.fromiter(keys, dtype=np.uint64, count=n)
        cid[blocks] = new
        self.key[blocks] = karr
        if self.fresh is not None:
            self.fresh[blocks] = self.fresh_serial
        if self.events is not None:
            self._stored_chains(blocks, bl, keys, counts, pcids, pkeys, namespaces)
        if n == counts.size:
            self.pcid[blocks] = pcids
            return new, karr
        parent = new - 1  # within a chain each block's parent is the previous block
        parent[0] = pcids[0]
        if counts.size == 1:  # one chain (a prompt)
            self.pcid[blocks] = parent
            return new[-1:], karr[-1:]
        last = np.cumsum(counts) - 1
        parent[last[:-1] + 1] = pcids[1:]
        self.pcid[blocks] = parent
        return new[last], karr[last]

    # ------------------------------------------------------------------ runs (dict-less blocks)
    def register_run(self, blocks: np.ndarray, keys: list, pcid: int, pkey: int, after: int,
                     namespace: object = None) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`register_chains` of one chain of new, uncached blocks (at least two) whose chained ``keys`` the
        caller computed, after the parent content ``(pcid, pkey)`` that the GPU block ``after`` caches (-1: a
        namespace root), leaving all but the chain's first block out of the map (dict-less, found from their predecessor
        through ``succ``; see "Runs" in the module docstring). None, having changed nothing, unless no key is
        cached (in the map, or as the dict-less successor of ``after``) and there is no CPU tier: the caller
        then registers block by block. One dict probe a block and one insert a chain, instead of one insert a
        block."""
        mp = self.map
        if pcid == 0 or self.tier is not None or any(map(mp.__contains__, keys)):
            return None
        if after >= 0:  # a dict-less child of the parent block with the first key?
            s = self.succ_mv[after]
            if s >= 0 and self.cid_mv[s] and self.pcid_mv[s] == self.cid_mv[after] and self.key_mv[s] == keys[0]:
                return None
        n = blocks.size
        head = int(blocks[0])
        mp[keys[0]] = head
        new = np.arange(self.serial + 1, self.serial + n + 1, dtype=np.int64)
        self.serial += n
        karr = np.fromiter(keys, dtype=np.uint64, count=n)
        self.cid[blocks] = new
        self.key[blocks] = karr
        parent = new - 1
        parent[0] = pcid
        self.pcid[blocks] = parent
        rest = blocks[1:]
        self.dl[rest] = True
        self.succ[blocks[:-1]] = rest
        self.succ_mv[int(blocks[-1])] = -1
        self.ndl += n - 1
        runs = self._runs
        runs.append(rest)
        if len(runs) > self._runs_keep:  # drop the runs whose blocks have all left (amortised O(1) a run)
            dl = self.dl
            self._runs = runs = [r for r in runs if dl[r].any()]
            self._runs_keep = max(64, 2 * len(runs))
        if self.fresh is not None:
            self.fresh[blocks] = self.fresh_serial
        if self.events is not None:
            self._stored_chains(blocks, blocks.tolist(), keys, np.array([n], np.int64), np.array([pcid], np.int64),
                                np.array([pkey], np.uint64), [namespace])
        return new[-1:], karr[-1:]

    def flush(self) -> None:
        """Put every dict-less block into the map: the map then holds every cached block, as all methods but
        :meth:`register_run`, :meth:`evict_many` / :meth:`evict` and the manager's lookup walk expect (each of
        them calls this first when dict-less blocks exist). Changes no cache content. O(dict-less blocks) dict
        inserts (what registering them cost before runs) plus O(1) a run."""
        mp, dl = self.map, self.dl
        for r in self._runs:
            b = r[dl[r]]
            if not b.size:
                continue
            bl = b.tolist()
            got = list(map(mp.setdefault, self.key[b].tolist(), bl))
            if got != bl:  # a key another block holds (a 64-bit collision): that block stays dict-less
                b = b[np.array([g == x for g, x in zip(got, bl)], dtype=bool)]
            dl[b] = False
            self.ndl -= b.size
        self._runs = [r for r in self._runs if dl[r].any()] if self.ndl else []

    def _forget_runs(self, blocks: np.ndarray) -> list | None:
        """The map side of evicting ``blocks`` (int32, cached) while dict-less blocks exist: delete the keys of
        those in the map, unmark the dict-less ones, and put each evicted block's dict-less successor (its run
        continues without it) into the map. Returns the keys of all of ``blocks`` when KV events are on."""
        dl, mp = self.dl, self.map
        keys = self.key[blocks].tolist() if self.events is not None else None
        isdl = dl[blocks]
        k = int(np.count_nonzero(isdl))
        dl[blocks] = False
        self.ndl -= k
        collections.deque(map(mp.__delitem__, self.key[blocks[~isdl]].tolist() if k else
                              keys if keys is not None else self.key[blocks].tolist()), maxlen=0)
        s = self.succ[blocks]
        self.succ[blocks] = -1
        cand = dl[s]  # successors still dict-less (those evicted here were unmarked above; -1, none, is masked)
        if cand.any():
            s, p = s[cand], blocks[cand]
            orphan = s[(s >= 0) & (self.pcid[s] == self.cid[p])]  # (dict-less: cached)
            if orphan.size:  # the run's next block, cached and dict-less, loses its way in: into the map
                bl = orphan.tolist()
                got = list(map(mp.setdefault, self.key[orphan].tolist(), bl))
                if got != bl:  # (a 64-bit collision: that block stays dict-less, unreachable)
                    orphan = orphan[np.array([g == x for g, x in zip(got, bl)], dtype=bool)]
                dl[orphan] = False
                self.ndl -= orphan.size
        return keys

    # ------------------------------------------------------------------ eviction
    def evict_many(self, n: int) -> np.ndarray:
        """:meth:`evict` of the ``n`` least recently used unreferenced blocks, LRU first (int32). Batch form:
        a few numpy calls and one C-level pass over the map."""
        blocks = self.evictor.pop_many(n)
        heirs = self._heirs(blocks) if self.dups else None
        if heirs:
            return self._evict_with_heirs(blocks, heirs)
        if self.ndl:  # some blocks may be dict-less, or the successors of evicted ones
            keys = self._forget_runs(blocks)
            cids = None
        else:
            keys = self.key[blocks].tolist()
            collections.deque(map(self.map.__delitem__, keys), maxlen=0)
            cids = self.cid[blocks].copy() if self.tier is not None else None
        self.cid[blocks] = 0
        self.evictions += n
        if self.events is not None:
            self.emit_removed(keys, self.nsid[blocks], "GPU")
        if cids is not None:
            self.tier.demote(blocks, cids)
        return blocks

    def evict(self) -> int:
        """Evict the least recently used unreferenced block and return its id (now uncached)."""
        b = self.evictor.pop()
        if self.dups:
            heirs = self._heirs(np.array([b], dtype=np.int32))
            if heirs:
                return int(self._evict_with_heirs(np.array([b], dtype=np.int32), heirs)[0])
        k = int(self.key[b])
        c = int(self.cid[b])
        if self.ndl:
            self._forget_runs(np.array([b], dtype=np.int32))
        else:
            del self.map[k]
        self.cid[b] = 0
        self.evictions += 1
        if self.events is not None:
            self.emit_removed([k], [int(self.nsid[b])], "GPU")
        if self.tier is not None:
            self.tier.demote(np.array([b]), np.array([c]))
        return b
