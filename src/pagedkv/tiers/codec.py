"""The stored value of a block: a fixed header, the payload (the block's KV bytes), a checksum.

Layout (little-endian, 56 + n bytes)::

    offset  size  field
         0     4  magic b"PKVB"
         4     2  format version (FORMAT_VERSION)
         6     2  flags (0; reserved)
         8    16  fingerprint digest (ModelFingerprint.digest)
        24    16  store name (the 128-bit key, :func:`pagedkv.tiers.store_names`, as bytes)
        40     8  payload length n
        48     n  payload
      48+n     8  xxh3_64 of bytes [0, 48 + n)

:func:`decode` returns the payload only when every field checks: the magic, the version, the length (a value cut
short or with trailing bytes is refused), the checksum (a flipped bit anywhere is refused), then the fingerprint
and the name (a value written for another model, layout, group, namespace or block is refused). It never raises
on stored bytes; the status says why a value was refused. O(n) (one xxh3 pass, no copy of the payload).
"""

from __future__ import annotations

import enum
import struct

import xxhash

__all__ = ["FORMAT_VERSION", "HEADER_BYTES", "OVERHEAD_BYTES", "Decoded", "decode", "encode"]

FORMAT_VERSION = 1
_MAGIC = b"PKVB"
_HEAD = struct.Struct("<4sHH16s16sQ")
HEADER_BYTES = _HEAD.size  # 48
OVERHEAD_BYTES = HEADER_BYTES + 8  # header + trailing checksum
_xxh64 = xxhash.xxh3_64_intdigest


class Decoded(enum.IntEnum):
    """Why :func:`decode` accepted or refused a value."""

    OK = 0
    CORRUPT = 1  # bad magic, cut short, trailing bytes, bad checksum
    VERSION = 2  # another format version
    MISMATCH = 3  # intact, but written for another fingerprint or store name


def encode(fingerprint_digest: bytes, name: str, payload) -> bytes:
    """The stored value of ``payload`` (bytes-like, e.g. a C-contiguous numpy array's buffer) under store name
    ``name`` (32 hex characters) for a fingerprint's ``digest``. O(len(payload)), one copy."""
    mv = memoryview(payload).cast("B")
    head = _HEAD.pack(_MAGIC, FORMAT_VERSION, 0, fingerprint_digest, bytes.fromhex(name), mv.nbytes)
    out = bytearray(head)
    out += mv
    out += struct.pack("<Q", _xxh64(out))
    return bytes(out)


def decode(value: bytes, fingerprint_digest: bytes, name: str) -> tuple[Decoded, memoryview | None]:
    """``(Decoded.OK, payload)`` if ``value`` is an intact value of ``name`` for ``fingerprint_digest``, else
    ``(why, None)``; the payload is a read-only view into ``value`` (no copy). Never raises on ``value``'s
    content."""
    n = len(value)
    if n < OVERHEAD_BYTES:
        return Decoded.CORRUPT, None
    magic, version, _flags, fp, key, length = _HEAD.unpack_from(value, 0)
    if magic != _MAGIC:
        return Decoded.CORRUPT, None
    if version != FORMAT_VERSION:
        return Decoded.VERSION, None
    if length != n - OVERHEAD_BYTES:
        return Decoded.CORRUPT, None
    mv = memoryview(value)
    (check,) = struct.unpack_from("<Q", value, n - 8)
    if _xxh64(mv[: n - 8]) != check:
        return Decoded.CORRUPT, None
    if fp != fingerprint_digest or key != bytes.fromhex(name):
        return Decoded.MISMATCH, None
    return Decoded.OK, mv[HEADER_BYTES: n - 8].toreadonly()
