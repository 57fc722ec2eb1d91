"""BlockStore: KV blocks in one backend, under their store names, checked on every load.

The store takes blocks by their chained content keys (:func:`pagedkv.block_hashes`) and namespace, names them
with its :class:`~pagedkv.tiers.ModelFingerprint` (:func:`~pagedkv.tiers.store_names`), wraps each payload in
the value format of :mod:`pagedkv.tiers.codec`, and on a load returns a payload only if its value checks: a value
corrupted, cut short, of another format version, or written for another fingerprint or name is **dropped** (the
backend is asked to discard it), **counted** (:attr:`BlockStore.stats`) and never returned. A load that passes the
blocks' check digests (:func:`~pagedkv.tiers.check_digests`, as the :class:`~pagedkv.tiers.connector.TierConnector`
always does) also refuses a value whose check digest is another prefix's (a 64-bit chain-key collision) or that has
none (``GetStatus.CHECK``, counted in ``check_refused``). A backend failure is counted and answered per block; no
method raises for what the store holds or whether it is up.

Thread-safe: the counters are updated under a lock; the backends are thread-safe. Payloads are bytes-like
(``bytes``, a C-contiguous numpy array); loads return read-only ``memoryview`` s (``np.frombuffer`` reads them
without a copy). Torch-free.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import NamedTuple, Sequence

from ..errors import InvalidArgumentError
from . import codec
from .backend import FAILED, Backend, PutStatus
from .key import ModelFingerprint, store_names

__all__ = ["BlockStore", "GetResult", "GetStatus", "TierStats"]

log = logging.getLogger("pagedkv.tiers")


class GetStatus(enum.IntEnum):
    """The outcome of loading one block."""

    HIT = 0  # the payload is returned
    MISS = 1  # nothing stored under the block's name
    CORRUPT = 2  # a value was stored but failed its checks (cut short, bad checksum, bad magic): dropped
    MISMATCH = 3  # an intact value of another fingerprint, name or format version: dropped
    ERROR = 4  # the store could not answer (down, I/O error, timeout)
    CHECK = 5  # an intact value of this name whose check digest is not the prefix's, or that has none: refused


class GetResult(NamedTuple):
    """Per-block answers of :meth:`BlockStore.get_many`, in the order asked."""

    statuses: tuple  # GetStatus per block
    values: tuple  # read-only memoryview of the payload for a HIT, None otherwise

    @property
    def hit_prefix(self) -> int:
        """The number of leading blocks that are hits (what a prefix can use). O(that number)."""
        n = 0
        for s in self.statuses:
            if s is not GetStatus.HIT:
                break
            n += 1
        return n


class TierStats(NamedTuple):
    """Counters of a :class:`BlockStore` since it was created (a snapshot)."""

    gets: int = 0  # blocks asked for by get_many
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # refused and dropped: cut short, bad checksum, bad magic
    mismatched: int = 0  # refused and dropped: another fingerprint / name / format version
    check_refused: int = 0  # refused: another prefix's check digest (kept: it is that prefix's) or none (dropped)
    read_errors: int = 0  # blocks the store could not answer (get_many and contains_many)
    bytes_read: int = 0  # payload bytes returned
    puts: int = 0  # blocks offered to put_many
    stored: int = 0
    present: int = 0  # already stored, nothing written
    full: int = 0  # not stored: the store was full
    too_large: int = 0
    write_errors: int = 0
    bytes_written: int = 0  # payload bytes of the stored blocks


class BlockStore:
    """KV blocks of one model fingerprint in one backend (see the module docstring).

    Args:
        backend: where the values live (:class:`~pagedkv.tiers.DiskBackend`, :class:`~pagedkv.tiers.SharedDirBackend`,
            :class:`~pagedkv.tiers.RedisBackend`, or any :class:`~pagedkv.tiers.Backend`).
        fingerprint: the model, dtype, block size, KV layout and KV cache group the blocks were computed with.
        payload_bytes: if given, the size every payload must have (one block's KV bytes); ``put_many`` refuses
            another size with :class:`pagedkv.InvalidArgumentError`, and a stored value of another size is
            refused as MISMATCH.
    """

    def __init__(self, backend: Backend, fingerprint: ModelFingerprint, payload_bytes: int | None = None, *,
                 track_removals: bool = False) -> None:
        if not isinstance(backend, Backend):
            raise InvalidArgumentError(f"backend must be a pagedkv.tiers.Backend, got {type(backend).__name__}")
        if not isinstance(fingerprint, ModelFingerprint):
            raise InvalidArgumentError(f"fingerprint must be a ModelFingerprint, got {type(fingerprint).__name__}")
        if payload_bytes is not None and (isinstance(payload_bytes, bool) or not isinstance(payload_bytes, int)
                                          or payload_bytes < 0):
            raise InvalidArgumentError(f"payload_bytes must be None or an int >= 0, got {payload_bytes!r}")
        self._backend = backend
        self._fp = fingerprint
        self._digest = fingerprint.digest
        self._payload_bytes = payload_bytes
        self._lock = threading.Lock()
        self._c = dict.fromkeys(TierStats._fields, 0)
        self._warned_errors = False
        # track_removals: name -> (chain key) of the blocks this store put or loaded, so that the values the
        # backend evicts (a backend with take_removed: DiskBackend) or this store drops can be published by
        # chain key (take_removed); names stored before a restart are unknown here and not published
        self._keys: dict | None = None
        self._dropped: list = []
        if track_removals:
            if hasattr(backend, "track_removed"):
                backend.track_removed = True
            # (the blocks a tagging backend found at start are known by chain key too: their removals are
            # published after a restart)
            self._keys = dict(self._restored())

    @property
    def fingerprint(self) -> ModelFingerprint:
        return self._fp

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def medium(self) -> str:
        return self._backend.medium

    @property
    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**self._c)

    def names(self, chain_keys, namespace: object = None) -> list[str]:
        """The store names of these blocks (:func:`~pagedkv.tiers.store_names` with this store's fingerprint)."""
        return store_names(self._fp, chain_keys, namespace)

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._c[k] += v

    def _backend_failed(self, what: str, e: BaseException) -> None:
        if not self._warned_errors:  # a broken backend must not stop requests; say it once
            self._warned_errors = True
            log.warning("pagedkv tier %s: %s raised %s: %s (answered as failed; counted in stats)",
                        self.medium, what, type(e).__name__, e)

    def _restored(self) -> list:
        got = getattr(self._backend, "restored_tags", None)
        try:
            return list(got()) if got is not None else []
        except Exception:  # noqa: BLE001
            return []

    def restored_keys(self) -> list[int]:
        """The chain keys of the blocks the backend found when it opened (a backend that keeps tags: the
        :class:`~pagedkv.tiers.DiskBackend` rebuilds its index from the directory), oldest first; [] for one that
        does not (Redis, a shared directory). What a restarted engine publishes as stored (medium DISK). Only the
        blocks stored under this store's fingerprint (with KV cache groups several stores share one backend: each
        names its own group's blocks). O(blocks)."""
        got = self._restored()
        if not got:
            return []
        mine = self.names([k for _, k in got])
        return [k for (n, k), m in zip(got, mine) if n == m]

    def take_removed(self) -> list[int]:
        """The chain keys of the blocks that left this store since the last call (evicted by the backend, found
        gone, or dropped as corrupt or mismatched) among those this store put or loaded; [] without
        ``track_removals``. O(removed)."""
        if self._keys is None:
            return []
        take = getattr(self._backend, "take_removed", None)
        names = take() if take is not None else []
        with self._lock:
            out, self._dropped = self._dropped, []
            keys = self._keys
            out += [k for k in (keys.pop(n, None) for n in names) if k is not None]
            return out

    def _remember(self, names, chain_keys, ok) -> None:
        if self._keys is not None:
            with self._lock:
                for n, k, good in zip(names, chain_keys, ok):
                    if good:
                        self._keys[n] = int(k)

    def get_many(self, chain_keys, namespace: object = None, checks=None) -> GetResult:
        """Load the blocks with chained keys ``chain_keys`` of ``namespace``: one status and value per block
        (see :class:`GetStatus`). ``checks``: the blocks' check digests (:func:`~pagedkv.tiers.check_digests`,
        one per key): a value is returned only if it carries the same (None: not compared; the chain key alone
        names the block). Refused values are discarded from the backend, except a value with another check
        digest (another prefix's block). Raises only on bad arguments (:class:`pagedkv.InvalidArgumentError`,
        before any I/O). O(blocks + payload bytes)."""
        names = self.names(chain_keys, namespace)
        checks = _checks(checks, len(names))
        try:
            raw = self._backend.read_many(names)
        except Exception as e:  # noqa: BLE001 - fail soft, counted
            self._backend_failed("read_many", e)
            raw = [FAILED] * len(names)
        statuses, values, drop = [], [], []
        hits = misses = corrupt = mismatched = refused = errors = nbytes = 0
        want = self._payload_bytes
        for i, (name, v) in enumerate(zip(names, raw)):
            if v is None:
                statuses.append(GetStatus.MISS)
                values.append(None)
                misses += 1
                continue
            if v is FAILED or not isinstance(v, (bytes, bytearray, memoryview)):
                statuses.append(GetStatus.ERROR)
                values.append(None)
                errors += 1
                continue
            why, payload = codec.decode(v, self._digest, name, None if checks is None else checks[i])
            if why is codec.Decoded.OK and want is not None and payload.nbytes != want:
                why = codec.Decoded.MISMATCH
            if why is codec.Decoded.OK:
                statuses.append(GetStatus.HIT)
                values.append(payload)
                hits += 1
                nbytes += payload.nbytes
            elif why is codec.Decoded.CHECK:
                statuses.append(GetStatus.CHECK)
                values.append(None)
                refused += 1
                if not codec.has_check(v):
                    drop.append(name)  # no check digest: no checked load can ever use it
            else:
                st = GetStatus.CORRUPT if why is codec.Decoded.CORRUPT else GetStatus.MISMATCH
                statuses.append(st)
                values.append(None)
                drop.append(name)
                if st is GetStatus.CORRUPT:
                    corrupt += 1
                else:
                    mismatched += 1
        if corrupt or mismatched or refused:  # one line per refused value (counted in stats too)
            for name, st in zip(names, statuses):
                if st in _REFUSED:
                    log.warning("pagedkv tier %s: refused the stored KV block %s (%s); it is computed instead",
                                self.medium, name, _REFUSED[st])
        if drop:
            try:
                self._backend.discard_many(drop)
            except Exception as e:  # noqa: BLE001
                self._backend_failed("discard_many", e)
            if self._keys is not None:  # (by chain key: known here even for a value stored before a restart)
                gone = set(drop)
                with self._lock:
                    for n, k in zip(names, chain_keys):
                        if n in gone:
                            self._keys.pop(n, None)
                            self._dropped.append(int(k))
        if self._keys is not None:
            self._remember(names, chain_keys, [s is GetStatus.HIT for s in statuses])
        self._count(gets=len(names), hits=hits, misses=misses, corrupt=corrupt, mismatched=mismatched,
                    check_refused=refused, read_errors=errors, bytes_read=nbytes)
        return GetResult(tuple(statuses), tuple(values))

    def put_many(self, chain_keys, payloads: Sequence, namespace: object = None, checks=None,
                 parents=None) -> tuple:
        """Store ``payloads[i]`` (bytes-like) as the block with chained key ``chain_keys[i]`` of ``namespace``
        and check digest ``checks[i]`` (:func:`~pagedkv.tiers.check_digests`; None: stored without one, and a
        load that passes check digests refuses it): one :class:`~pagedkv.tiers.PutStatus` per block. A block
        already stored is not rewritten (PRESENT). ``parents``: each block's parent chain key (None: a
        namespace's first block, or not known), handed to a backend that orders its evictions by chain
        (``accepts_parents``: :class:`~pagedkv.tiers.DiskBackend` evicts a chain's tail before its head).
        Raises only on bad arguments (before any I/O). O(blocks + payload bytes)."""
        names = self.names(chain_keys, namespace)
        pnames = None
        if parents is not None and getattr(self._backend, "accepts_parents", False):
            if len(parents) != len(names):
                raise InvalidArgumentError(f"{len(names)} chain keys but {len(parents)} parent keys")
            known = [i for i, k in enumerate(parents) if k is not None]
            pnames = [None] * len(names)
            for i, n in zip(known, self.names([int(parents[i]) for i in known], namespace)):
                pnames[i] = n
        checks = _checks(checks, len(names))
        if len(payloads) != len(names):
            raise InvalidArgumentError(f"{len(names)} chain keys but {len(payloads)} payloads")
        views = []
        for p in payloads:
            try:
                mv = memoryview(p)
            except TypeError:
                raise InvalidArgumentError(f"a payload must be bytes-like, got {type(p).__name__}") from None
            if not mv.c_contiguous:
                raise InvalidArgumentError("a payload must be C-contiguous")
            if self._payload_bytes is not None and mv.nbytes != self._payload_bytes:
                raise InvalidArgumentError(f"a payload has {mv.nbytes} bytes, this store's blocks have "
                                           f"{self._payload_bytes}")
            views.append(mv)
        values = [codec.encode(self._digest, n, mv, None if checks is None else checks[i])
                  for i, (n, mv) in enumerate(zip(names, views))]
        try:
            got = self._backend.write_many(names, values) if pnames is None else \
                self._backend.write_many(names, values, pnames)
            out = [PutStatus(s) for s in got]
            if len(out) != len(names):
                raise RuntimeError(f"write_many answered {len(out)} statuses for {len(names)} values")
        except Exception as e:  # noqa: BLE001 - fail soft, counted
            self._backend_failed("write_many", e)
            out = [PutStatus.ERROR] * len(names)
        c = dict.fromkeys(("stored", "present", "full", "too_large", "write_errors"), 0)
        field = {PutStatus.STORED: "stored", PutStatus.PRESENT: "present", PutStatus.FULL: "full",
                 PutStatus.TOO_LARGE: "too_large", PutStatus.ERROR: "write_errors"}
        nbytes = 0
        for s, mv in zip(out, views):
            c[field[s]] += 1
            if s is PutStatus.STORED:
                nbytes += mv.nbytes
        self._count(puts=len(names), bytes_written=nbytes, **c)
        if self._keys is not None:
            self._remember(names, chain_keys, [s is PutStatus.STORED or s is PutStatus.PRESENT for s in out])
        tag = getattr(self._backend, "record_tags", None)
        if tag is not None and c["stored"]:  # (the chain key of each value, found again after a restart)
            new = [i for i, s in enumerate(out) if s is PutStatus.STORED]
            try:
                tag([names[i] for i in new], [int(chain_keys[i]) for i in new])
            except Exception as e:  # noqa: BLE001
                self._backend_failed("record_tags", e)
        return tuple(out)

    def contains_many(self, chain_keys, namespace: object = None) -> tuple:
        """For each block: whether a value is stored under its name (False when the store could not answer,
        counted as a read error). A True is a hint: the value is checked only when loaded."""
        names = self.names(chain_keys, namespace)
        try:
            raw = self._backend.exists_many(names)
        except Exception as e:  # noqa: BLE001
            self._backend_failed("exists_many", e)
            raw = [None] * len(names)
        errors = sum(1 for r in raw if r is None)
        if errors:
            self._count(read_errors=errors)
        return tuple(bool(r) for r in raw)

    def prefix_length(self, chain_keys, namespace: object = None) -> int:
        """How many leading blocks of a chain the store holds (:meth:`contains_many`'s leading Trues)."""
        n = 0
        for r in self.contains_many(chain_keys, namespace):
            if not r:
                break
            n += 1
        return n

    def close(self) -> None:
        self._backend.close()


_REFUSED = {GetStatus.CORRUPT: "corrupt or cut short: dropped",
            GetStatus.MISMATCH: "written for another model, block size or format version: dropped",
            GetStatus.CHECK: "its check digest is another prefix's, or it has none"}


def _checks(checks, n: int):
    """``checks`` as a list of n ints in [0, 2**64), or None; raises InvalidArgumentError otherwise."""
    if checks is None:
        return None
    try:
        out = [int(c) for c in checks]
    except (TypeError, ValueError):
        raise InvalidArgumentError("checks must be a sequence of ints (check digests)") from None
    if len(out) != n:
        raise InvalidArgumentError(f"{n} chain keys but {len(out)} check digests")
    if any(c < 0 or c >= 1 << 64 for c in out):
        raise InvalidArgumentError("check digests must be ints in [0, 2**64)")
    return out
