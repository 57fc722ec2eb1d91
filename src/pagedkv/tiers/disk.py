"""DiskBackend: a local directory of KV values, bounded in bytes, LRU, surviving restarts.

One process owns the directory (an exclusive ``flock`` on ``<root>/.lock``; a second opener gets
:class:`TierInUseError`), so the in-memory index is the truth between restarts:

- **index**: an ordered map ``name -> size`` in LRU order (a read or a re-put makes a value the most recent),
  plus the values being written (reserved, not yet readable). ``used_bytes`` = their sizes' sum, always
  ``<= capacity_bytes``: a put first evicts least recently used values (deleting their files) until its value
  fits. O(1) per value plus the evictions.
- **restart**: the index is rebuilt from the files (values in the order of their modification times, i.e. the
  order they were stored); temporary files (a write cut by a crash) are deleted; values beyond the bound are
  evicted, oldest first. O(files).
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

import collections
import fcntl
import os
import threading
from typing import Sequence

from ..errors import InvalidArgumentError, PagedKVError
from . import _files
from .backend import FAILED, Backend, PutStatus

__all__ = ["DiskBackend", "TierInUseError"]

_TAGS = "tags.log"
_TAG_RECORD = 24  # the name's 16 bytes, the tag's 8 (little-endian)


class TierInUseError(PagedKVError, RuntimeError):
    """The disk tier's directory is already open in another DiskBackend (this or another process)."""


class DiskBackend(Backend):
    """A local disk tier (see the module docstring).

    Args:
        path: the directory (created if absent).
        capacity_bytes: the most bytes its values may take (>= 1).
        fsync: fsync each value (and its folder) before it becomes readable.
        full_retry_s: after a disk-full error, how long to store nothing.
    """

    medium = "disk"

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, *, fsync: bool = True,
                 full_retry_s: float = 30.0) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise InvalidArgumentError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        if not full_retry_s >= 0:
            raise InvalidArgumentError(f"full_retry_s must be >= 0, got {full_retry_s!r}")
        self._root = os.fspath(path)
        os.makedirs(self._root, exist_ok=True)
        self._lockfd = os.open(os.path.join(self._root, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lockfd)
            raise TierInUseError(f"the disk tier {self._root!r} is open in another DiskBackend") from None
        self._cap = capacity_bytes
        self._fsync = bool(fsync)
        self._full = _files.DiskFullState(full_retry_s, f"disk tier {self._root!r}")
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._pending: dict[str, int] = {}
        self._used = 0
        self._evictions = 0
        self._cleaned_tmp = 0
        self._closed = False
        #: record the names of evicted / vanished values for :meth:`take_removed` (set by a BlockStore that
        #: publishes a tier's removals; off by default so that nothing accumulates)
        self.track_removed = False
        self._removed: list[str] = []
        self._tags_fd = -1
        self._restored: list[tuple[str, int]] = []
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
        for _, name, size in found:
            self._index[name] = size
            self._used += size
        victims = self._evict_locked(0)
        self._unlink(victims)

    def _load_tags(self) -> None:
        """Read the tag log: the tags of the values found (:meth:`restored_tags`); rewrite it with those alone."""
        path = os.path.join(self._root, _TAGS)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        except OSError:
            data = b""
        tags = {}
        for i in range(len(data) // _TAG_RECORD):  # (a record cut by a crash, at the end, is ignored)
            rec = data[i * _TAG_RECORD:(i + 1) * _TAG_RECORD]
            tags[rec[:16].hex()] = int.from_bytes(rec[16:], "little")
        self._restored = [(n, tags[n]) for n in self._index if n in tags]
        try:
            tmp = path + _files.TMP_SUFFIX
            with open(tmp, "wb") as f:
                f.write(b"".join(bytes.fromhex(n) + t.to_bytes(8, "little") for n, t in self._restored))
            os.replace(tmp, path)
            self._tags_fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError:  # (a read-only or full directory: no tags; the values still work)
            self._tags_fd = -1

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
    def _evict_locked(self, need: int) -> list[str]:
        """Pop least recently used values until ``need`` more bytes fit; the names whose files to delete."""
        victims = []
        while self._used + need > self._cap and self._index:
            name, size = self._index.popitem(last=False)
            self._used -= size
            self._evictions += 1
            victims.append(name)
        if victims and self.track_removed:
            self._removed.extend(victims)
        return victims

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
                self._index.move_to_end(name)
            try:
                v = _files.read_value(self._root, name)
            except OSError:
                out.append(FAILED)
                continue
            if v is None:  # deleted behind our back: forget it
                with self._lock:
                    size = self._index.pop(name, None)
                    if size is not None:
                        self._used -= size
                        if self.track_removed:
                            self._removed.append(name)
            out.append(v)
        return out

    def write_many(self, names: Sequence[str], values: Sequence[bytes]) -> list[PutStatus]:
        if self._closed:
            return [PutStatus.ERROR] * len(names)
        out = []
        for name, value in zip(names, values, strict=True):
            size = len(value)
            with self._lock:
                if name in self._index:
                    self._index.move_to_end(name)
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
                victims = self._evict_locked(size)
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
            out.append(PutStatus.STORED)
        return out

    def exists_many(self, names: Sequence[str]) -> list:
        if self._closed:
            return [None] * len(names)
        with self._lock:
            return [name in self._index for name in names]

    def discard_many(self, names: Sequence[str]) -> None:
        if self._closed:
            return
        with self._lock:
            gone = []
            for name in names:
                size = self._index.pop(name, None)
                if size is not None:
                    self._used -= size
                    gone.append(name)
            self._unlink(gone)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._tags_fd >= 0:
                with self._lock:
                    os.close(self._tags_fd)
                    self._tags_fd = -1
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
        the capacity; no name both indexed and pending; with ``files``, every indexed value's file exists with its
        size (O(values) stats; only valid while no other thread writes)."""
        with self._lock:
            total = sum(self._index.values()) + sum(self._pending.values())
            assert total == self._used, (total, self._used)
            assert self._used <= self._cap, (self._used, self._cap)
            assert not (self._index.keys() & self._pending.keys())
            items = list(self._index.items())
        if files:
            for name, size in items:
                st = os.stat(_files.value_path(self._root, name))
                assert st.st_size == size, (name, st.st_size, size)
