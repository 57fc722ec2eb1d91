"""SharedDirBackend: a directory that several processes, replicas or machines read and write at once.

No process owns it and none keeps an index: every call asks the filesystem (a read opens the value's file, a
probe stats it), so what one replica stores the others find at once. Writes are atomic renames
(:mod:`pagedkv.tiers._files`): two writers of the same block each write their own temporary file and rename it
over the same name; a reader sees one whole value or the other (a KV block's value is a function of its key, so
either is right), never a mix. A name already present is not rewritten (PRESENT), which makes the race rare.

Temporary files older than ``stale_tmp_s`` (left by a writer that died) are deleted when a backend opens the
directory; younger ones may be another writer's, in flight, and are left alone.

Bounded only on request: :meth:`SharedDirBackend.sweep` deletes the oldest values (by modification time) until
the directory holds at most ``max_bytes`` (O(files); for a periodic job, not the request path). Disk full:
as :class:`~pagedkv.tiers.DiskBackend` (stop storing for ``full_retry_s``, one warning, counted).
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from ..errors import InvalidArgumentError
from . import _files
from .backend import FAILED, Backend, PutStatus

__all__ = ["SharedDirBackend"]


class SharedDirBackend(Backend):
    """A shared directory tier (see the module docstring).

    Args:
        path: the directory (created if absent).
        fsync: fsync each value before it becomes readable (default True).
        full_retry_s: after a disk-full error, how long to store nothing.
        stale_tmp_s: temporary files older than this are deleted at open.
    """

    medium = "shared_dir"

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True, full_retry_s: float = 30.0,
                 stale_tmp_s: float = 3600.0) -> None:
        if not full_retry_s >= 0 or not stale_tmp_s >= 0:
            raise InvalidArgumentError("full_retry_s and stale_tmp_s must be >= 0")
        self._root = os.fspath(path)
        os.makedirs(self._root, exist_ok=True)
        self._fsync = bool(fsync)
        self._full = _files.DiskFullState(full_retry_s, f"shared KV directory {self._root!r}")
        self._cleaned_tmp = self._clean_tmp(stale_tmp_s)

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

    def write_many(self, names: Sequence[str], values: Sequence[bytes]) -> list[PutStatus]:
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
        """Delete the oldest values (modification time) until the values take at most ``max_bytes``; returns
        how many were deleted. O(files). Safe while others read and write (a deleted value reads as a miss)."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidArgumentError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        found, total = [], 0
        for sub in os.scandir(self._root):
            if not (sub.is_dir(follow_symlinks=False) and len(sub.name) == 2):
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(_files.SUFFIX):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, e.path, st.st_size))
                    total += st.st_size
        found.sort()
        n = 0
        for _, path, size in found:
            if total <= max_bytes:
                break
            try:
                os.unlink(path)
                n += 1
            except OSError:
                pass
            total -= size
        return n

    @property
    def location(self) -> str:
        """Where the values live: ``file://`` and the directory's real path (symbolic links resolved), naming the
        store to another replica (a prefill/decode split through the shared store compares it). O(path)."""
        return "file://" + os.path.realpath(self._root)
