"""The stored value of a block: a fixed header, the payload (the block's KV bytes), a checksum.

Layout (little-endian, 64 + n bytes; format version 2)::

    offset  size  field
         0     4  magic b"PKVB"
         4     2  format version (FORMAT_VERSION)
         6     2  flags (bit 0: the check digest is set; other bits 0, reserved)
         8    16  fingerprint digest (ModelFingerprint.digest)
        24    16  store name (the 128-bit key, :func:`pagedkv.tiers.store_names`, as bytes)
        40     8  check digest (:func:`pagedkv.tiers.check_digests`: a second, independent 64-bit digest of the
                  block's whole token prefix; 0 when flag bit 0 is clear)
        48     8  payload length n
        56     n  payload
      56+n     8  xxh3_64 of bytes [0, 56 + n)

:func:`decode` returns the payload only when every field checks: the magic, the version, the length (a value cut
short or with trailing bytes is refused), the checksum (a flipped bit anywhere is refused), the fingerprint and
the name (a value written for another model, layout, group, namespace or block is refused), then, when the reader
passes the check digest of the prefix it wants, the value's check digest (a value of another prefix whose 64-bit
chain key collided with this one's, or a value stored without a check digest, is refused: ``Decoded.CHECK``). It
never raises on stored bytes; the status says why a value was refused. O(n) (one xxh3 pass, no copy of the
payload).

Version 1 values (48-byte header, no check digest) are refused as ``Decoded.VERSION``: a store written before the
check digest existed is dropped block by block as it is read, never served.
"""

from __future__ import annotations

import enum
import struct

import xxhash

__all__ = ["FORMAT_VERSION", "HEADER_BYTES", "OVERHEAD_BYTES", "Decoded", "decode", "encode", "has_check"]

FORMAT_VERSION = 2
_MAGIC = b"PKVB"
_HEAD = struct.Struct("<4sHH16s16sQQ")
HEADER_BYTES = _HEAD.size  # 56 (the payload length is its last 8 bytes)
_HAS_CHECK = 1
OVERHEAD_BYTES = HEADER_BYTES + 8  # header + trailing checksum
_xxh64 = xxhash.xxh3_64_intdigest


class Decoded(enum.IntEnum):
    """Why :func:`decode` accepted or refused a value."""

    OK = 0
    CORRUPT = 1  # bad magic, cut short, trailing bytes, bad checksum
    VERSION = 2  # another format version
    MISMATCH = 3  # intact, but written for another fingerprint or store name
    CHECK = 4  # intact, this fingerprint and name, but another check digest (another prefix) or none


def encode(fingerprint_digest: bytes, name: str, payload, check: int | None = None) -> bytes:
    """The stored value of ``payload`` (bytes-like, e.g. a C-contiguous numpy array's buffer) under store name
    ``name`` (32 hex characters) for a fingerprint's ``digest``, with the block's check digest ``check`` (an int
    in [0, 2**64); None: no check digest, and a reader that passes one refuses the value). O(len(payload)), one
    copy."""
    mv = memoryview(payload).cast("B")
    flags = 0 if check is None else _HAS_CHECK
    head = _HEAD.pack(_MAGIC, FORMAT_VERSION, flags, fingerprint_digest, bytes.fromhex(name),
                      0 if check is None else check, mv.nbytes)
    out = bytearray(head)
    out += mv
    out += struct.pack("<Q", _xxh64(out))
    return bytes(out)


def decode(value: bytes, fingerprint_digest: bytes, name: str,
           check: int | None = None) -> tuple[Decoded, memoryview | None]:
    """``(Decoded.OK, payload)`` if ``value`` is an intact value of ``name`` for ``fingerprint_digest`` (and, when
    ``check`` is given, carries that check digest), else ``(why, None)``; the payload is a read-only view into
    ``value`` (no copy). Never raises on ``value``'s content."""
    n = len(value)
    if n < 6 or value[:4] != _MAGIC:
        return Decoded.CORRUPT, None
    if struct.unpack_from("<H", value, 4)[0] != FORMAT_VERSION:
        return Decoded.VERSION, None  # (judged before the length: another version's header has another size)
    if n < OVERHEAD_BYTES:
        return Decoded.CORRUPT, None
    _magic, _version, flags, fp, key, stored_check, length = _HEAD.unpack_from(value, 0)
    if length != n - OVERHEAD_BYTES:
        return Decoded.CORRUPT, None
    mv = memoryview(value)
    (crc,) = struct.unpack_from("<Q", value, n - 8)
    if _xxh64(mv[: n - 8]) != crc:
        return Decoded.CORRUPT, None
    if fp != fingerprint_digest or key != bytes.fromhex(name):
        return Decoded.MISMATCH, None
    if check is not None and (not flags & _HAS_CHECK or stored_check != check):
        return Decoded.CHECK, None
    return Decoded.OK, mv[HEADER_BYTES: n - 8].toreadonly()


def has_check(value: bytes) -> bool:
    """Whether ``value`` (a value :func:`decode` accepts without a check digest) carries a check digest. O(1)."""
    return len(value) >= 8 and bool(struct.unpack_from("<H", value, 6)[0] & _HAS_CHECK)
