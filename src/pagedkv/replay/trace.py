"""Request traces in the Mooncake format: parsing and deterministic token synthesis.

One JSON object per line (blank lines are skipped)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival time in ms, ``input_length`` and ``output_length`` count tokens, ``hash_ids`` has one
id per ``trace_block`` (512) tokens of the prompt: ``ceil(input_length / 512)`` ids, the last block possibly
partial. Ids are chained prefix hashes remapped to small ints, so equal ids at the same position mean an identical
prefix up to and including that block.

Token synthesis: token ``j`` (``0 <= j < 512``) of the trace block with id ``h`` is ``d(h) * 512 + j`` where ``d``
maps the trace's ids to dense indices (identity when every id is below ``2**31 // 512``). Equal ids therefore give
equal tokens, different ids different tokens (no accidental sharing), and a partial last block holds the first
tokens of its id's block. A prompt's tokens are one vectorised expression: O(prompt tokens) numpy work, no cache.

:class:`Trace` keeps the whole trace in a few flat numpy arrays (about 40 bytes per request plus 8 per id).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["Trace", "TraceFormatError", "load_trace", "parse_trace_lines", "TRACE_BLOCK"]

TRACE_BLOCK = 512
"""Tokens per hash id in the Mooncake traces."""

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceFormatError(InvalidArgumentError):
    """A trace line is malformed. ``line`` is its 1-based line number (0 when the problem is the whole file)."""

    def __init__(self, message: str, line: int = 0, source: str = "") -> None:
        where = f"{source}:{line}: " if line and source else (f"line {line}: " if line else "")
        super().__init__(where + message)
        self.line = line


def _int_field(obj: dict, name: str, minimum: int, lineno: int, source: str) -> int:
    if name not in obj:
        raise TraceFormatError(f"missing field {name!r}", lineno, source)
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceFormatError(f"{name} must be an integer, got {v!r}", lineno, source)
    if v < minimum:
        raise TraceFormatError(f"{name} must be >= {minimum}, got {v}", lineno, source)
    return v


@dataclass
class Trace:
    """A parsed trace: request ``i`` arrives at ``timestamps[i]`` ms with an ``input_lengths[i]``-token prompt whose
    trace-block ids are ``hash_ids[offsets[i]:offsets[i + 1]]``, and generates ``output_lengths[i]`` tokens."""

    name: str
    timestamps: np.ndarray  # int64 (n,), ms
    input_lengths: np.ndarray  # int64 (n,)
    output_lengths: np.ndarray  # int64 (n,)
    offsets: np.ndarray  # int64 (n + 1,)
    hash_ids: np.ndarray  # int64 (total ids,), as in the file
    trace_block: int = TRACE_BLOCK

    def __post_init__(self) -> None:
        ids = self.hash_ids
        if ids.size and int(ids.max()) >= (2**31 - 1) // self.trace_block:  # keep tokens < 2**31: dense ids
            _, dense = np.unique(ids, return_inverse=True)
            if dense.size and int(dense.max()) >= (2**31 - 1) // self.trace_block:
                raise TraceFormatError(f"more than {(2**31 - 1) // self.trace_block:,} distinct hash ids", 0, self.name)
            self._dense = dense.astype(np.int64)
        else:
            self._dense = ids
        # int32 arithmetic for tokens: every token is below 2**31 by the rule above
        self._dense32 = (self._dense * self.trace_block).astype(np.int32)
        self._lanes = np.arange(self.trace_block, dtype=np.int32)

    def __len__(self) -> int:
        return int(self.input_lengths.size)

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_lengths.sum())

    def ids(self, i: int) -> np.ndarray:
        """Trace-block ids of request ``i`` (a view)."""
        return self.hash_ids[self.offsets[i] : self.offsets[i + 1]]

    def tokens(self, i: int) -> np.ndarray:
        """The ``input_lengths[i]`` prompt tokens of request ``i`` (int32, fresh array). O(prompt tokens)."""
        d = self._dense32[self.offsets[i] : self.offsets[i + 1]]
        return (d[:, None] + self._lanes).ravel()[: int(self.input_lengths[i])]

    def limit(self, n: int | None) -> Trace:
        """The first ``n`` requests (all of them when ``n`` is None or larger)."""
        if n is None or n >= len(self):
            return self
        end = int(self.offsets[n])
        return Trace(self.name, self.timestamps[:n], self.input_lengths[:n], self.output_lengths[:n],
                     self.offsets[: n + 1], self.hash_ids[:end], self.trace_block)

    def nodes(self, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The prompts' *full* blocks of ``block_size`` tokens as prefix-tree node ids, flat, with per-request
        offsets ``(nodes, offsets)``. Two blocks get the same node iff they hold the same tokens after the same
        prefix. ``block_size`` must divide the trace block (16 and 512 for Mooncake). O(total blocks), numpy.

        A node is ``dense_id * (trace_block // block_size) + sub-block``: the id fixes the prefix and position, the
        sub-block the slice of its trace block (a partial trace block contributes its full sub-blocks)."""
        tb = self.trace_block
        if block_size < 1 or tb % block_size:
            raise InvalidArgumentError(f"block size {block_size} must divide the trace block ({tb})")
        per = tb // block_size
        nfull = self.input_lengths // block_size  # full blocks per request
        counts = nfull
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        total = int(offsets[-1])
        # block k of request i lies in trace block k // per of the request, sub-block k % per
        req = np.repeat(np.arange(len(self), dtype=np.int64), counts)
        k = np.arange(total, dtype=np.int64) - offsets[req]
        ids = self._dense[self.offsets[req] + k // per]
        return ids * per + k % per, offsets


def parse_trace_lines(lines, name: str = "<trace>") -> Trace:
    """Parse an iterable of JSON lines. Raises :class:`TraceFormatError` naming the first bad line. O(size)."""
    ts: list[int] = []
    inp: list[int] = []
    out: list[int] = []
    lens: list[int] = []
    ids: list[int] = []
    tb = TRACE_BLOCK
    lineno = 0
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise TraceFormatError(f"not valid JSON ({e.msg} at column {e.colno})" if hasattr(e, "msg")
                                   else "not valid JSON", lineno, name) from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"expected a JSON object, got {type(obj).__name__}", lineno, name)
        t = _int_field(obj, "timestamp", 0, lineno, name)
        n = _int_field(obj, "input_length", 1, lineno, name)
        o = _int_field(obj, "output_length", 0, lineno, name)
        h = obj.get("hash_ids")
        if not isinstance(h, list):
            raise TraceFormatError("missing field 'hash_ids'" if h is None else
                                   f"hash_ids must be a list of integers, got {type(h).__name__}", lineno, name)
        if len(h) != -(-n // tb):
            raise TraceFormatError(f"input_length {n} needs {-(-n // tb)} hash ids of {tb} tokens, got {len(h)}",
                                   lineno, name)
        for x in h:
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise TraceFormatError(f"hash_ids must be non-negative integers, got {x!r}", lineno, name)
        ts.append(t)
        inp.append(n)
        out.append(o)
        lens.append(len(h))
        ids.extend(h)
    if not inp:
        raise TraceFormatError("the trace has no requests", 0, name)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(np.array(lens, dtype=np.int64), out=offsets[1:])
    try:
        hid = np.array(ids, dtype=np.int64)
    except OverflowError:
        raise TraceFormatError("a hash id does not fit in 64 bits", 0, name) from None
    return Trace(name, np.array(ts, dtype=np.int64), np.array(inp, dtype=np.int64), np.array(out, dtype=np.int64),
                 offsets, hid)


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Read a trace file (the first ``limit`` requests when given). Raises FileNotFoundError or
    :class:`TraceFormatError`."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        if limit is None:
            return parse_trace_lines(f, path.name)

        def head():
            kept = 0
            for line in f:
                if kept >= limit:
                    return
                kept += bool(line.strip())
                yield line

        return parse_trace_lines(head(), path.name)
