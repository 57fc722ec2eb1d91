"""Helpers shared by the engine tests (kept out of conftest.py so tests can import them by name)."""

from __future__ import annotations

from typing import Any

import numpy as np

NULL = -1  # pagedkv.NULL_BLOCK

#: Logit tolerance of paged vs reference. Both run in float32 but sum in different orders (batched
#: scaled_dot_product_attention vs per-sequence einsum); over 30 layers that leaves differences of
#: up to about 2e-4 on logits of magnitude ~20. An indexing or masking bug moves logits by far more.
ATOL = 5e-4


class ScrambledPager:
    """A toy block allocator for tests: hands out block ids in a shuffled order.

    Block tables therefore are non-contiguous and non-monotonic. ``release`` replaces a table entry
    by ``NULL_BLOCK`` and puts the block back on the free list so that it is reused at once.
    """

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
        self.tables: dict[Any, list[int]] = {}
        self.lens: dict[Any, int] = {}

    def append(self, seq: Any, n: int) -> list[int]:
        """Reserve ``n`` more token slots for ``seq``; returns their physical slots."""
        table = self.tables.setdefault(seq, [])
        start = self.lens.get(seq, 0)
        slots = []
        for pos in range(start, start + n):
            if pos // self.block_size >= len(table):
                table.append(self.free.pop())
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        self.lens[seq] = start + n
        return slots

    def release(self, seq: Any, index: int) -> int:
        block = self.tables[seq][index]
        self.tables[seq][index] = NULL
        self.free.append(block)  # popped next
        return block

    def new_block(self) -> int:
        return self.free.pop()


def paged_step(engine: Any, kv_cache: Any, pager: ScrambledPager, seqs: list, new_tokens: list[list[int]],
               *, window: int | None = None, logits: Any = "last", pad_columns: int = 2, model: Any = None) -> Any:
    """Run one paged forward step: reserve slots for the new tokens of every sequence, build the
    metadata (block tables as a NULL-padded matrix wider than needed) and return the logits.
    ``model`` defaults to ``engine.paged`` (the CPU model)."""
    from pagedkv.engine.model import build_attention_metadata

    num_computed = [pager.lens.get(s, 0) for s in seqs]
    slots = [slot for s, toks in zip(seqs, new_tokens) for slot in pager.append(s, len(toks))]
    width = max(len(pager.tables[s]) for s in seqs) + pad_columns
    tables = np.full((len(seqs), width), NULL, dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(pager.tables[s])] = pager.tables[s]
    meta = build_attention_metadata(
        new_tokens, num_computed, np.asarray(slots, dtype=np.int64), tables,
        block_size=pager.block_size, sliding_window=window, logits=logits, device=kv_cache.device,
    )
    return (model or engine.paged).forward(meta, kv_cache)


def fail_sampling_of_seed(monkeypatch, message: str, seed: int = 666) -> None:
    """Make sampling raise ``FloatingPointError(message)`` for every request of ``SamplingParams(seed=seed)``, in
    each of the engine's samplers (``sample``, the batched ``sample_batch`` and the fast LM head's
    ``sample_bounded``, the default), and sample every other request as before."""
    import pagedkv.engine.core as llm_mod  # (the engine core samples)

    real, real_batch, real_bounded = llm_mod.sample, llm_mod.sample_batch, llm_mod.sample_bounded

    def picky(logits, params, num, generator):
        if params.seed == seed:
            raise FloatingPointError(message)
        return real(logits, params, num, generator)

    def picky_batch(logits, params, nums, generators):
        if any(p.seed == seed for p in params):
            raise FloatingPointError(message)
        return real_batch(logits, params, nums, generators)

    def picky_bounded(head, hidden, params, nums, generators):
        if any(p.seed == seed for p in params):
            raise FloatingPointError(message)
        return real_bounded(head, hidden, params, nums, generators)

    monkeypatch.setattr(llm_mod, "sample", picky)
    monkeypatch.setattr(llm_mod, "sample_batch", picky_batch)
    monkeypatch.setattr(llm_mod, "sample_bounded", picky_bounded)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound and released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: Any, url: str, timeout: float = 120.0) -> None:
    """Poll ``url``/health until it answers 200; AssertionError ("the server did not come up", with the end of its
    output when it is piped) once the server process ``proc`` has exited or ``timeout`` seconds have passed."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout is not None else ""
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            raise AssertionError(f"the server did not come up: it exited with {proc.returncode}\n{out[-2000:]}")
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.3)
