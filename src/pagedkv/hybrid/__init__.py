"""Hybrid models (KV cache groups): :class:`HybridBlockManager` (``core``), a coordinator over one
:class:`~pagedkv.BlockManager` per group sharing one pool of block ids, and its parts.

::

    core         HybridBlockManager: the public calls over every group, all or nothing across them
    _allocator   HybridAllocator: plan every group's allocation, check it as a whole, commit
    _hit         the hybrid prefix hit, vectorised over blocks and groups (find_hit, commit_all)
    _step        HybridStepper: append in every group
    _swap        HybridSwapper: swap every group's blocks against the shared pool
    _seqs        HybridSeqs: fork, free, end of step, reset, audit across groups
    _retention   which released sliding-window blocks to keep cached
    _types       the result types (one slot-mapping row and block table per group)
"""

from .core import GroupedManager, HybridBlockManager, HybridPrefillBatch, HybridStepDelta, HybridStepResult

__all__ = ["GroupedManager", "HybridBlockManager", "HybridPrefillBatch", "HybridStepDelta", "HybridStepResult"]
