"""The key of a block in a storage tier: which model, layout, tenant and content a stored value belongs to.

A block below the CPU tier is stored under one *store name*, a 128-bit digest (32 lowercase hex characters)::

    name = xxh3_128(b"pagedkv-tier:" + fingerprint.digest + len(ns) + enc(namespace) + uint64 chain key)

- the **chain key** is the block's chained content key (:func:`pagedkv.block_hashes`, the prefix cache's keys,
  the KV events' ``block_hashes``): it names the block's tokens and every token before them;
- the **namespace** is the request's ``cache_salt`` (None, str, bytes or int, encoded as the prefix cache does):
  a tenant's blocks are never named like another's, even if a caller passes keys computed without the salt;
- the **fingerprint** (:class:`ModelFingerprint`) names the weights, the KV dtype, the block size, the KV layout
  and the KV cache group: KV written by another model, quantization, block size, layout or group has another
  name and is never looked up; its header check (:mod:`pagedkv.tiers.codec`) would refuse it anyway.

The chain key is 64 bits: two different prefixes share a name with probability about ``n**2 / 2**65`` among ``n``
stored blocks of one fingerprint and namespace: 3e-10 at 100,000 blocks (70 GB of SmolLM2-135M's float32 KV),
1e-7 at 2 million, 3e-5 at 2**25, and a store shared across replicas, days and tenants can hold 2**25 blocks.
A tier does not store tokens, so a name collision alone would serve another prefix's KV silently. **The
decision** (docs/tiers.md#the-check-digest): every stored value also carries a **check digest**
(:func:`check_digests`), a second 64-bit digest of the block's whole token prefix computed by another hash
function (BLAKE2b) over its own chain, and a load refuses a value whose check digest is not the one of the
prefix it wants (refused, counted, computed; :mod:`pagedkv.tiers.codec`). A wrong load then needs the chain key
*and* the independent check digest to collide: about ``n**2 / 2**129`` (2e-24 at 2**25 blocks).

Pure functions of their arguments, deterministic across processes and machines; torch-free.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from ..errors import InvalidArgumentError
from ..blocks.prefix_cache import _encode_namespace, _full_blocks, _root_key

__all__ = ["ModelFingerprint", "check_digests", "chain_roots", "chain_next", "store_names"]

_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int8", "uint8", "fp8_e4m3", "fp8_e5m2"})


@dataclass(frozen=True)
class ModelFingerprint:
    """What a stored KV block must have been computed with to be loaded (immutable).

    Args:
        weights: the identity of the weights (a digest of the weights file, or ``name@revision``); non-empty.
        dtype: the KV cache's element type (``"float32"``, ``"bfloat16"``, ...).
        block_size: tokens per block (>= 1).
        kv_layout: the layout of one block's bytes, e.g. ``"L30,2,B,H3,D64"`` (layers, K/V, block, KV heads,
            head dim) for SmolLM2-135M's ``(n_layer, 2, block, n_head_kv, head_dim)`` slice; non-empty.
        kv_cache_group: the KV cache group the block belongs to (0 for a single-group model).

    ``digest`` (16 bytes) identifies all five; two fingerprints are equal iff their fields are.
    Bad fields raise :class:`pagedkv.InvalidArgumentError`.
    """

    weights: str
    dtype: str
    block_size: int
    kv_layout: str
    kv_cache_group: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.weights, str) or not self.weights:
            raise InvalidArgumentError(f"weights must be a non-empty str, got {self.weights!r}")
        if self.dtype not in _DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, (int, np.integer)) \
                or self.block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if not isinstance(self.kv_layout, str) or not self.kv_layout:
            raise InvalidArgumentError(f"kv_layout must be a non-empty str, got {self.kv_layout!r}")
        g = self.kv_cache_group
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 0:
            raise InvalidArgumentError(f"kv_cache_group must be an int >= 0, got {g!r}")
        object.__setattr__(self, "block_size", int(self.block_size))
        object.__setattr__(self, "kv_cache_group", int(g))
        fields = [self.weights, self.dtype, str(self.block_size), self.kv_layout, str(self.kv_cache_group)]
        data = b"".join(struct.pack("<I", len(f.encode())) + f.encode() for f in fields)
        object.__setattr__(self, "_digest", xxhash.xxh3_128_digest(b"pagedkv-fp1:" + data))

    @property
    def digest(self) -> bytes:
        """16 bytes naming every field (xxh3_128 of their length-prefixed encoding)."""
        return self._digest

    def for_group(self, group: int) -> "ModelFingerprint":
        """The same fingerprint for KV cache group ``group`` (a hybrid model stores each group's blocks apart)."""
        return ModelFingerprint(self.weights, self.dtype, self.block_size, self.kv_layout, group)


def store_names(fingerprint: ModelFingerprint, chain_keys, namespace: object = None) -> list[str]:
    """The store names (32 hex characters each) of the blocks with chained keys ``chain_keys`` (ints in
    [0, 2**64), e.g. :func:`pagedkv.block_hashes`), of namespace ``namespace``, for ``fingerprint``.

    O(len(chain_keys)). Raises :class:`pagedkv.InvalidArgumentError` on a bad fingerprint, namespace or key
    (nothing is computed)."""
    if not isinstance(fingerprint, ModelFingerprint):
        raise InvalidArgumentError(f"fingerprint must be a ModelFingerprint, got {type(fingerprint).__name__}")
    ns = _encode_namespace(namespace)
    if isinstance(chain_keys, np.ndarray):
        if chain_keys.ndim != 1 or (chain_keys.size and chain_keys.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"chain_keys must be 1-D ints, got {chain_keys.dtype} {chain_keys.shape}")
        chain_keys = chain_keys.tolist()
    try:
        packed = [struct.pack("<Q", k) for k in chain_keys if type(k) is int or isinstance(k, (int, np.integer))
                  and not isinstance(k, bool)]
    except struct.error as e:
        raise InvalidArgumentError(f"chain keys must be ints in [0, 2**64): {e}") from None
    except TypeError:
        raise InvalidArgumentError("chain_keys must be a 1-D sequence of ints") from None
    if len(packed) != len(chain_keys):
        raise InvalidArgumentError("chain_keys must be a 1-D sequence of ints (no bools, floats or lists)")
    head = b"pagedkv-tier:" + fingerprint.digest + struct.pack("<I", len(ns)) + ns
    h = xxhash.xxh3_128_hexdigest
    return [h(head + p) for p in packed]


_blake8 = hashlib.blake2b


def check_digests(token_ids, block_size: int, namespace: object = None, group: int = 0) -> list[int]:
    """The check digests (ints in [0, 2**64)) of the full blocks of ``token_ids``: the second, independent digest
    of each block's whole token prefix that a stored value carries and a load compares (see the module
    docstring). A chain of its own, over another hash function than the chain keys'::

        c_0 = blake2b(b"pagedkv-check:" + b"g<group>:" + enc(namespace), digest_size=8)
        c_i = blake2b(c_{i-1} (8 bytes, little-endian) + int32 bytes of block i's tokens, digest_size=8)

    so the pair (chain key, check digest) is a 128-bit chained digest of the prefix. Deterministic across
    processes. O(len(token_ids)) (one BLAKE2b call per block, about a microsecond: nothing next to the I/O of a
    block). Raises like :func:`pagedkv.block_hashes` on bad tokens, block size or group."""
    arr, n = _full_blocks(token_ids, block_size, group)
    data = arr[: n * block_size].astype("<i4").tobytes()
    w = 4 * block_size
    c = _blake8(b"pagedkv-check:g%d:" % int(group) + _encode_namespace(namespace), digest_size=8).digest()
    out = []
    for i in range(n):
        c = _blake8(c + data[i * w:(i + 1) * w], digest_size=8).digest()
        out.append(int.from_bytes(c, "little"))
    return out


def chain_roots(namespace: object = None, group: int = 0) -> tuple[int, int]:
    """The roots ``(key_0, c_0)`` of a namespace's two chains (the prefix cache's chain key and the check
    digest): what :func:`chain_next` extends for a prompt's first block. O(1)."""
    g = int(group)
    c = _blake8(b"pagedkv-check:g%d:" % g + _encode_namespace(namespace), digest_size=8).digest()
    return _root_key(namespace, g), int.from_bytes(c, "little")


def chain_next(key: int, check: int, block_tokens) -> tuple[int, int]:
    """The chain key and check digest of a block of tokens ``block_tokens`` (one block's ids, ints in [0, 2**31))
    whose parent has chain key ``key`` and check digest ``check``: one step of :func:`pagedkv.block_hashes` and of
    :func:`check_digests`, so that a block a decode step fills costs O(block), not O(prefix). Equal to those
    functions' i-th entries when ``(key, check)`` are their (i-1)-th (or :func:`chain_roots` for i = 0)."""
    data = np.asarray(block_tokens, dtype="<i4").tobytes()
    c = _blake8(int(check).to_bytes(8, "little") + data, digest_size=8).digest()
    return xxhash.xxh3_64_intdigest(data, seed=int(key)), int.from_bytes(c, "little")
