"""vLLM's prefix-cache block hashes, computed without vLLM: what a router in front of vLLM replicas needs to
predict their prefix-cache hits from a request's tokens (``pagedkv router --hash-scheme vllm``).

The scheme (vLLM V1, checked against vLLM 0.33's own functions by tests/compat/):

- block i of a prompt (tokens ``[i*B, (i+1)*B)``, full blocks only) has the digest
  ``H((parent, tuple(tokens), extra_keys))``: ``parent`` the digest of block i-1, or for block 0 the *none
  hash* ``H(seed)``; ``extra_keys`` None or a tuple of tagged tuples (below);
- ``H`` is one of ``--prefix-caching-hash-algo``'s choices (:data:`ALGOS`): ``sha256`` (SHA-256 of the pickle of
  the object, protocol 5; vLLM's default), ``sha256_cbor`` (SHA-256 of its canonical CBOR), ``xxhash`` and
  ``xxhash_cbor`` (xxh3-128 of the same two serialisations);
- ``seed`` is the replicas' ``PYTHONHASHSEED`` when set, else the fixed string :data:`DEFAULT_SEED` for the
  SHA-256 algorithms; for the xxhash ones vLLM then draws a random seed per process (its hashes cannot be
  predicted: run the replicas with ``PYTHONHASHSEED`` and give the router the same value);
- extra keys, in this order: ``("lora", name, path)`` on every block of a LoRA request;
  ``("mm", identifier, offset - block_start)`` for each multimodal item overlapping the block;
  ``("cache_salt", salt)`` on block 0 of a request with a ``cache_salt``. vLLM's prompt-embeds key and its
  lookahead keys (speculative decoding with ``num_hash_lookahead_tokens``) are not computed here.

In KV events vLLM sends a digest as an unsigned 64-bit int by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``:
the digest read big-endian, low 64 bits kept), or as the digest bytes. :func:`external_key` maps both to that
int, the key :mod:`pagedkv.cluster.index` stores, so the router's keys (:meth:`VLLMHasher.keys`) meet the events'.

Only the standard library and ``xxhash`` are used (the CBOR encoder is this module's own, for the types the
hash reads: None, bool, int, bytes, str, tuple / list).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from typing import Any, Iterable, Sequence

__all__ = ["ALGOS", "DEFAULT_SEED", "VLLMHasher", "VLLMPromptKeys", "cbor_canonical", "external_key"]

#: vLLM's ``--prefix-caching-hash-algo`` choices
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: the none-hash seed vLLM uses for the SHA-256 algorithms when PYTHONHASHSEED is not set
DEFAULT_SEED = "vllm-none-hash"
_PICKLE_PROTOCOL = 5  # vLLM pickles with pickle.HIGHEST_PROTOCOL: 5 on every Python it supports


def _head(major: int, n: int) -> bytes:
    """A CBOR head: major type and argument ``n`` in its shortest form."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return bytes((m | 25,)) + struct.pack(">H", n)
    if n < 0x100000000:
        return bytes((m | 26,)) + struct.pack(">I", n)
    return bytes((m | 27,)) + struct.pack(">Q", n)


def _cbor(obj: Any, out: list) -> None:
    if obj is None:
        out.append(b"\xf6")
    elif obj is True:
        out.append(b"\xf5")
    elif obj is False:
        out.append(b"\xf4")
    elif isinstance(obj, int):
        if 0 <= obj < 1 << 64:
            out.append(_head(0, obj))
        elif -(1 << 64) <= obj < 0:
            out.append(_head(1, -1 - obj))
        else:
            raise TypeError(f"cannot CBOR-encode an int beyond 64 bits: {obj}")
    elif isinstance(obj, (bytes, bytearray)):
        out.append(_head(2, len(obj)))
        out.append(bytes(obj))
    elif isinstance(obj, str):
        b = obj.encode("utf-8")
        out.append(_head(3, len(b)))
        out.append(b)
    elif isinstance(obj, (tuple, list)):
        out.append(_head(4, len(obj)))
        for x in obj:
            _cbor(x, out)
    else:
        raise TypeError(f"cannot CBOR-encode {type(obj).__name__} (None, bool, int, bytes, str, tuple, list only)")


def cbor_canonical(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949 4.2.1 core deterministic encoding: shortest heads, definite lengths) of ``obj``
    built of None, bools, 64-bit ints, bytes, str and tuples / lists (both encoded as arrays). TypeError for
    anything else. O(size)."""
    out: list = []
    _cbor(obj, out)
    return b"".join(out)


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)


def _digest_fn(algo: str):
    if algo == "sha256":
        return lambda o: hashlib.sha256(_pickled(o)).digest()
    if algo == "sha256_cbor":
        return lambda o: hashlib.sha256(cbor_canonical(o)).digest()
    if algo in ("xxhash", "xxhash_cbor"):
        import xxhash

        ser = _pickled if algo == "xxhash" else cbor_canonical
        x = xxhash.xxh3_128_digest
        return lambda o: x(ser(o))
    raise ValueError(f"unknown vLLM hash algorithm {algo!r} (expected one of {', '.join(ALGOS)})")


def external_key(h: bytes | int) -> int:
    """A block hash as vLLM's KV events send it by default: the digest's low 64 bits, big-endian, as an unsigned
    int (an int is returned unchanged). O(1)."""
    if isinstance(h, int):
        return h
    return int.from_bytes(bytes(h)[-8:], "big")


class VLLMPromptKeys(list):
    """A prompt's block keys (:func:`external_key` of each digest), list-compatible with pagedkv's
    :class:`pagedkv.blocks.prefix_cache.PromptKeys`: vLLM names a block by the same hash in every KV cache
    group, so :meth:`group` returns the same keys. ``digests``: the full digests; ``hit_blocks``: the most
    blocks a hit can cover, ``(len(tokens) - 1) // block_size`` (vLLM computes at least the last token)."""

    __slots__ = ("digests", "hit_blocks")

    def __init__(self, digests: Sequence[bytes], num_tokens: int, block_size: int) -> None:
        super().__init__(external_key(d) for d in digests)
        self.digests = list(digests)
        self.hit_blocks = max(num_tokens - 1, 0) // block_size

    def group(self, g: int) -> list:
        return self


class VLLMHasher:
    """vLLM's block hashing for one configuration: ``algo`` (:data:`ALGOS`), ``seed`` (the replicas'
    ``PYTHONHASHSEED``; None: :data:`DEFAULT_SEED`, refused for the xxhash algorithms, whose vLLM seed is then
    random) and ``block_size`` (the replicas' block size, the granularity vLLM hashes at). ValueError on a bad
    configuration."""

    def __init__(self, algo: str = "sha256", seed: str | None = None, block_size: int = 16) -> None:
        self._h = _digest_fn(algo)
        if seed is None:
            if algo.startswith("xxhash"):
                raise ValueError(f"vLLM draws a random none-hash seed for {algo} unless PYTHONHASHSEED is set: "
                                 "run the replicas with PYTHONHASHSEED and give the router the same seed")
            seed = DEFAULT_SEED
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.algo, self.seed, self.block_size = algo, str(seed), block_size
        self.none_hash: bytes = self._h(self.seed)

    def digest(self, obj: Any) -> bytes:
        """``H(obj)`` with this configuration's algorithm."""
        return self._h(obj)

    def hash_block(self, parent: bytes | None, tokens: Iterable[int], extra_keys: tuple | None = None) -> bytes:
        """The digest of one full block: vLLM's ``hash_block_tokens`` (``parent`` None or empty: the none
        hash)."""
        return self._h((parent or self.none_hash, tuple(int(t) for t in tokens), extra_keys))

    def block_digests(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                      lora: tuple[str, str] | None = None, mm: Sequence[tuple[str, int, int]] = ()) -> list[bytes]:
        """The digests of every full block of ``token_ids``: ``cache_salt`` (a request's, None or empty: none),
        ``lora`` (``(name, path)`` of the request's adapter, or None), ``mm`` (the multimodal items as
        ``(identifier, offset, length)``, sorted by offset, not overlapping). O(tokens + items)."""
        bs = self.block_size
        toks = [int(t) for t in token_ids]
        n = len(toks) // bs
        lora_keys = [("lora", lora[0], lora[1])] if lora else []
        out: list[bytes] = []
        parent = self.none_hash
        j = 0  # first mm item not yet passed
        for i in range(n):
            s, e = i * bs, (i + 1) * bs
            keys = list(lora_keys)
            while j < len(mm) and mm[j][1] + mm[j][2] <= s:
                j += 1
            k = j
            while k < len(mm) and mm[k][1] < e:
                ident, off, _length = mm[k]
                keys.append(("mm", ident, off - s))
                k += 1
            if i == 0 and cache_salt:
                keys.append(("cache_salt", cache_salt))
            parent = self._h((parent, tuple(toks[s:e]), tuple(keys) if keys else None))
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
             lora: tuple[str, str] | None = None) -> VLLMPromptKeys:
        """The prompt's keys as the index stores vLLM's events (:class:`VLLMPromptKeys`)."""
        return VLLMPromptKeys(self.block_digests(token_ids, cache_salt=cache_salt, lora=lora), len(token_ids),
                              self.block_size)
