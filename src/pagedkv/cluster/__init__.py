"""Many replicas: the prefix index fed by KV events (:mod:`.index`) and the routing policies (:mod:`.policy`),
shared by the router (:mod:`pagedkv.router`) and the cluster replay (:mod:`pagedkv.replay.cluster`). Torch-free
and server-free (numpy, xxhash; ``redis`` for the Redis index); imports nothing of pagedkv but the core."""

from .index import IndexUnavailableError, KVIndex, MemoryIndex, predicted_tokens
from .redis_index import RedisIndex, open_index

__all__ = ["IndexUnavailableError", "KVIndex", "MemoryIndex", "RedisIndex", "open_index", "predicted_tokens"]
