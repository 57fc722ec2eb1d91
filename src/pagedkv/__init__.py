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
    PromptTooLongError,
    SequenceStateError,
    UnknownSequenceError,
)
from .manager import NULL_BLOCK, AllocStatus, BlockManager, Stats, StepResult

__version__ = "0.1.0"

__all__ = [
    "AllocStatus",
    "BlockManager",
    "NULL_BLOCK",
    "Stats",
    "StepResult",
    "errors",
    "PagedKVError",
    "InvalidArgumentError",
    "InvalidTokensError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "SequenceStateError",
    "OutOfBlocksError",
    "PromptTooLongError",
]
