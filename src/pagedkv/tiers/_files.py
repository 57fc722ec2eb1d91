"""Files of the directory backends: where a value lives, an all-or-nothing write, the disk-full state.

Layout: ``<root>/<first two hex characters of the name>/<name>.kv``; a write goes to a temporary file
``.<name>.<pid>.<thread>.<random>.tmp`` in the same folder, is flushed (``os.fsync`` when asked), then renamed
over the final name (``os.replace``, atomic on POSIX filesystems): a reader sees the whole value or none, and a
process that dies mid-write leaves only a temporary file, never a value.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import time

__all__ = ["DiskFullState", "is_disk_full", "is_name", "read_value", "tmp_path", "value_path", "write_atomic"]

log = logging.getLogger("pagedkv.tiers")
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_HEX = frozenset("0123456789abcdef")


def is_name(s: str) -> bool:
    """Whether ``s`` is a store name (32 lowercase hex characters)."""
    return len(s) == 32 and set(s) <= _HEX


def value_path(root: str, name: str) -> str:
    return os.path.join(root, name[:2], name + SUFFIX)


def tmp_path(root: str, name: str) -> str:
    tag = f"{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"
    return os.path.join(root, name[:2], f".{name}.{tag}{TMP_SUFFIX}")


def _write_all(fd: int, data) -> None:
    """Write every byte of ``data`` to ``fd`` (a seam the fault tests replace to inject ENOSPC)."""
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(root: str, name: str, data, fsync: bool) -> None:
    """Write ``data`` as the value ``name``: temporary file, optional fsync, rename (see the module docstring).
    Raises OSError (the temporary file removed) if any step fails."""
    folder = os.path.join(root, name[:2])
    os.makedirs(folder, exist_ok=True)
    tmp = tmp_path(root, name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, value_path(root, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        _fsync_dir(folder)


def read_value(root: str, name: str) -> bytes | None:
    """The bytes of value ``name``, or None if there is none. Raises OSError on other failures."""
    try:
        with open(value_path(root, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def is_disk_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


class DiskFullState:
    """After a write fails with ENOSPC / EDQUOT: stop storing for ``retry_s`` seconds, warn once (the first
    time only, per backend), count every write refused or failed for it (``events``)."""

    def __init__(self, retry_s: float, what: str) -> None:
        self.retry_s = float(retry_s)
        self.what = what
        self.events = 0
        self._until = 0.0
        self._warned = False
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return time.monotonic() < self._until

    def refuse(self) -> bool:
        """True (and counted) if writes are stopped now."""
        with self._lock:
            if time.monotonic() < self._until:
                self.events += 1
                return True
            return False

    def hit(self, e: OSError) -> None:
        with self._lock:
            self.events += 1
            self._until = time.monotonic() + self.retry_s
            warn = not self._warned
            self._warned = True
        if warn:
            log.warning("pagedkv %s: the disk is full (%s); not storing KV blocks for %.0f s at a time "
                        "(counted; this warning is not repeated)", self.what, e, self.retry_s)
