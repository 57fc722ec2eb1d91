"""The bytes of a held sequence's blocks on the wire between a prefill replica and a decode replica.

A prefill replica answers ``GET /v1/kv/holds/{id}`` with the blocks of the hold, in order, each as one value of
the tiers' checked format (:mod:`pagedkv.tiers.codec`: header, payload, xxh3 checksum), concatenated::

    value(block 0) value(block 1) ... value(block k-1)        each: 56-byte header, n-byte payload, 8-byte check

Each value is named by the block's store name (:func:`pagedkv.tiers.store_names`: the model fingerprint, the
request's namespace and the block's chained content key), so the decode replica, which computes the same names
from its own copy of the prompt, accepts a block only if it was computed by the same model and layout, for the
same tenant and the same tokens, and arrived intact. Each value also carries the block's **check digest**
(:func:`pagedkv.tiers.check_digests`: a second, independent 64-bit digest of the block's whole token prefix, the
codec's flag bit 0), which the decode replica computes from its own tokens too and compares: a value whose
64-bit chain key collided with another prefix's, or that carries no check digest, is refused
(``Decoded.CHECK``), as the storage tiers refuse it. :class:`BundleReader` parses such a body as it arrives,
chunk by chunk, and keeps the leading blocks that check: a body cut short, a flipped bit, a block of another
prompt or model stops it there, and the blocks before stay good (the decode replica computes the rest). It never
buffers more than one value, refuses a value whose length is not the expected payload size before reading it,
and never raises on the bytes it is given. O(bytes) overall.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..tiers import codec

__all__ = ["encode_blocks", "BundleReader", "MEDIA_TYPE"]

MEDIA_TYPE = "application/vnd.pagedkv.kv-blocks"
_LEN = struct.Struct("<Q")
_LEN_AT = codec.HEADER_BYTES - 8  # the payload length's offset in the header


def encode_blocks(fingerprint_digest: bytes, names: Sequence[str], payloads: Iterable,
                  checks: Sequence[int] | None = None) -> Iterator[bytes]:
    """The values of a hold's blocks, one per (name, payload), in order, each with its check digest from
    ``checks`` (one per name; None: values without one, which a reader given check digests refuses). A generator:
    one value in memory at a time. O(total payload bytes)."""
    if checks is None:
        checks = [None] * len(names)
    for name, payload, check in zip(names, payloads, checks):
        yield codec.encode(fingerprint_digest, name, payload, check)


class BundleReader:
    """Incremental parser of a bundle (see the module docstring) for the blocks named ``names``, each with a
    payload of exactly ``payload_bytes`` bytes.

    Feed chunks with :meth:`feed` (False once it stopped: a bad value, more bytes than the blocks named, or, with
    ``prefix_only``, every named block arrived); call :meth:`finish` at the end of the body. :attr:`payloads` holds
    the good leading blocks' payloads, :attr:`error` says why it stopped before all of them (None when every block
    arrived and checked).

    ``keep``: turns a checked payload (a memoryview into the reader's buffer) into the object kept (default
    ``bytes``: a copy); :class:`~.kv_handoff.KVHandoff` passes one that counts it against its staging budget.
    ``prefix_only``: the body may hold more blocks than ``names`` (the caller wants only its first blocks): the
    reader stops, without error, once the named ones arrived.
    ``checks``: the check digest each named block's value must carry (one per name, computed from the reader's own
    tokens); a value with another one, or none, stops the reader there (:attr:`refused` ``Decoded.CHECK``). None:
    check digests are not compared.

    :attr:`refused`: the :class:`~pagedkv.tiers.codec.Decoded` status of the value that stopped the reader (None
    when no value was refused: every block arrived, or the body ended or was cut short)."""

    def __init__(self, fingerprint_digest: bytes, names: Sequence[str], payload_bytes: int, *,
                 keep: Callable[[memoryview], Any] = bytes, prefix_only: bool = False,
                 checks: Sequence[int] | None = None) -> None:
        if payload_bytes < 1:
            raise ValueError(f"payload_bytes must be >= 1, got {payload_bytes}")
        if checks is not None and len(checks) != len(names):
            raise ValueError(f"{len(checks)} check digests for {len(names)} blocks")
        self._checks = None if checks is None else [int(c) for c in checks]
        self.refused: codec.Decoded | None = None
        self._fp = fingerprint_digest
        self._names = list(names)
        self._value_bytes = payload_bytes + codec.OVERHEAD_BYTES
        self._payload_bytes = payload_bytes
        self._keep = keep
        self._prefix_only = prefix_only
        self._buf = bytearray()
        self.payloads: list[bytes] = []
        self.error: str | None = None
        self.bytes_read = 0

    @property
    def done(self) -> bool:
        """Every named block arrived and checked."""
        return len(self.payloads) == len(self._names) and self.error is None

    @property
    def stopped(self) -> bool:
        return self.error is not None

    def feed(self, chunk: bytes) -> bool:
        """Take the next bytes of the body; False once the reader stopped (the rest may be dropped)."""
        if self.error is not None or (self._prefix_only and self.done):
            return False
        self.bytes_read += len(chunk)
        self._buf += chunk
        while len(self._buf) >= codec.HEADER_BYTES:
            if len(self.payloads) == len(self._names):
                if self._prefix_only:
                    self._buf.clear()
                    return False
                self.error = "the body holds more than the blocks named"
                return False
            (n,) = _LEN.unpack_from(self._buf, _LEN_AT)
            if n != self._payload_bytes:
                self.error = (f"block {len(self.payloads)}: a payload of {n} bytes where this replica's blocks hold "
                              f"{self._payload_bytes} (another model or layout, or corrupt)")
                return False
            if len(self._buf) < self._value_bytes:
                break
            value = bytes(self._buf[: self._value_bytes])
            del self._buf[: self._value_bytes]
            i = len(self.payloads)
            status, payload = codec.decode(value, self._fp, self._names[i],
                                           None if self._checks is None else self._checks[i])
            if status is not codec.Decoded.OK:
                self.refused = status
                self.error = f"block {i} refused: {status.name}" + (
                    " (its check digest is not the one of this prompt's prefix, or it has none)"
                    if status is codec.Decoded.CHECK else "")
                return False
            self.payloads.append(self._keep(payload))
        if self._prefix_only and self.done:
            self._buf.clear()
            return False
        return True

    def finish(self) -> None:
        """The body ended: a partial value or missing blocks become the :attr:`error`."""
        if self.error is None and len(self.payloads) < len(self._names):
            self.error = (f"the body ended after {len(self.payloads)} of {len(self._names)} blocks"
                          + (f" and {len(self._buf)} bytes of the next" if self._buf else ""))
