"""The block manager of one KV cache group: :class:`BlockManager` (``core``, the facade) and its parts.

::

    core         BlockManager: every public call, its contract and argument checks; wires the parts
    _alloc       allocate / allocate_batch / lookup_prefix: plan, then commit
    _step        the vectorised append (decode_step, append_slots)
    _small       the same append in plain Python below SMALL_BATCH sequences
    _swap        swap out / in between the GPU and CPU pools
    _registry    registration of full blocks in the prefix cache, lookup, withdrawal
    _window      the sliding window: blocks no future query can see, released
    _rows        SeqTables: one row per live sequence in flat arrays and the block-table matrix
    _invariants  the O(n) audit of every invariant (check_invariants)
    _external    external KV: loads into reserved blocks (LOADING), holds with leases
    parts        the named parts (config, external, retention, events), the shared Surface and the old names
    _offstep     BlockManager's calls off a plain request's path: swaps, retention, lookahead slots, audit
    _stores      store plans by write policy (write_through, selective), pinned until complete_store

The parts work over the per-block leaves of :mod:`pagedkv.blocks` and the CPU tier of :mod:`pagedkv.tiers`.
"""

from .core import (NULL_BLOCK, AllocStatus, BlockManager, CacheCopies, CopyKind, CopyPlan, PrefillBatch, PrefixHit,
                   Stats, StepDelta, StepResult, TableUpdates)
from ._external import ExternalLoad, Hold
from ._stores import StorePlan

__all__ = ["AllocStatus", "BlockManager", "CacheCopies", "CopyKind", "CopyPlan", "ExternalLoad", "Hold", "NULL_BLOCK",
           "PrefillBatch", "PrefixHit", "StepDelta", "StepResult", "Stats", "StorePlan", "TableUpdates"]
