"""Many replicas: the prefix index fed by KV events (:mod:`.index`), routing policies (:mod:`.policy`) and the
cluster replay (:mod:`.replay`). Torch-free and server-free (numpy, xxhash; ``redis`` for the Redis index)."""

from .index import KVIndex, MemoryIndex, RedisIndex, open_index, predicted_tokens

__all__ = ["KVIndex", "MemoryIndex", "RedisIndex", "open_index", "predicted_tokens"]
