"""Typed exceptions of pagedkv.

Every error a caller can trigger raises one of these, with a message that names the problem, and leaves the
manager exactly as it was before the call. All derive from :class:`PagedKVError`; each also derives from the
closest built-in type so that generic handlers keep working (``except KeyError`` catches an unknown sequence).
"""

from __future__ import annotations

__all__ = [
    "PagedKVError",
    "InvalidArgumentError",
    "InvalidTokensError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "SequenceStateError",
    "OutOfBlocksError",
    "PromptTooLongError",
    "UnknownHoldError",
    "UnknownStoreError",
    "TableWidthError",
    "NoChatTemplateError",
    "MissingExtraError",
    "PinBudgetError",
    "UnknownPinError",
]


class PagedKVError(Exception):
    """Base class of every pagedkv error."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else self.__class__.__name__


class InvalidArgumentError(PagedKVError, ValueError):
    """A size, count or option is out of range (negative sizes, zero blocks, bad watermark, ...)."""


class InvalidTokensError(PagedKVError, ValueError):
    """Token ids are empty, not integers, negative, too large, or of the wrong shape."""


class UnknownSequenceError(PagedKVError, KeyError):
    """The sequence id was never allocated or was already freed (this includes a double free)."""


class DuplicateSequenceError(PagedKVError, ValueError):
    """The sequence id is already allocated, or appears twice in one batch."""


class SequenceStateError(PagedKVError, RuntimeError):
    """The sequence is not where the call needs it: appending to a swapped-out sequence, swapping in a
    sequence that is not swapped out, swapping out one that already is."""


class OutOfBlocksError(PagedKVError, RuntimeError):
    """The pool does not have enough free blocks for the call right now (nothing was changed)."""


class PromptTooLongError(OutOfBlocksError):
    """The prompt needs more blocks than the pool can ever give it (pool size minus the watermark)."""


class TableWidthError(PagedKVError, ValueError):
    """A sequence needs more block-table columns than the manager's fixed ``block_table_width`` (the prompt, or
    the append, would take the sequence past ``block_table_width * block_size`` positions, lookahead included)."""


class NoChatTemplateError(PagedKVError, ValueError):
    """A chat was asked of a model whose file carries no chat template (a base model such as Gemma 3 270M's
    GGUF): chat is refused, as vLLM refuses it; plain completion is what such a model does."""


class MissingExtraError(PagedKVError, ImportError):
    """A package of an optional extra is not installed; the message names the extra to install (for example
    ``pip install 'pagedkv[gemma]'`` for Gemma 3's SentencePiece tokenizer)."""
class PinBudgetError(PagedKVError, RuntimeError):
    """A prefix pin would hold more distinct blocks than the pin budget (``pin_budget_blocks``); nothing was
    pinned."""


class UnknownPinError(PagedKVError, KeyError):
    """The pin id was never returned by ``pin_prefix``, or the pin was dropped already (unpinned or expired)."""


class UnknownHoldError(PagedKVError, KeyError):
    """The hold id was never returned by ``hold`` / ``free(..., hold_for=)``, or the hold is gone already
    (released or expired)."""


class UnknownStoreError(PagedKVError, KeyError):
    """The store id was never returned by ``take_store_plan``, or its store was completed already."""
