"""The interface of a storage tier's backend: named byte values, read, written, probed and dropped in batches.

A backend knows nothing of KV, keys or models: it stores opaque values under store names (32 hex characters,
:func:`pagedkv.tiers.store_names`). :class:`pagedkv.tiers.BlockStore` puts the key, the value format and the
checks on top. Every method takes a batch and answers per name, in order, and **never raises for a store that is
down, full, slow or holding bad bytes**: a failure is an answer (:data:`FAILED`, :attr:`PutStatus.ERROR`,
``None``), so a request whose KV is not loadable goes on and computes it. Bad arguments are the caller's bug and
may raise.

Each backend is safe to call from several threads at once (an engine's I/O worker and its step loop), and states
how it behaves when several processes share its store.

Compared with the designs this follows (learned from, not copied): vLLM's offloading manager answers a lookup
with the number of leading blocks held (``lookup``) and stores through ``prepare_store`` /
``complete_store(success)``; SGLang HiCache's ``HiCacheStorage`` has ``batch_get`` / ``batch_set`` /
``batch_exists``; LMCache's backends hold serialized chunks under a string key. Here a batch call returns per-name
results and a failure is a value, not an exception.
"""

from __future__ import annotations

import abc
import enum
from typing import Sequence

__all__ = ["FAILED", "Backend", "PutStatus"]


class _Failed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "FAILED"

    def __bool__(self) -> bool:
        return False


#: what :meth:`Backend.read_many` answers for a name it could not read (store down, I/O error, timeout)
FAILED = _Failed()


class PutStatus(enum.IntEnum):
    """The outcome of storing one value."""

    STORED = 0  # written (readable by the next read)
    PRESENT = 1  # a value was already stored under this name; nothing was written
    FULL = 2  # not stored: the store is full (disk full, over its byte bound with nothing to evict, Redis OOM)
    TOO_LARGE = 3  # not stored: the value alone exceeds the store's bound
    ERROR = 4  # not stored: the store failed (down, I/O error, timeout)


class Backend(abc.ABC):
    """A store of named byte values (see the module docstring). ``medium``: a short name of the kind of store
    (``"disk"``, ``"shared_dir"``, ``"redis"``), as KV events would name it."""

    medium: str = "?"

    @abc.abstractmethod
    def read_many(self, names: Sequence[str]) -> list:
        """For each name: its value (``bytes``), ``None`` if no value is stored, or :data:`FAILED`."""

    @abc.abstractmethod
    def write_many(self, names: Sequence[str], values: Sequence[bytes]) -> list[PutStatus]:
        """Store ``values[i]`` under ``names[i]``, each all or nothing (a reader never sees part of a value);
        a name already stored is left as it is (:attr:`PutStatus.PRESENT`)."""

    @abc.abstractmethod
    def exists_many(self, names: Sequence[str]) -> list:
        """For each name: True, False, or ``None`` when the store could not answer."""

    @abc.abstractmethod
    def discard_many(self, names: Sequence[str]) -> None:
        """Drop the values of ``names`` (best effort; absent names are ignored). Used to drop a refused value."""

    def close(self) -> None:
        """Release connections and files (idempotent)."""
