"""Input validation shared by the block manager's calls (every bad input raises a typed error)."""

from __future__ import annotations

from itertools import chain

import numpy as np

from .errors import InvalidArgumentError, InvalidTokensError

_TOKEN_MAX = 2**31 - 1
_INT = {int}


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int, or InvalidArgumentError if it is not an int (bools excluded) or is below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def as_tokens(token_ids: object, what: str = "token_ids") -> np.ndarray:
    """Validate a 1-D sequence of token ids and return it as int32."""
    if type(token_ids) is list and 0 < len(token_ids) <= 512:  # a short list: Python reductions beat numpy's
        arr = np.array(token_ids)
        if arr.dtype.kind in "iu" and arr.ndim == 1 and min(token_ids) >= 0 and max(token_ids) <= _TOKEN_MAX:
            return arr.astype(np.int32)
    arr = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidTokensError(f"{what} must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidTokensError(f"{what} is empty")
    if arr.dtype.kind not in "iu":
        raise InvalidTokensError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > _TOKEN_MAX:
        raise InvalidTokensError(f"{what} must lie in [0, 2**31), got min {arr.min()} max {arr.max()}")
    return arr.astype(np.int32, copy=False)


def token_count(token_ids: list) -> int:
    """``len(token_ids)`` of a list that :func:`as_tokens` would accept (checked in Python for short lists)."""
    if 0 < len(token_ids) <= 512 and set(map(type, token_ids)) == _INT:
        if min(token_ids) >= 0 and max(token_ids) <= _TOKEN_MAX:
            return len(token_ids)
    return as_tokens(token_ids).size  # raises the precise error (or accepts a long list)


def flat_tokens(token_ids: object, num_new_tokens: object, b: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Validate a flat batch (tokens, counts); counts None when every sequence gets exactly one token."""
    counts = np.asarray(num_new_tokens)
    if counts.ndim != 1 or counts.size != b or (b and counts.dtype.kind not in "iu"):
        raise InvalidTokensError(f"num_new_tokens must be {b} integers, got {counts.dtype} of shape {counts.shape}")
    if b and counts.min() < 1:
        raise InvalidTokensError("every sequence of the batch needs at least one new token")
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidTokensError(f"with num_new_tokens, token_ids must be 1-D, got shape {arr.shape}")
    if arr.size != counts.sum():
        raise InvalidTokensError(f"got {arr.size} tokens for num_new_tokens summing to {counts.sum()}")
    return arr, (None if arr.size == b else counts.astype(np.int64, copy=False))

def new_token_counts(num_new_tokens: object, b: int) -> np.ndarray:
    """``num_new_tokens`` of ``can_append_slots`` as int64 (b,): one int (>= 1) for every sequence, or one count
    (>= 1) per sequence (a ragged batch). InvalidArgumentError otherwise. O(b)."""
    if isinstance(num_new_tokens, (int, np.integer)) and not isinstance(num_new_tokens, bool):
        return np.full(b, check_int("num_new_tokens", num_new_tokens, 1), dtype=np.int64)
    if isinstance(num_new_tokens, (str, bytes, bool)) or num_new_tokens is None:
        raise InvalidArgumentError(f"num_new_tokens must be an int or {b} ints, got {num_new_tokens!r}")
    counts = np.asarray(num_new_tokens)
    if counts.ndim != 1 or counts.size != b or (b and counts.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"num_new_tokens must be an int or {b} ints (one per sequence), got "
                                   f"{counts.dtype} of shape {counts.shape}")
    if b and counts.min() < 1:
        raise InvalidArgumentError("num_new_tokens: every sequence of the batch needs at least one new token")
    return counts.astype(np.int64)


def batch_tokens(token_ids: object, b: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Flatten a batch's new tokens; returns (flat tokens, per-sequence counts or None for one each)."""
    if isinstance(token_ids, np.ndarray) or not isinstance(token_ids, (list, tuple)) or not token_ids or \
            not isinstance(token_ids[0], (list, tuple, np.ndarray)):
        arr = np.asarray(token_ids)
        if arr.ndim == 1 and arr.size == b:
            return arr, None
        if arr.ndim == 2 and arr.shape[0] == b and arr.shape[1] >= 1:
            return arr.reshape(-1), np.full(b, arr.shape[1], dtype=np.int64)
        raise InvalidTokensError(f"token_ids must have shape ({b},) or ({b}, k), got {arr.shape}")
    if len(token_ids) != b:
        raise InvalidTokensError(f"token_ids has {len(token_ids)} lists for a batch of {b}")
    try:  # one pass of C-level iteration, not one numpy call per sequence
        counts = np.fromiter(map(len, token_ids), dtype=np.int64, count=b)
        flat = np.asarray(list(chain.from_iterable(token_ids)))
    except (TypeError, ValueError):
        flat = None
    if flat is None or flat.ndim != 1:
        raise InvalidTokensError("token_ids: a ragged batch needs one 1-D token list per sequence")
    if counts.min() < 1:
        raise InvalidTokensError("every sequence of the batch needs at least one new token")
    return flat, counts


def batch_args(seq_ids: object, token_ids: object, namespaces: object, num_new_tokens: object) -> tuple:
    """``allocate_batch``'s per-prompt arguments checked: ``(seq_ids, prompts, namespaces, chunks)`` as lists of
    one entry per sequence (``namespaces``: None for each when None; ``chunks``: None, or one chunk size >= 1 per
    prompt). The prompts' tokens are checked later, each by :func:`as_tokens`. InvalidTokensError (not one prompt
    per sequence), InvalidArgumentError. O(B)."""
    seq_ids = list(seq_ids)
    b = len(seq_ids)
    prompts = list(token_ids) if not isinstance(token_ids, np.ndarray) or token_ids.ndim == 2 else None
    if prompts is None or len(prompts) != b:
        raise InvalidTokensError(
            f"token_ids must hold one prompt per sequence ({b}), got "
            f"{'an array of shape ' + str(token_ids.shape) if prompts is None else len(prompts)}")
    if namespaces is None:
        namespaces = [None] * b
    else:
        if isinstance(namespaces, (str, bytes, int)):
            raise InvalidArgumentError("namespaces must be a sequence of one namespace per prompt")
        namespaces = list(namespaces)
        if len(namespaces) != b:
            raise InvalidArgumentError(f"got {len(namespaces)} namespaces for {b} prompts")
    chunks = None
    if num_new_tokens is not None:
        if isinstance(num_new_tokens, (int, np.integer, str, bytes)) or len(num_new_tokens) != b:
            raise InvalidArgumentError("num_new_tokens must be None or one chunk size per prompt")
        chunks = [check_int(f"num_new_tokens[{i}]", c, 1) for i, c in enumerate(num_new_tokens)]
    return seq_ids, prompts, namespaces, chunks
