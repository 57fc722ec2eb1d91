"""A multi-turn, shared-prefix serving workload scaled down from a Mooncake trace (for ``pagedkv bench serve
--trace``): whole conversations are sampled, kept in trace order, and shrunk so a small CPU model serves them.

A *conversation* is the set of requests whose first two trace-block ids agree (every request of the
conversation trace shares the first id, a system prompt; the second starts the conversation's own history). A
seeded sample of ``conversations`` conversations with at least ``min_turns`` requests is kept, in arrival order.
Each 512-token trace block becomes ``tokens_per_id`` tokens: the block with id ``h`` is ``tokens_per_id``
pseudo-random token ids in ``[low, high)`` drawn from a generator seeded with ``h``, so equal ids give equal
tokens (the prefix structure survives the scaling) and different ids different ones (up to chance). A prompt
of ``n`` tokens becomes ``ceil(n * tokens_per_id / 512)`` tokens; prompts longer than ``max_tokens`` after
scaling are left out.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

from .trace import TRACE_BLOCK

__all__ = ["trace_prompts"]


def trace_prompts(path: str | Path, *, conversations: int = 24, min_turns: int = 3, tokens_per_id: int = 16,
                  max_tokens: int = 2048, seed: int = 0, low: int = 1000, high: int = 20000,
                  return_times: bool = False):
    """Prompts (token-id lists) of the sampled conversations, in arrival order (see the module docstring).
    With ``return_times``: ``(prompts, times)``, ``times[i]`` the arrival of prompt ``i`` in seconds after the
    first kept one."""
    if conversations < 1 or min_turns < 1 or not 1 <= tokens_per_id <= TRACE_BLOCK:
        raise ValueError("conversations and min_turns must be >= 1, tokens_per_id in [1, 512]")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append((r["timestamp"], r["input_length"], r["hash_ids"]))
    rows.sort(key=lambda r: r[0])
    groups: dict = defaultdict(list)
    for i, (_, n, ids) in enumerate(rows):
        if len(ids) >= 2:
            groups[tuple(ids[:2])].append(i)
    keys = sorted(k for k, v in groups.items() if len(v) >= min_turns)
    if not keys:
        raise ValueError(f"no conversation of {min_turns} or more requests in {path}")
    chosen = random.Random(seed).sample(keys, min(conversations, len(keys)))
    picked = sorted(i for k in chosen for i in groups[k])
    memo: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        b = memo.get(h)
        if b is None:
            rng = random.Random(h * 1_000_003 + seed)
            b = memo[h] = [rng.randrange(low, high) for _ in range(tokens_per_id)]
        return b

    out, times = [], []
    for i in picked:
        ts, n, ids = rows[i]
        m = -(-n * tokens_per_id // TRACE_BLOCK)
        if m > max_tokens:
            continue
        toks = [t for h in ids for t in block(h)]
        out.append(toks[:m])
        times.append(ts / 1000.0)
    if return_times:
        return out, [t - times[0] for t in times] if times else []
    return out
