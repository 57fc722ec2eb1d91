"""pagedkv: a paged KV-cache block manager for LLM inference engines.

The core (this package without :mod:`pagedkv.engine`) depends on numpy and xxhash only, never on torch.
"""

from . import errors
from .errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidTokensError,
    OutOfBlocksError,
    PagedKVError,
    PinBudgetError,
    PromptTooLongError,
    SequenceStateError,
    TableWidthError,
    UnknownHoldError,
    UnknownPinError,
    UnknownSequenceError,
    UnknownStoreError,
)
from . import events
from .manager import (NULL_BLOCK, AllocStatus, BlockManager, CopyKind, CopyPlan, ExternalLoad, Hold, PrefillBatch,
                      PrefixHit, Stats, StepDelta, StepResult, StorePlan, TableUpdates)
from .blocks.prefix_cache import block_hashes
from .retention.eviction import EVICTION_POLICIES, EvictionPolicy
from .retention.steering import Pin
from .kv_groups import FullAttentionSpec, SlidingWindowSpec
from .hybrid import HybridBlockManager, HybridPrefillBatch, HybridStepDelta, HybridStepResult

__version__ = "0.1.0"

__all__ = [
    "AllocStatus",
    "BlockManager",
    "FullAttentionSpec",
    "HybridBlockManager",
    "HybridPrefillBatch",
    "HybridStepDelta",
    "HybridStepResult",
    "SlidingWindowSpec",
    "CopyKind",
    "CopyPlan",
    "NULL_BLOCK",
    "PrefillBatch",
    "PrefixHit",
    "Stats",
    "StepDelta",
    "StepResult",
    "TableUpdates",
    "block_hashes",
    "events",
    "errors",
    "PagedKVError",
    "InvalidArgumentError",
    "InvalidTokensError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "SequenceStateError",
    "OutOfBlocksError",
    "PromptTooLongError",
    "TableWidthError",
    "PinBudgetError",
    "UnknownPinError",
    "UnknownHoldError",
    "UnknownStoreError",
    "ExternalLoad",
    "Hold",
    "StorePlan",
    "EVICTION_POLICIES",
    "EvictionPolicy",
    "Pin",
]
