"""DiskBackend: a local directory of KV values, bounded in bytes, evicting chains tail first, surviving restarts.

One process owns the directory (an exclusive ``flock`` on ``<root>/.lock``; a second opener gets
:class:`TierInUseError`), so the in-memory index is the truth between restarts:

- **index**: a map ``name -> size``, plus the values being written (reserved, not yet readable). ``used_bytes``
  = their sizes' sum, always ``<= capacity_bytes``: a put first evicts values (deleting their files) until its
  value fits.
- **eviction order** (:class:`~pagedkv.tiers.chain_order.ChainOrder`): a put may name each value's parent (the
  store name of the block before it in its chain; :meth:`BlockStore.put_many` passes them): values whose parent
  is gone go first (no load can reach them), then *leaves* (values none of whose children is stored), least
  recently used first (a read or a re-put makes a value the most recent): a prompt's chain is evicted from its
  tail, and the first blocks of every prompt, which every hit needs, stay longest. A value without a parent is a
  root (plain LRU). A put that would have to evict its own parent is refused (FULL), and so are the puts of its
  descendants that follow (the last 4096 refused names are remembered): they would be dead weight. A value whose
  parent was never here is kept as a live block (a write-back sends a chain's tail before its head). O(log
  values) per value plus the evictions.
- **restart**: the index is rebuilt from the files (values in the order of their modification times, i.e. the
  order they were stored) and the parents from ``<root>/parents.log`` (32-byte records, the name's 16 bytes and
  the parent's, appended per put, not fsynced: a lost record makes a root; rewritten at start with the records
  of the values found); temporary files (a write cut by a crash) are deleted; values beyond the bound are
  evicted in the order above. O(files).
- **read-only** (``read_only=True``, or a directory this process cannot write: :func:`open_mode`): a
  pre-filled tier is served as it is: no lock file (several read-only servers may share it; nobody may write it
  meanwhile), no eviction, no tag or parent log rewrite, every put answered FULL.
- **writes** are atomic (:mod:`pagedkv.tiers._files`): temporary file, ``fsync`` if ``fsync=True`` (the
  default; without it a power loss can leave a value short or empty, which the checksum then refuses), rename.
- **disk full** (ENOSPC / EDQUOT): the write is dropped (FULL), one warning is logged, and no write is tried for
  ``full_retry_s`` seconds (each refused one counted in ``disk_full_events``); reads go on.
- a value file deleted behind the index's back reads as a miss (and leaves the index).
- **tags** (:meth:`DiskBackend.record_tags`): a caller may attach an 8-byte tag to each value it stored (a
  :class:`~pagedkv.tiers.BlockStore` attaches the block's chain key, which its store name hides): appended to
  ``<root>/tags.log`` (24-byte records: the name's 16 bytes, the tag), not fsynced (a record lost in a crash only
  loses that value's tag). At restart the values found that have a tag are :meth:`restored_tags` (oldest first),
  and the log is rewritten with their records alone (atomic rename), so it holds at most one record per value
  stored since the last start plus one per value found then. O(records) at start, O(1) per tag.
- after :meth:`DiskBackend.close` (the lock released: another backend may own the directory) every call answers
  as failed.

Thread-safe: the index under a lock, file I/O outside it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from typing import Sequence

from ..errors import InvalidArgumentError, PagedKVError
from . import _files
from .backend import FAILED, Backend, PutStatus
from .chain_order import ChainOrder

__all__ = ["DiskBackend", "TierInUseError", "open_mode"]

_TAGS = "tags.log"
_TAG_RECORD = 24  # the name's 16 bytes, the tag's 8 (little-endian)
_PARENTS = "parents.log"
_PARENT_RECORD = 32  # the name's 16 bytes, the parent's 16
_MAX_REFUSED = 4096  # names of values refused as orphans remembered (their children refused too), oldest dropped


def open_mode(path: str | os.PathLike) -> str:
    """How a disk tier at ``path`` can be opened: ``"rw"`` (an existing writable directory, or one that can be
    created), ``"ro"`` (an existing directory this process can read but not write: read-only filesystem,
    permissions, immutable). Raises :class:`NotADirectoryError` (a file is there), :class:`PermissionError`
    (not readable, or absent and not creatable) with a one-line reason. O(1); creates nothing."""
    p = os.fspath(path)
    if os.path.exists(p):
        if not os.path.isdir(p):
            raise NotADirectoryError(errno.ENOTDIR, "a file, not a directory", p)
        if not os.access(p, os.R_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "the directory is not readable", p)
        if not os.access(p, os.W_OK):
            return "ro"
        probe = os.path.join(p, f".probe.{os.getpid()}{_files.TMP_SUFFIX}")  # (EROFS, immutable: access lies)
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(probe)
        except FileExistsError:
            pass
        except OSError:
            return "ro"
        return "rw"
    parent = os.path.dirname(os.path.abspath(p))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(errno.ENOTDIR, "a file lies on the path", parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "the directory does not exist and cannot be created here", p)
    return "rw"


class TierInUseError(PagedKVError, RuntimeError):
    """The disk tier's directory is already open in another DiskBackend (this or another process)."""


class DiskBackend(Backend):
    """A local disk tier (see the module docstring).

    Args:
        path: the directory (created if absent).
        capacity_bytes: the most bytes its values may take (>= 1).
        fsync: fsync each value (and its folder) before it becomes readable.
        full_retry_s: after a disk-full error, how long to store nothing.
        read_only: serve the values found, write nothing (see the module docstring); None: read-only exactly when
            the directory exists and is not writable (:func:`open_mode`).
    """

    medium = "disk"

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, *, fsync: bool = True,
                 full_retry_s: float = 30.0, read_only: bool | None = None) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise InvalidArgumentError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        if not full_retry_s >= 0:
            raise InvalidArgumentError(f"full_retry_s must be >= 0, got {full_retry_s!r}")
        self._root = os.fspath(path)
        if read_only is None:
            read_only = open_mode(self._root) == "ro"
        self._ro = bool(read_only)
        self._lockfd = -1
        if not self._ro:
            os.makedirs(self._root, exist_ok=True)
            self._lockfd = os.open(os.path.join(self._root, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self._lockfd)
                raise TierInUseError(
                    f"the disk tier directory {self._root} is in use by another server or process (one owner at a "
                    "time; to share KV blocks between replicas use --kv-shared file:///DIR or redis://HOST:PORT, "
                    "or give each server its own --kv-disk-dir)") from None
        elif not os.path.isdir(self._root):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", self._root)
        self._cap = capacity_bytes
        self._fsync = bool(fsync)
        self._full = _files.DiskFullState(full_retry_s, f"disk tier {self._root!r}")
        self._lock = threading.Lock()
        self._index: dict[str, int] = {}
        self._order = ChainOrder()
        self._pending: dict[str, int] = {}
        self._used = 0
        self._evictions = 0
        self._cleaned_tmp = 0
        self._closed = False
        #: record the names of evicted / vanished values for :meth:`take_removed` (set by a BlockStore that
        #: publishes a tier's removals; off by default so that nothing accumulates)
        self.track_removed = False
        self._removed: list[str] = []
        self._tags_fd = self._parents_fd = -1
        self._restored: list[tuple[str, int]] = []
        self._refused_orphans = 0
        self._refused: dict[str, None] = {}  # names refused as orphans lately (their children are refused too)
        self._rebuild()
        self._load_tags()

    # -- restart ------------------------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        found = []
        for sub in os.scandir(self._root):
            if not (sub.is_dir(follow_symlinks=False) and len(sub.name) == 2):
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(_files.TMP_SUFFIX):
                    if self._ro:
                        continue
                    try:
                        os.unlink(e.path)
                        self._cleaned_tmp += 1
                    except OSError:
                        pass
                    continue
                name = e.name[: -len(_files.SUFFIX)]
                if e.name.endswith(_files.SUFFIX) and _files.is_name(name) and name[:2] == sub.name:
                    st = e.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, name, st.st_size))
        found.sort()
        parents = {}
        for rec in self._read_log(_PARENTS, _PARENT_RECORD):
            parents[rec[:16].hex()] = rec[16:].hex()
        for _, name, size in found:
            self._index[name] = size
            self._used += size
        for _, name, _s in found:  # (mtime order: parents were stored before their children)
            self._order.add(name, parents.get(name), orphan=True)
        if not self._ro:
            self._parents_fd = self._rewrite_log(_PARENTS, b"".join(
                bytes.fromhex(n) + bytes.fromhex(parents[n]) for _, n, _s in found if n in parents))
            victims = self._evict_locked(0)
            self._unlink(victims)

    def _read_log(self, fname: str, reclen: int) -> list[bytes]:
        """The whole records of ``<root>/fname`` (a record cut by a crash, at the end, is ignored)."""
        try:
            with open(os.path.join(self._root, fname), "rb") as f:
                data = f.read()
        except OSError:
            return []
        return [data[i * reclen:(i + 1) * reclen] for i in range(len(data) // reclen)]

    def _rewrite_log(self, fname: str, data: bytes) -> int:
        """Replace ``<root>/fname`` with ``data`` (atomic rename); its fd opened for appends, or -1 when the
        directory cannot be written (the log is then not kept; the values still work)."""
        path = os.path.join(self._root, fname)
        try:
            tmp = path + _files.TMP_SUFFIX
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            return os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError:
            return -1

    def _load_tags(self) -> None:
        """Read the tag log: the tags of the values found (:meth:`restored_tags`); rewrite it with those alone."""
        tags = {}
        for rec in self._read_log(_TAGS, _TAG_RECORD):
            tags[rec[:16].hex()] = int.from_bytes(rec[16:], "little")
        self._restored = [(n, tags[n]) for n in self._index if n in tags]
        if not self._ro:  # (a read-only or full directory: no tags; the values still work)
            self._tags_fd = self._rewrite_log(_TAGS, b"".join(bytes.fromhex(n) + t.to_bytes(8, "little")
                                                                 for n, t in self._restored))

    def restored_tags(self) -> list[tuple[str, int]]:
        """``(name, tag)`` of the values found at start that had a tag (:meth:`record_tags`), oldest first (the
        index's order then; some may have been evicted since). O(values)."""
        return list(self._restored)

    def record_tags(self, names: Sequence[str], tags: Sequence[int]) -> None:
        """Attach ``tags[i]`` (an int in [0, 2**64)) to the stored value ``names[i]``: given back by
        :meth:`restored_tags` after a restart while the value is still there. One append; never raises for the
        state of the disk (a tag that cannot be written is lost). O(len(names))."""
        if self._closed or self._tags_fd < 0 or not len(names):
            return
        rec = b"".join(bytes.fromhex(n) + int(t).to_bytes(8, "little") for n, t in zip(names, tags, strict=True))
        with self._lock:
            try:
                os.write(self._tags_fd, rec)
            except OSError:
                pass

    # -- properties ---------------------------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._root

    @property
    def capacity_bytes(self) -> int:
        return self._cap

    @property
    def used_bytes(self) -> int:
        """Bytes of the stored values plus those being written."""
        return self._used

    @property
    def num_values(self) -> int:
        return len(self._index)

    @property
    def evictions(self) -> int:
        return self._evictions

    @property
    def cleaned_tmp(self) -> int:
        """Temporary files (writes cut by a crash) deleted when the index was rebuilt."""
        return self._cleaned_tmp

    @property
    def disk_full_events(self) -> int:
        """Writes that failed with a full disk, or were refused while it was deemed full."""
        return self._full.events

    @property
    def disk_full(self) -> bool:
        """Whether writes are stopped now after a disk-full error."""
        return self._full.active

    # -- the interface ------------------------------------------------------------------------------------------
    def _evict_locked(self, need: int, parent: str | None = None, new: str | None = None) -> list[str] | None:
        """Pop values in the eviction order (orphans, then leaves, least recently used first) until ``need``
        more bytes fit; the names whose files to delete. ``parent``: the parent of the value ``new`` to be
        stored: if it is the next victim, stop and answer None (the caller refuses the put; the values popped
        before stay popped: they were next anyway); ``new``'s own children are spared (no longer orphans once
        it is stored)."""
        victims = []
        order = self._order
        while self._used + need > self._cap and self._index:
            name = order.victim(new)
            if name is None or (parent is not None and name == parent):
                self._note_victims(victims)
                return None
            order.remove(name)
            self._used -= self._index.pop(name)
            self._evictions += 1
            victims.append(name)
        self._note_victims(victims)
        return victims

    def _refuse_locked(self, name: str) -> None:
        self._refused_orphans += 1
        self._refused[name] = None
        if len(self._refused) > _MAX_REFUSED:
            del self._refused[next(iter(self._refused))]

    def _note_victims(self, victims: list) -> None:
        if victims and self.track_removed:
            self._removed.extend(victims)

    def _forget_locked(self, name: str) -> bool:
        size = self._index.pop(name, None)
        if size is None:
            return False
        self._order.remove(name)
        self._used -= size
        return True

    def eviction_order(self) -> list[str]:
        """The stored names, the next to be evicted first (tests, tools). O(values log values)."""
        with self._lock:
            return self._order.eviction_order()

    @property
    def read_only(self) -> bool:
        """Whether this backend serves the values found and writes nothing (see the module docstring)."""
        return self._ro

    @property
    def refused_orphans(self) -> int:
        """Puts refused because the value's parent was the next victim, or was refused before (dead weight: no
        load could reach the value)."""
        return self._refused_orphans

    def take_removed(self) -> list[str]:
        """The names evicted (LRU, to make room) or found gone since the last call, with ``track_removed`` on.
        O(names)."""
        with self._lock:
            out, self._removed = self._removed, []
        return out

    def _unlink(self, names) -> None:
        for name in names:
            try:
                os.unlink(_files.value_path(self._root, name))
            except FileNotFoundError:
                pass
            except OSError:
                pass

    def read_many(self, names: Sequence[str]) -> list:
        if self._closed:  # the directory may belong to another backend now
            return [FAILED] * len(names)
        out = []
        for name in names:
            with self._lock:
                if name not in self._index:
                    out.append(None)
                    continue
                self._order.touch(name)
            try:
                v = _files.read_value(self._root, name)
            except OSError:
                out.append(FAILED)
                continue
            if v is None:  # deleted behind our back: forget it
                with self._lock:
                    if self._forget_locked(name) and self.track_removed:
                        self._removed.append(name)
            out.append(v)
        return out

    #: write_many takes ``parents`` (the store name of each value's parent, None for a root or unknown)
    accepts_parents = True

    def write_many(self, names: Sequence[str], values: Sequence[bytes],
                   parents: Sequence[str | None] | None = None) -> list[PutStatus]:
        if self._closed:
            return [PutStatus.ERROR] * len(names)
        if self._ro:
            return [PutStatus.PRESENT if n in self._index else PutStatus.FULL for n in names]
        if parents is None:
            parents = [None] * len(names)
        out = []
        logged = []
        for name, value, parent in zip(names, values, parents, strict=True):
            size = len(value)
            if parent == name:
                parent = None
            with self._lock:
                if name in self._index:
                    self._order.touch(name)
                    out.append(PutStatus.PRESENT)
                    continue
                if name in self._pending:
                    out.append(PutStatus.PRESENT)
                    continue
                if size > self._cap:
                    out.append(PutStatus.TOO_LARGE)
                    continue
                if self._full.refuse():
                    out.append(PutStatus.FULL)
                    continue
                if parent is not None and parent in self._refused and parent not in self._index:
                    self._refuse_locked(name)  # its parent was refused: no load could reach it
                    out.append(PutStatus.FULL)
                    continue
                victims = self._evict_locked(size, parent, name)
                if victims is None:  # its own parent was next: storing it would cut its chain
                    self._refuse_locked(name)
                    out.append(PutStatus.FULL)
                    continue
                self._refused.pop(name, None)
                self._pending[name] = size
                self._used += size
                self._unlink(victims)  # under the lock: a re-put of a victim cannot race its deletion
            try:
                _files.write_atomic(self._root, name, value, self._fsync)
            except OSError as e:
                with self._lock:
                    del self._pending[name]
                    self._used -= size
                if _files.is_disk_full(e):
                    self._full.hit(e)
                    out.append(PutStatus.FULL)
                else:
                    out.append(PutStatus.ERROR)
                continue
            with self._lock:
                del self._pending[name]
                self._index[name] = size
                self._order.add(name, parent)
            if parent is not None:
                logged.append(bytes.fromhex(name) + bytes.fromhex(parent))
            out.append(PutStatus.STORED)
        if logged and self._parents_fd >= 0:
            with self._lock:
                try:
                    os.write(self._parents_fd, b"".join(logged))
                except OSError:  # (a lost record makes a root after a restart)
                    pass
        return out

    def exists_many(self, names: Sequence[str]) -> list:
        if self._closed:
            return [None] * len(names)
        with self._lock:
            return [name in self._index for name in names]

    def discard_many(self, names: Sequence[str]) -> None:
        if self._closed:
            return
        if self._ro:
            return
        with self._lock:
            gone = [name for name in names if self._forget_locked(name)]
            self._unlink(gone)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with self._lock:
                for fd in (self._tags_fd, self._parents_fd):
                    if fd >= 0:
                        os.close(fd)
                self._tags_fd = self._parents_fd = -1
            if self._lockfd >= 0:
                try:
                    fcntl.flock(self._lockfd, fcntl.LOCK_UN)
                finally:
                    os.close(self._lockfd)

    def __del__(self) -> None:  # a forgotten backend must not keep the directory locked
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def check_invariants(self, files: bool = True) -> None:
        """Assert the index's invariants: ``used_bytes`` is the sum of the indexed and pending sizes and at most
        the capacity (read-only: what was found); no name both indexed and pending; the eviction order holds the
        indexed names; with ``files``, every indexed value's file exists with its
        size (O(values) stats; only valid while no other thread writes)."""
        with self._lock:
            total = sum(self._index.values()) + sum(self._pending.values())
            assert total == self._used, (total, self._used)
            assert self._ro or self._used <= self._cap, (self._used, self._cap)
            assert not (self._index.keys() & self._pending.keys())
            assert len(self._order) == len(self._index) and all(n in self._order for n in self._index)
            self._order.check_invariants()
            items = list(self._index.items())
        if files:
            for name, size in items:
                st = os.stat(_files.value_path(self._root, name))
                assert st.st_size == size, (name, st.st_size, size)
