"""The tiers below the GPU pool: the CPU tier of the prefix cache (:mod:`pagedkv.tiers.cpu`, used by the block
manager), and storage tiers below it: KV blocks on a local disk, in a shared directory, in Redis.

The storage tiers' bottom layer (docs/tiers.md): a batch-first :class:`Backend` interface that never raises for a store's
state, three backends (:class:`DiskBackend`, :class:`SharedDirBackend`, :class:`RedisBackend`), the block key
(:class:`ModelFingerprint`, :func:`store_names`) and check digest (:func:`check_digests`), the checked value format
(:mod:`pagedkv.tiers.codec`) and :class:`BlockStore`, which ties them together;
:class:`~pagedkv.tiers.connector.TierConnector` loads and stores blocks on I/O threads for the engine
(``TierConfig(kv_disk_dir=, kv_shared=)``, docs/tiers.md).
Torch-free; the Redis backend imports ``redis`` when created.
"""

from .backend import FAILED, Backend, PutStatus
from .disk import DiskBackend, TierInUseError
from .key import ModelFingerprint, check_digests, store_names
from .redis_store import RedisBackend
from .shared_dir import SharedDirBackend
from .store import BlockStore, GetResult, GetStatus, TierStats

__all__ = ["FAILED", "Backend", "BlockStore", "DiskBackend", "GetResult", "GetStatus", "ModelFingerprint",
           "PutStatus", "RedisBackend", "SharedDirBackend", "TierInUseError", "TierStats", "check_digests",
           "store_names"]
