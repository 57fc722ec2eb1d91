"""Prefix cache: content-addressed full blocks and the eviction order of the unreferenced ones.

A full block is identified by a chained key::

    root  = xxh3_64("pagedkv-ns:" + namespace)
    key_0 = xxh3_64(tokens of block 0, seed=root.key)
    key_i = xxh3_64(tokens of block i, seed=key_{i-1})

xxh3 is deterministic across processes and machines (no built-in ``hash()``). A key is only a lookup hint: each
cached block keeps a :class:`CacheEntry` holding its tokens and the entry of its parent, and a hit requires the
stored tokens to be equal and the stored parent to be *the same entry object* as the one verified one block
earlier (for block 0: the namespace's root entry). A hash collision therefore costs a miss, never another
sequence's KV.

Per-block state (flat, indexed by block id): ``_entry`` (list, ``CacheEntry`` or None) and the LRU links of
:class:`LRUEvictor` (two ``array('i')``). The map ``key -> block id`` is a dict keyed by content, not by block.
"""

from __future__ import annotations

from array import array
from operator import itemgetter
from typing import Iterator

import xxhash

from .errors import InvalidArgumentError

__all__ = ["CacheEntry", "LRUEvictor", "PrefixCache", "block_key"]

_xxh3 = xxhash.xxh3_64_intdigest


class CacheEntry(tuple):
    """Identity of a cached block's content: ``CacheEntry((key, parent, data))``. Immutable (a tuple): a block's
    key is written once, when it is cached. A plain tuple subclass rather than a NamedTuple because one is made
    for every block that fills, and this constructs in about half the time.

    ``key``: the chained key; ``parent``: the parent block's entry (None only for a namespace root); ``data``:
    the block's token ids as int32 bytes (for a root: the encoded namespace).
    """

    __slots__ = ()
    key: int = property(itemgetter(0))  # type: ignore[assignment]
    parent: "CacheEntry | None" = property(itemgetter(1))  # type: ignore[assignment]
    data: bytes = property(itemgetter(2))  # type: ignore[assignment]


def block_key(parent_key: int, data: bytes) -> int:
    """Key of a block with token bytes ``data`` whose parent block has key ``parent_key``."""
    return _xxh3(data, seed=parent_key)


def _encode_namespace(namespace: object) -> bytes:
    if namespace is None:
        return b""
    if isinstance(namespace, str):
        return b"s:" + namespace.encode("utf-8")
    if isinstance(namespace, bytes):
        return b"b:" + namespace
    if isinstance(namespace, int) and not isinstance(namespace, bool):
        return b"i:" + str(namespace).encode()
    raise InvalidArgumentError(f"namespace must be None, str, bytes or int, got {type(namespace).__name__}")


class LRUEvictor:
    """Unreferenced cached blocks, least recently released first; O(1) push, discard and pop.

    A doubly linked list threaded through two flat arrays indexed by block id; index ``num_blocks`` is the
    sentinel (its ``next`` is the LRU end, its ``prev`` the MRU end). This is the eviction-policy hook: another
    policy is another class with the same four methods.
    """

    __slots__ = ("_prev", "_next", "_head", "_len")

    def __init__(self, num_blocks: int) -> None:
        n = num_blocks + 1
        self._prev = array("i", bytes(4 * n))
        self._next = array("i", bytes(4 * n))
        self._head = num_blocks
        self._prev[num_blocks] = self._next[num_blocks] = num_blocks
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, block: int) -> None:
        """Make ``block`` the most recently used."""
        h, prev, nxt = self._head, self._prev, self._next
        last = prev[h]
        nxt[last] = block
        prev[block] = last
        nxt[block] = h
        prev[h] = block
        self._len += 1

    def discard(self, block: int) -> None:
        """Remove ``block`` (it is in the list)."""
        prev, nxt = self._prev, self._next
        p, n = prev[block], nxt[block]
        nxt[p] = n
        prev[n] = p
        self._len -= 1

    def pop(self) -> int:
        """Remove and return the least recently used block (the list is not empty)."""
        block = self._next[self._head]
        self.discard(block)
        return block

    def __iter__(self) -> Iterator[int]:
        """Blocks from least to most recently used."""
        h, nxt = self._head, self._next
        b = nxt[h]
        while b != h:
            yield b
            b = nxt[b]


class PrefixCache:
    """Map from content key to block id, each cached block's entry, and the evictor of unreferenced ones."""

    __slots__ = ("_map", "_entry", "evictor", "_roots", "evictions")

    def __init__(self, num_blocks: int) -> None:
        self._map: dict[int, int] = {}
        self._entry: list[CacheEntry | None] = [None] * num_blocks
        self.evictor = LRUEvictor(num_blocks)
        self._roots: dict[bytes, CacheEntry] = {}
        self.evictions = 0

    def root(self, namespace: object, intern: bool = True) -> CacheEntry:
        """The (interned) root entry of a namespace; block 0 of a prompt chains from it. With ``intern=False`` a
        namespace seen for the first time gets a fresh root that is not stored (no cached block chains from it;
        the caller stores it with ``_roots.setdefault(root.data, root)`` once it commits)."""
        data = _encode_namespace(namespace)
        r = self._roots.get(data)
        if r is None:
            r = CacheEntry((_xxh3(b"pagedkv-ns:" + data), None, data))
            if intern:
                self._roots[data] = r
        return r

    def find(self, parent: CacheEntry, data: bytes) -> int:
        """Block holding ``data`` after ``parent``, or -1. O(1) plus one compare of ``data``."""
        b = self._map.get(_xxh3(data, seed=parent.key), -1)
        if b >= 0:
            e = self._entry[b]
            if e.parent is not parent or e.data != data:
                return -1  # hash collision: never a hit
        return b

    def register(self, block: int, parent: CacheEntry, data: bytes) -> CacheEntry | None:
        """Cache ``block`` (full, its KV written) as ``data`` after ``parent``; return the entry that now stands
        for this content: the new one, or the existing one when another block already caches the same content
        (this block then stays uncached). None on a hash collision with different content (chain ends)."""
        return self.register_many([block], [parent], data, len(data))[0]

    def register_many(self, blocks: list[int], parents: list, raw: bytes, width: int) -> list:
        """:meth:`register` for a batch: block ``blocks[i]`` holds ``raw[i * width : (i + 1) * width]`` after
        ``parents[i]``. A None parent (broken chain) or a negative block (released) gives None; a block that is
        already cached gives its entry. About a microsecond per block."""
        out = []
        append, get, entry, mp = out.append, self._map.get, self._entry, self._map
        for i, (block, parent) in enumerate(zip(blocks, parents)):
            if parent is None or block < 0:
                append(None)
                continue
            e = entry[block]
            if e is None:
                data = raw[i * width : (i + 1) * width]
                key = _xxh3(data, seed=parent.key)
                other = get(key)
                if other is None:
                    e = entry[block] = CacheEntry((key, parent, data))
                    mp[key] = block
                else:
                    e = entry[other]
                    if e.parent is not parent or e.data != data:
                        e = None  # hash collision: never share
            append(e)
        return out

    def adopt(self, block: int, entry: CacheEntry) -> bool:
        """Cache ``block`` under an existing entry (swap-in of a block that was cached before it left). False
        when the key is taken."""
        if entry.key in self._map:
            return False
        self._entry[block] = entry
        self._map[entry.key] = block
        return True

    def lookup_entry(self, entry: CacheEntry) -> int:
        """Block currently cached under exactly this entry, or -1."""
        b = self._map.get(entry.key, -1)
        return b if b >= 0 and self._entry[b] is entry else -1

    def evict(self) -> int:
        """Evict the least recently used unreferenced block and return its id (now uncached)."""
        b = self.evictor.pop()
        del self._map[self._entry[b].key]
        self._entry[b] = None
        self.evictions += 1
        return b

    def clear(self) -> list[int]:
        """Forget every entry; return the unreferenced cached blocks (LRU first) for the free list."""
        freed = list(self.evictor)
        for b in freed:
            self.evictor.discard(b)
        for b in self._map.values():
            self._entry[b] = None
        self._map.clear()
        return freed
