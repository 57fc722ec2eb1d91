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

Copies. A sequence that fills a block whose content another block caches already (held or idle) keeps its block
uncached (one block a key) and chains on from the cached content: an abort of the step (``free(cache=False)``)
then withdraws only contents its call cached anew, never one another sequence's chain runs through. It records
the copy: ``dupc[b]`` is the content id and ``dups`` lists the copies of each content id. When the cached block is evicted, a copy that
is still held takes its cache identity (same key, content id and parent: no KV event, no demotion) and the
evicted block leaves as usual, so the content stays findable while a sequence holds it. A record is valid only
while ``dupc[b]`` still names the content: an uncached block that returns to the free ring clears it
(:meth:`forget_copies`), a copy that takes an identity clears it, a reset clears all. O(1) a copy; an eviction
pays one dict probe a block while copies are recorded.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np
import xxhash

from ..errors import InvalidArgumentError, InvalidTokensError
from ..events import AllBlocksCleared, BlockRemoved, BlockStored
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


class PrefixCache:
    """Per-block content state (see the module docstring), the map ``key -> block`` and the evictor.

    Internal to pagedkv. A *parent* is passed as ``(cid, key)``; ``cid == 0`` means a broken chain (nothing
    after it is cached).

    **Shared state** (public attributes the manager's parts read, and where noted write, on their hot paths;
    the arrays are never rebound): the per-block arrays ``tok`` (the parts write a block's tokens), ``key``,
    ``cid``, ``pcid``, ``succ``, ``dl`` and their memoryviews ``tok_mv``, ``key_mv``, ``cid_mv``, ``pcid_mv``,
    ``succ_mv``, ``dl_mv`` (plain-Python element access); ``map`` (dict key -> block of the cached blocks that are
    not dict-less: a lookup probes it directly; only this class changes it) and ``ndl`` (how many cached blocks
    are dict-less: while it is non-zero a reader that needs the map as the whole index calls :meth:`flush`);
    ``roots`` (encoded namespace -> its root ``(cid, key)``; the manager sweeps it past ``sweep_at``);
    ``serial`` (the last content id handed out); ``ns_list`` (namespace index -> namespace, for KV events);
    ``block_size``; ``evictor`` and ``tier``. :meth:`emit`, :meth:`emit_stored` and :meth:`emit_removed` append KV
    events (no-ops when events are off).
    """

    __slots__ = ("map", "tok", "key", "cid", "pcid", "evictor", "roots", "serial", "evictions", "_width",
                 "cid_mv", "tok_mv", "key_mv", "pcid_mv", "tier", "fresh", "fresh_serial", "events", "event_overflows", "_ev_max", "_ev_lost", "pkey", "nsid", "_ns_ids", "ns_list", "block_size",
                 "_root_serial", "_ns_free", "sweep_at", "grouped", "void", "dl", "succ", "ndl", "_runs",
                 "_runs_keep", "succ_mv", "dl_mv", "pool", "dupc", "dupc_mv",
                 "dups", "has_copies")

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
        # the GPU pool whose blocks these are (set by the manager's Blocks): registration records a held block
        # whose content another block caches as its copy, and eviction hands the content to a held copy (None:
        # neither)
        self.pool = None
        self.fresh = None
        self.fresh_serial = 0
        # KV events (enable_events): None when off, so that every emission point costs one test
        self.events: list | None = None
        self.event_overflows = 0
        self._ev_max = 0
        self._ev_lost = False
        self.pkey = self.nsid = None  # per-block parent key and namespace index, kept only for events
        self._ns_ids: dict[bytes, int] = {}
        self.ns_list: list[object] = []
        self._ns_free: list[int] = []  # released slots of ns_list
        self._root_serial = 0  # roots handed out (a root's cid is -serial; never reused)
        self.sweep_at = _SWEEP_MIN  # the manager releases unused namespaces when roots grows past this
        self.grouped = False  # a KV cache group's namespace was seen: removals carry their group (emit_removed)

    # ------------------------------------------------------------------ KV events
    def enable_events(self, max_events: int) -> None:
        """Record KV events (:mod:`pagedkv.events`), at most ``max_events`` until taken. Adds 12 bytes a block
        (each cached block's parent key and namespace, for the events and for a resynchronisation)."""
        n = self.cid.size
        self.events, self._ev_max = [], max_events
        self.pkey = np.zeros(n, dtype=np.uint64)
        self.nsid = np.zeros(n, dtype=np.int32)

    def _ns_index(self, namespace: object) -> int:
        data = _encode_namespace(namespace)
        i = self._ns_ids.get(data)
        if i is None:
            if self._ns_free:
                i = self._ns_free.pop()
                self.ns_list[i] = namespace
            else:
                i = len(self.ns_list)
                self.ns_list.append(namespace)
            self._ns_ids[data] = i
            if type(namespace) is _GroupNS:
                self.grouped = True
        return i

    def emit_removed(self, keys: list, nsids, medium: str) -> None:
        """Record a BlockRemoved for ``keys`` (whose namespace indexes are ``nsids``): one event, or one per KV
        cache group, in order, when groups are in use."""
        if not self.grouped:
            self.emit(BlockRemoved(keys, medium))
            return
        by: dict = {}
        nsl = self.ns_list
        for k, i in zip(keys, nsids.tolist() if hasattr(nsids, "tolist") else nsids):
            ns = nsl[i]
            by.setdefault(ns.group if type(ns) is _GroupNS else None, []).append(k)
        for g, ks in by.items():
            self.emit(BlockRemoved(ks, medium, g))

    def emit(self, event) -> None:
        ev = self.events
        if len(ev) >= self._ev_max:  # overflow: drop the buffer; the next take answers with a full resync
            ev.clear()
            self._ev_lost = True
            self.event_overflows += 1
            return
        if not self._ev_lost:
            ev.append(event)

    def emit_stored(self, blocks: list[int], keys: list[int], pcid: int, pkey: int, namespace: object) -> None:
        """Record a BlockStored for a chain of newly cached ``blocks`` (and their parent key and namespace)."""
        nsi = self._ns_index(namespace)
        bl = np.asarray(blocks, dtype=np.int64)
        self.pkey[bl[0]] = pkey
        if bl.size > 1:
            self.pkey[bl[1:]] = np.asarray(keys[:-1], dtype=np.uint64)
        self.nsid[bl] = nsi
        self.emit(_stored_event(list(keys), None if pcid < 0 else pkey, self.tok[bl].reshape(-1).tolist(), self.block_size,
                                 "GPU", namespace))

    def _stored_chains(self, blocks: np.ndarray, bl: list, keys: list, counts: np.ndarray, pcids: np.ndarray,
                       pkeys: np.ndarray, namespaces: list | None) -> None:
        """:meth:`emit_stored` for the chains of one :meth:`register_chains` call: the per-block arrays in a few
        vectorised writes, then one BlockStored per chain (a microsecond or so each)."""
        cl = counts.tolist()
        if len(cl) == len(keys):  # one block per chain
            self.pkey[blocks] = pkeys
        else:
            parent = np.empty(len(keys), dtype=np.uint64)
            parent[1:] = keys[:-1]
            heads = np.cumsum(counts) - counts
            parent[heads] = pkeys
            self.pkey[blocks] = parent
        nss = namespaces or [None] * len(cl)
        nsi = [self._ns_index(ns) for ns in nss]
        self.nsid[blocks] = np.repeat(np.array(nsi, dtype=np.int32), counts) if len(cl) != len(keys) else nsi
        toks = self.tok[blocks].tolist()
        bs, emit, pos = self.block_size, self.emit, 0
        for m, pc, pk, ns in zip(cl, pcids.tolist(), pkeys.tolist(), nss):
            if m == 1:
                emit(_stored_event([keys[pos]], None if pc < 0 else pk, toks[pos], bs, "GPU", ns))
            else:
                emit(_stored_event(keys[pos : pos + m], None if pc < 0 else pk,
                                   [t for row in toks[pos : pos + m] for t in row], bs, "GPU", ns))
            pos += m

    def take_events(self) -> list:
        """The events since the last call, in order (and clear them); a full resync after an overflow."""
        if self._ev_lost:
            self._ev_lost = False
            self.events = []
            return [AllBlocksCleared()] + self.snapshot_events()
        out, self.events = self.events, []
        return out

    def snapshot_events(self) -> list:
        """One BlockStored per cached block, parents before children (content ids grow along a chain)."""
        cached = np.flatnonzero(self.cid)
        cached = cached[np.argsort(self.cid[cached], kind="stable")]
        bs, ns = self.block_size, self.ns_list
        out = []
        for b, k, p, pc, i in zip(cached.tolist(), self.key[cached].tolist(), self.pkey[cached].tolist(),
                                  self.pcid[cached].tolist(), self.nsid[cached].tolist()):
            out.append(_stored_event([k], None if pc < 0 else p, self.tok[b].tolist(), bs, "GPU",
                                     ns[i] if ns else None))
        if self.tier is not None:
            out.extend(self.tier.snapshot_events())
        return out

    def mapping(self) -> dict[int, int]:
        """``key -> block`` of every cached block: the map plus the dict-less blocks. Changes nothing (for checks
        and tests). O(cached blocks)."""
        out = dict(self.map)
        if self.ndl:
            b = np.flatnonzero(self.dl)
            out.update(zip(self.key[b].tolist(), b.tolist()))
        return out

    def __len__(self) -> int:
        """Cached blocks (referenced or not)."""
        return len(self.map) + self.ndl

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

    def release_namespaces(self, keep: set, cpu_ident: np.ndarray | None = None) -> int:
        """Forget the namespaces nothing uses: no cached block chains from their root (GPU, or CPU rows of
        ``cpu_ident`` with a content id: the tier's and swapped blocks), and their encoding is not in ``keep``
        (the namespaces of live sequences). A namespace seen again later gets a new root (a new content id):
        blocks cached under the old one cannot be hit then, and none exists. Then :attr:`sweep_at` becomes twice
        the namespaces kept (at least 1024), so that memory stays proportional to the namespaces in use and the
        sweeps cost O(1) amortised per new namespace. Returns how many were released. O(blocks + namespaces)."""
        cached = self.cid != 0
        pc = self.pcid[cached]
        used = set(pc[pc < 0].tolist())
        ns_used = set(self.nsid[cached].tolist()) if self.nsid is not None else set()
        if cpu_ident is not None:
            held = cpu_ident[0] != 0
            pc = cpu_ident[2, held]
            used.update(pc[pc < 0].tolist())
            if self.nsid is not None:
                ns_used.update(cpu_ident[4, held].tolist())
        before = len(self.roots)
        self.roots = {d: r for d, r in self.roots.items() if r[0] in used or d in keep}
        for d, i in list(self._ns_ids.items()):
            if i not in ns_used and d not in keep:
                del self._ns_ids[d]
                self.ns_list[i] = None
                self._ns_free.append(i)
        self.sweep_at = max(_SWEEP_MIN, 2 * len(self.roots))
        return before - len(self.roots)

    # ------------------------------------------------------------------ lookup
    def find(self, pcid: int, pkey: int, data: bytes) -> tuple[int, int]:
        """``(block, key)``: the block caching ``data`` after parent ``(pcid, pkey)``, or -1, and the key of
        that content. O(1) plus one compare of ``data``."""
        if self.ndl:
            self.flush()
        key = _xxh3(data, seed=pkey)
        b = self.map.get(key, -1)
        if b >= 0 and (self.pcid[b] != pcid or self.tok[b].tobytes() != data):
            return -1, key  # hash collision: never a hit
        return b, key

    def lookup(self, cid: int, key: int) -> int:
        """Block currently caching exactly the content ``cid`` (known by its ``key``), or -1."""
        if self.ndl:
            self.flush()
        b = self.map.get(key, -1)
        return b if b >= 0 and self.cid[b] == cid else -1

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

    def _heirs(self, blocks: np.ndarray) -> list:
        """For evicted ``blocks`` (still cached): ``(i, d)`` for each ``blocks[i]`` of which a held copy ``d``
        takes the identity (see Copies); each such content's record keeps its other copies. A few numpy calls
        over ``blocks`` and the recorded contents, then O(1) a block whose content has copies."""
        dups, dupc, ref, tok = self.dups, self.dupc_mv, self.pool.ref_mv, self.tok
        cid = self.cid_mv
        cids = self.cid[blocks]
        rec = np.fromiter(dups.keys(), dtype=np.int64, count=len(dups))
        out = []
        for i in np.flatnonzero(np.isin(cids, rec)).tolist():  # (a few numpy calls, however many blocks)
            b = int(blocks[i])
            c = cid[b]
            got = dups.pop(c, None)
            if not got:
                continue
            for n, d in enumerate(got):
                if dupc[d] == c and ref[d] > 0 and cid[d] == 0 and d != b and np.array_equal(tok[d], tok[b]):
                    out.append((i, d))
                    rest = [x for x in got[n + 1 :] if dupc[x] == c]
                    if rest:
                        dups[c] = rest
                    break
        return out

    def _inherit(self, blocks: np.ndarray, heirs: list, cids: np.ndarray) -> np.ndarray:
        """Give each heir ``d`` of ``heirs`` (from :meth:`_heirs`) the identity of the evicted ``blocks[i]`` whose
        content id was ``cids[i]`` (the map side of their eviction done). Returns the mask of ``blocks`` whose
        content left the cache. O(len(heirs))."""
        gone = np.ones(blocks.size, dtype=bool)
        mp = self.map
        for i, d in heirs:
            b = int(blocks[i])
            k = self.key_mv[b]
            if mp.setdefault(k, d) != d:  # (the key is cached again already: nothing to inherit)
                continue
            self.cid_mv[d], self.key_mv[d], self.pcid_mv[d] = int(cids[i]), k, self.pcid_mv[b]
            self.succ_mv[d] = -1
            self.dupc_mv[d] = 0
            if self.fresh is not None:  # (its KV is written by this step's forward: never demoted in this step)
                self.fresh[d] = self.fresh_serial
            if self.events is not None:
                self.pkey[d], self.nsid[d] = self.pkey[b], self.nsid[b]
            gone[i] = False
        return gone

    def _parked(self, block: int) -> bool:
        """Whether the idle ``block`` is parked by a pin (steering.SteeredEvictor): it cannot be evicted, so its
        content stays cached, and the pin holds that very block. O(1)."""
        parked = getattr(self.evictor, "parked", None)
        return parked is not None and bool(parked[block])

    def live_parent(self, pcid: int, pkey: int) -> bool:
        """Whether the content ``pcid`` (key ``pkey``) is the one a lookup reaches under ``pkey``: a namespace root,
        the GPU block cached under ``pkey``, or, with no GPU block under it, the CPU tier's. A cached block under
        the key chained from ``pkey`` whose parent is another content is then unreachable (an orphan: its parent
        was evicted; a content id is never reused). Map already flushed. O(1)."""
        if pcid < 0:
            return True
        p = self.map.get(pkey)
        if p is not None:
            return self.cid_mv[p] == pcid
        if self.tier is not None:
            c = self.tier.map.get(pkey)
            return c is not None and self.tier.cpu_id[0, c] == pcid
        return False

    def _uncache(self, block: int) -> None:
        """Forget the cached content of ``block`` (in the map, map flushed): unreferenced, it goes to the free
        ring; held, it stays with its sequences, uncached. A ``BlockRemoved`` event. O(1)."""
        k = self.key_mv[block]
        del self.map[k]
        if self.dups:
            self.dups.pop(self.cid_mv[block], None)
        self.cid_mv[block] = 0
        self.succ_mv[block] = -1
        if self.events is not None:
            self.emit_removed([k], [int(self.nsid[block])], "GPU")
        if self.pool is not None and self.pool.ref_mv[block] == 0:
            self.evictor.discard(block)
            self.pool.give(np.array([block], dtype=np.int32))

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

    def adopt(self, block: int, cid: int, key: int, pcid: int, pkey: int = 0, namespace: object = None) -> bool:
        """Cache ``block`` (uncached, ``tok`` written) as the existing content ``cid`` (swap-in of a block that
        was cached before it left: blocks chained after it stay reachable). False when the key is taken."""
        if self.ndl:
            self.flush()
        if key in self.map:
            return False
        self.cid[block], self.key[block], self.pcid[block] = cid, key, pcid
        self.map[key] = block
        if self.fresh is not None:
            self.fresh[block] = self.fresh_serial
        if self.events is not None:
            self.emit_stored([block], [key], pcid, pkey, namespace)
        return True

    def adopt_many(self, blocks: np.ndarray, cids: np.ndarray, keys: np.ndarray, pcids: np.ndarray,
                   pkeys: np.ndarray, nsids: np.ndarray) -> None:
        """:meth:`adopt` of several blocks (promotions from the CPU tier; namespaces as indexes of this cache's
        namespace list). A block whose key is taken stays uncached, unless the block holding the key is an orphan
        (another parent): that one is uncached instead."""
        if self.ndl:
            self.flush()
        kl = keys.tolist()
        mp = self.map
        free = np.fromiter((k not in mp for k in kl), dtype=bool, count=len(kl))
        if not free.all():
            # a key held by a block of another parent: an orphan (the promoted content's parent is the one a lookup
            # just reached), replaced as registration replaces one (PrefixCache.register)
            for i in np.flatnonzero(~free).tolist():
                o = mp[kl[i]]
                if self.pcid_mv[o] != pcids[i]:
                    if self.pool is not None and self._parked(o):  # a pinned orphan: chained under the live
                        if self.tok[o].tobytes() == self.tok[blocks[i]].tobytes():  # parent, the promoted block
                            self.pcid_mv[o] = pcids[i]  # its copy (as register)
                            self.note_copy(int(blocks[i]), self.cid_mv[o], kl[i], int(pcids[i]))
                            if self.events is not None:
                                self.pkey[blocks[i]], self.nsid[blocks[i]] = pkeys[i], nsids[i]
                        continue
                    self._uncache(o)
                    free[i] = True
        if not free.all():
            blocks, cids, keys, pcids, pkeys, nsids = (a[free] for a in (blocks, cids, keys, pcids, pkeys, nsids))
            kl = keys.tolist()
        self.cid[blocks], self.key[blocks], self.pcid[blocks] = cids, keys, pcids
        mp.update(zip(kl, blocks.tolist()))
        if self.fresh is not None:
            self.fresh[blocks] = self.fresh_serial
        if self.events is not None:
            for b, k, pc, pk, i in zip(blocks.tolist(), kl, pcids.tolist(), pkeys.tolist(), nsids.tolist()):
                self.emit_stored([b], [k], pc, pk, self.ns_list[i] if self.ns_list else None)

    def withdraw(self, blocks: list[int]) -> None:
        """Uncache ``blocks`` (cached, referenced: their KV was never written). O(len(blocks))."""
        if self.ndl:
            self.flush()
        keys = [int(self.key[b]) for b in blocks]
        for k in keys:
            del self.map[k]
        if self.dups:  # (their copies' records go with them: a swapped-out copy carries no withdrawn content)
            dupc = self.dupc_mv
            for c in self.cid[blocks].tolist():
                for d in self.dups.pop(c, ()):
                    if dupc[d] == c:
                        dupc[d] = 0
        self.cid[blocks] = 0
        self.succ[blocks] = -1
        if self.events is not None and keys:
            self.emit_removed(keys, self.nsid[blocks], "GPU")

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

    def _evict_with_heirs(self, blocks: np.ndarray, heirs: list) -> np.ndarray:
        """:meth:`evict_many`'s eviction of ``blocks`` when held copies inherit some of their contents: those
        contents stay cached (no removal event, no demotion, not counted as evictions)."""
        if self.ndl:
            self._forget_runs(blocks)
        else:
            collections.deque(map(self.map.__delitem__, self.key[blocks].tolist()), maxlen=0)
        cids = self.cid[blocks].copy()
        self.cid[blocks] = 0
        gone = self._inherit(blocks, heirs, cids)
        out = blocks[gone]
        self.evictions += int(out.size)
        if self.events is not None and out.size:
            self.emit_removed(self.key[out].tolist(), self.nsid[out], "GPU")
        if self.tier is not None and out.size:
            self.tier.demote(out, cids[gone])
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

    def clear(self) -> list[int]:
        """Forget every cached content; return the unreferenced cached blocks (LRU first) for the free list."""
        if self.ndl:
            self.flush()
        self.succ[:] = -1
        self.dups.clear()
        self.dupc[:] = 0
        self.has_copies = False
        freed = list(self.evictor)
        self.evictor.discard_many(np.asarray(freed, dtype=np.int64))
        drop = getattr(self.evictor, "drop_pins", None)  # (pagedkv.retention.steering: pinned idle blocks are freed too)
        if drop is not None:
            freed += drop()
        self.cid[np.fromiter(self.map.values(), dtype=np.int64, count=len(self.map))] = 0
        self.map.clear()
        if self.events is not None:
            self.events.clear()  # nothing before the clear matters to a consumer any more
            self._ev_lost = False
            self.events.append(AllBlocksCleared())
        return freed
