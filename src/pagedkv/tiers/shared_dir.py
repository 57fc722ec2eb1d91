"""SharedDirBackend: a directory that several processes, replicas or machines read and write at once.

No process owns it and none keeps an index: every call asks the filesystem (a read opens the value's file, a
probe stats it), so what one replica stores the others find at once. Writes are atomic renames
(:mod:`pagedkv.tiers._files`): two writers of the same block each write their own temporary file and rename it
over the same name; a reader sees one whole value or the other (a KV block's value is a function of its key, so
either is right), never a mix. A name already present is not rewritten (PRESENT), which makes the race rare.

Temporary files older than ``stale_tmp_s`` (left by a writer that died) are deleted when a backend opens the
directory; younger ones may be another writer's, in flight, and are left alone.

**Bound** (``max_bytes``; ``pagedkv serve --kv-shared-gib``, default 10 GiB there): each backend estimates the
directory's bytes (a scan at open, plus what it wrote since) and, once past ``max_bytes``, :meth:`sweep` s it
down to 90% of it on the writing I/O thread (O(files log files) per sweep, one sweep per 10% of the bound
written: never on the step loop). :meth:`SharedDirBackend.sweep` deletes values in the disk tier's order
(:class:`~pagedkv.tiers.chain_order.ChainOrder`, modification time as the last use): values whose parent is gone
first, then a chain's tail before its head; the parents are those this process wrote (up to 2**18 remembered;
others' values are roots, oldest first). Several replicas may sweep at once (a value deleted twice is fine; a
deleted value reads as a miss). Disk full: as :class:`~pagedkv.tiers.DiskBackend` (stop storing for
``full_retry_s``, one warning, counted).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Sequence

from ..errors import InvalidArgumentError
from . import _files
from .backend import FAILED, Backend, PutStatus
from .chain_order import ChainOrder

__all__ = ["SharedDirBackend"]

_LOW_WATER = 0.9  # a sweep of the bound deletes down to this fraction of it
_MAX_PARENTS = 1 << 18  # parents of the values this process wrote, remembered for the sweep (oldest dropped)


class SharedDirBackend(Backend):
    """A shared directory tier (see the module docstring).

    Args:
        path: the directory (created if absent).
        fsync: fsync each value before it becomes readable (default True).
        full_retry_s: after a disk-full error, how long to store nothing.
        stale_tmp_s: temporary files older than this are deleted at open.
        max_bytes: the bound of the directory's values (None: unbounded; see the module docstring).
    """

    medium = "shared_dir"

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True, full_retry_s: float = 30.0,
                 stale_tmp_s: float = 3600.0, max_bytes: int | None = None) -> None:
        if not full_retry_s >= 0 or not stale_tmp_s >= 0:
            raise InvalidArgumentError("full_retry_s and stale_tmp_s must be >= 0")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 1):
            raise InvalidArgumentError(f"max_bytes must be None or an int >= 1, got {max_bytes!r}")
        self._root = os.fspath(path)
        os.makedirs(self._root, exist_ok=True)
        self._fsync = bool(fsync)
        self._full = _files.DiskFullState(full_retry_s, f"shared KV directory {self._root!r}")
        self._cleaned_tmp = self._clean_tmp(stale_tmp_s)
        self._max = max_bytes
        self._parents: dict[str, str] = {}  # name -> parent of the values this process wrote (bounded)
        self._sweeping = threading.Lock()
        self._plock = threading.Lock()
        self._swept = 0
        self._est = 0
        if max_bytes is not None:
            self._est = self._sweep(max_bytes)[1]

    def _clean_tmp(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s
        n = 0
        for sub in os.scandir(self._root):
            if not (sub.is_dir(follow_symlinks=False) and len(sub.name) == 2):
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(_files.TMP_SUFFIX):
                    try:
                        if e.stat(follow_symlinks=False).st_mtime <= cutoff:
                            os.unlink(e.path)
                            n += 1
                    except OSError:
                        pass
        return n

    @property
    def path(self) -> str:
        return self._root

    @property
    def cleaned_tmp(self) -> int:
        return self._cleaned_tmp

    @property
    def disk_full_events(self) -> int:
        return self._full.events

    def read_many(self, names: Sequence[str]) -> list:
        out = []
        for name in names:
            try:
                out.append(_files.read_value(self._root, name))
            except OSError:
                out.append(FAILED)
        return out

    #: write_many takes each value's parent's name (the bound's sweep evicts a chain's tail first)
    accepts_parents = True

    @property
    def max_bytes(self) -> int | None:
        return self._max

    @property
    def swept(self) -> int:
        """Values this backend deleted to keep the bound."""
        return self._swept

    def _scan_bytes(self) -> int:
        return sum(size for _, _, size, _ in self._scan())

    def _scan(self) -> list:
        """(mtime_ns, name, size, path) of every value. O(files)."""
        found = []
        for sub in os.scandir(self._root):
            if not (sub.is_dir(follow_symlinks=False) and len(sub.name) == 2):
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(_files.SUFFIX):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, e.name[: -len(_files.SUFFIX)], st.st_size, e.path))
        return found

    def write_many(self, names: Sequence[str], values: Sequence[bytes],
                   parents: Sequence[str | None] | None = None) -> list[PutStatus]:
        out = self._write(names, values)
        if self._max is not None:
            wrote = 0
            with self._plock:
                for i, st in enumerate(out):
                    if st is PutStatus.STORED:
                        wrote += len(values[i])
                        if parents is not None and parents[i] is not None:
                            self._parents[names[i]] = parents[i]
                while len(self._parents) > _MAX_PARENTS:
                    del self._parents[next(iter(self._parents))]
                self._est += wrote
                over = self._est > self._max
            if over and self._sweeping.acquire(blocking=False):  # (another thread sweeps already: it will do)
                try:
                    self._est = self._sweep(int(self._max * _LOW_WATER))[1]
                finally:
                    self._sweeping.release()
        return out

    def _write(self, names: Sequence[str], values: Sequence[bytes]) -> list[PutStatus]:
        out = []
        for name, value in zip(names, values, strict=True):
            if os.path.exists(_files.value_path(self._root, name)):
                out.append(PutStatus.PRESENT)
                continue
            if self._full.refuse():
                out.append(PutStatus.FULL)
                continue
            try:
                _files.write_atomic(self._root, name, value, self._fsync)
            except OSError as e:
                if _files.is_disk_full(e):
                    self._full.hit(e)
                    out.append(PutStatus.FULL)
                else:
                    out.append(PutStatus.ERROR)
                continue
            out.append(PutStatus.STORED)
        return out

    def exists_many(self, names: Sequence[str]) -> list:
        out = []
        for name in names:
            try:
                os.stat(_files.value_path(self._root, name))
                out.append(True)
            except FileNotFoundError:
                out.append(False)
            except OSError:
                out.append(None)
        return out

    def discard_many(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                os.unlink(_files.value_path(self._root, name))
            except OSError:
                pass

    def sweep(self, max_bytes: int) -> int:
        """Delete values until they take at most ``max_bytes``, in the order of the module docstring (values
        whose parent is gone, then a chain's tail before its head, modification time as the last use); returns
        how many were deleted. O(files log files). Safe while others read and write (a deleted value reads as a
        miss)."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidArgumentError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        return self._sweep(max_bytes)[0]

    def _sweep(self, max_bytes: int) -> tuple[int, int]:
        """:meth:`sweep`, answering ``(values deleted, bytes left)``."""
        found = self._scan()
        total = sum(f[2] for f in found)
        if total <= max_bytes:
            return 0, total
        found.sort()
        with self._plock:
            parents = dict(self._parents)
        order, where = ChainOrder(), {}
        for _, name, size, path in found:
            where[name] = (size, path)
            order.add(name, parents.get(name), orphan=True)
        n = 0
        while total > max_bytes and len(order):
            name = order.pop()
            size, path = where[name]
            try:
                os.unlink(path)
                n += 1
            except OSError:
                pass
            total -= size
        with self._plock:
            for name in list(self._parents):
                if name not in order:
                    del self._parents[name]
            self._swept += n
        return n, total

    @property
    def location(self) -> str:
        """Where the values live: ``file://`` and the directory's real path (symbolic links resolved), naming the
        store to another replica (a prefill/decode split through the shared store compares it). O(path)."""
        return "file://" + os.path.realpath(self._root)
