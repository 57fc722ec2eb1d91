"""Hybrid models (KV cache groups): :class:`GroupedManager` (``core``; ``BlockManager(..., kv_cache_groups=[...])``
with several groups builds one, and :class:`HybridBlockManager` is its deprecated alias), a coordinator over one
:class:`~pagedkv.BlockManager` per group sharing one pool of block ids, and its parts.

::

    core         GroupedManager: the public calls over every group, all or nothing across them
    _allocator   HybridAllocator: plan every group's allocation, check it as a whole, commit
    _hit         the hybrid prefix hit, vectorised over blocks and groups (find_hit, commit_all)
    _step        HybridStepper: append in every group
    _swap        HybridSwapper: swap every group's blocks against the shared pool
    _seqs        HybridSeqs: fork, free, end of step, reset, audit across groups
    _retention   which released sliding-window blocks to keep cached
    _types       the result types (one slot-mapping row and block table per group)
"""

import warnings

from .core import GroupedManager, HybridPrefillBatch, HybridStepDelta, HybridStepResult

__all__ = ["GroupedManager", "HybridBlockManager", "HybridPrefillBatch", "HybridStepDelta", "HybridStepResult"]


class HybridBlockManager(GroupedManager):
    """Deprecated alias: ``BlockManager(..., kv_cache_groups=[...], grouped_results=True)`` builds the same manager
    (a DeprecationWarning on construction). ``isinstance(x, HybridBlockManager)`` holds only for managers built
    through the alias: ``bm.config.grouped_results`` says which form the results take."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        warnings.warn("HybridBlockManager is deprecated: use BlockManager(..., kv_cache_groups=[...]) (one class "
                      "for every model)", DeprecationWarning, stacklevel=2)
        super().__init__(*args, **kwargs)
