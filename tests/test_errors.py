"""Bad input: every error is a typed pagedkv.errors exception whose message names the problem, and the call
leaves the manager exactly as it was (compared through a snapshot of its complete internal state)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedkv import AllocStatus, BlockManager
from pagedkv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidTokensError,
    OutOfBlocksError,
    PagedKVError,
    PromptTooLongError,
    SequenceStateError,
    UnknownSequenceError,
)


# ---------------------------------------------------------------------- snapshot of the whole internal state
def _pool(p):
    return {
        "num_blocks": p.num_blocks,
        "ref": p.ref.tolist(),
        "free_ring": p.free_ids().tolist(),  # in order: the order decides which blocks are handed out next
        "head": p.head,
        "nfree": p.nfree,
    }


def snapshot(bm: BlockManager) -> dict:
    """Everything a call could change: per-row arrays of live rows, tables, pools, the prefix cache (map,
    per-block tokens / keys / content ids, LRU order, namespace roots), the CPU side of the cache, counters and
    the batch memo."""
    caching = bm._cache is not None
    rows = []
    for sid, row in bm._t.row_of.items():
        n, nb = int(bm._t.ntok[row]), int(bm._t.nblk[row])
        rows.append(
            {
                "seq": sid,
                "row": row,
                "ntok": n,
                "nblk": nb,
                "nrel": int(bm._t.nrel[row]),
                "nreg": int(bm._t.nreg[row]),
                "swapped": bool(bm._t.swapped[row]),
                "table": bm._t.table[row].tolist(),  # the whole row: padding must stay NULL_BLOCK
                "chain": (int(bm._t.ccid[row]), int(bm._t.ckey[row])),
            }
        )
    snap = {
        "config": (bm._bs, bm._window, bm._watermark_blocks, caching),
        "rows": rows,
        "row_of": list(bm._t.row_of.items()),
        "seq_of": list(bm._t.seq_of),
        "free_rows": list(bm._t.free_rows),
        "partial": dict(bm._t.partial),  # chunked prefill: prompt lengths of partly allocated ones
        "capacity": (bm._t.table.shape, len(bm._t.ntok)),
        "gpu": _pool(bm._gpu),
        "cpu": _pool(bm._cpu),
        "counters": (
            bm._step.cow_copies,
            bm._small.cow_copies,
            bm._swap.swapped_out,
            bm._swap.swapped_in,
            bm._alloc.query_tokens,
            bm._alloc.hit_tokens,
            bm._alloc.query_blocks,
            bm._alloc.hit_blocks,
        ),
        "stats": tuple(bm.stats),
        "memo": (None if bm._t.memo_ids is None else list(bm._t.memo_ids), bm._t.memo_rows.tolist()),
    }
    if caching:
        c = bm._cache
        snap["cache"] = {
            "map": sorted(c.mapping().items()),
            "tokens": c.tok.tolist(),  # every block's, free ones included: a failed call writes none
            "key": c.key.tolist(),
            "cid": c.cid.tolist(),
            "pcid": c.pcid.tolist(),
            "serial": c.serial,
            "lru": list(c.evictor),
            "lru_len": len(c.evictor),
            "roots": list(c.roots.items()),
            "evictions": c.evictions,
        }
        snap["cpu_cache"] = (bm._cpu_tok.tolist(), bm._cpu_id.tolist())
    return snap


def check_raises(bm, exc, fn, *args, must_mention=(), **kwargs):
    """``fn(*args, **kwargs)`` raises exactly ``exc`` with a message containing each of ``must_mention`` and
    leaves ``bm`` unchanged."""
    before = snapshot(bm)
    with pytest.raises(PagedKVError) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc, f"raised {type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    for m in must_mention:
        assert str(m) in msg, f"message {msg!r} does not mention {m!r}"
    assert_unchanged(bm, before, f"{fn.__name__} raised {exc.__name__}")
    bm.check_invariants()
    return info.value


def assert_unchanged(bm, before: dict, what: str) -> None:
    """``bm``'s state equals the snapshot ``before`` (the memo may differ only as described at MEMO_STRICT)."""
    after = snapshot(bm)
    for k in before:
        if k == "memo" and not MEMO_STRICT and after[k] != before[k]:
            check_memo(bm)
            continue
        assert after[k] == before[k], f"{what} but changed {k}: {before[k]!r} -> {after[k]!r}"


# The batch memo (last seq_ids list -> validated rows) is written as soon as the ids of a batch validate, so a
# call that then fails on its tokens, lookahead or pool size leaves the memo of that batch behind. The memo is a
# pure cache, invisible to callers: it can only hold a batch of live, distinct, GPU-resident sequences and is
# dropped whenever rows or residency change. Set MEMO_STRICT to demand the memo itself be untouched as well.
MEMO_STRICT = False


def check_memo(bm):
    """The memo, if set, maps a batch of live, distinct, GPU-resident sequences to their current rows."""
    if bm._t.memo_ids is None:
        return
    rows = [bm._t.row_of[s] for s in bm._t.memo_ids]
    assert rows == bm._t.memo_rows.tolist(), "stale memo"
    assert len(set(rows)) == len(rows) and not any(bm._t.swapped[r] for r in rows)


# ---------------------------------------------------------------------- fixtures
CONFIGS = [
    pytest.param(dict(enable_prefix_caching=True), id="cache"),
    pytest.param(dict(enable_prefix_caching=False), id="nocache"),
    pytest.param(dict(enable_prefix_caching=True, sliding_window=5), id="cache-window"),
]


def populated(**kw) -> BlockManager:
    """16 GPU blocks of 4 tokens, 8 CPU blocks: live sequences "a", "b" (shares a's prefix), 3, "c" (a fork of
    "a", swapped out), cached blocks waiting in the evictor, and a batch memo."""
    bm = BlockManager(16, 4, num_cpu_blocks=8, watermark=0, **kw)
    bm.allocate("a", list(range(10)))
    bm.decode_step(["a"], np.array([1]))
    bm.allocate("b", list(range(9)))
    bm.fork("a", "c")
    bm.allocate(3, [5, 5, 5, 5, 5])
    bm.decode_step([3], [6])
    bm.allocate("gone", [7] * 8)
    bm.decode_step(["gone"], [1])
    bm.free("gone")
    bm.swap_out(["c"])
    bm.decode_step(["a", "b"], np.array([1, 2]))
    bm.check_invariants()
    return bm


@pytest.fixture(params=CONFIGS)
def bm(request):
    return populated(**request.param)


def full_manager(**kw) -> BlockManager:
    """4 GPU blocks of 2 tokens, all held by sequences whose last block is full."""
    bm = BlockManager(4, 2, watermark=0, **kw)
    bm.allocate("x", [1, 2, 3, 4])
    bm.allocate("y", [5, 6, 7, 8])
    assert bm.num_free_gpu_blocks == 0
    return bm


# ---------------------------------------------------------------------- unknown and duplicate sequence ids
UNKNOWN_CALLS = [
    ("num_tokens", lambda bm, s: bm.num_tokens(s)),
    ("is_swapped", lambda bm, s: bm.is_swapped(s)),
    ("block_table", lambda bm, s: bm.block_table(s)),
    ("slot_mapping", lambda bm, s: bm.slot_mapping(s, 0, 1)),
    ("fork", lambda bm, s: bm.fork(s, "new-child")),
    ("free", lambda bm, s: bm.free(s)),
    ("free-nocache", lambda bm, s: bm.free(s, cache=False)),
    ("can_append_slots", lambda bm, s: bm.can_append_slots(["a", s])),
    ("append_slots", lambda bm, s: bm.append_slots(s, [1])),
    ("decode_step", lambda bm, s: bm.decode_step(["a", s], np.array([1, 2]))),
    ("decode_step-first", lambda bm, s: bm.decode_step([s, "a"], [1, 2])),
    ("decode_step-2d", lambda bm, s: bm.decode_step([s], np.array([[1, 2]]))),
    ("can_swap_out", lambda bm, s: bm.can_swap_out([s])),
    ("swap_out", lambda bm, s: bm.swap_out(["a", s])),
    ("can_swap_in", lambda bm, s: bm.can_swap_in(["c", s])),
    ("swap_in", lambda bm, s: bm.swap_in([s])),
]


@pytest.mark.parametrize("name,call", UNKNOWN_CALLS, ids=[c[0] for c in UNKNOWN_CALLS])
@pytest.mark.parametrize("seq", ["ghost", 12345, ("t", 1)], ids=["str", "int", "tuple"])
def test_unknown_sequence(bm, name, call, seq):
    e = check_raises(bm, UnknownSequenceError, call, bm, seq, must_mention=[repr(seq)])
    assert isinstance(e, KeyError)  # generic handlers keep working


def test_double_free(bm):
    bm.free(3)
    check_raises(bm, UnknownSequenceError, bm.free, 3, must_mention=["3"])
    bm.free("c")  # swapped out
    check_raises(bm, UnknownSequenceError, bm.free, "c", must_mention=["'c'"])
    check_raises(bm, UnknownSequenceError, bm.decode_step, ["c"], np.array([1]), must_mention=["'c'"])


def test_duplicate_sequence_ids(bm):
    check_raises(bm, DuplicateSequenceError, bm.allocate, "a", [1, 2], must_mention=["'a'"])
    check_raises(bm, DuplicateSequenceError, bm.allocate, "c", [1, 2], must_mention=["'c'"])  # swapped out
    check_raises(bm, DuplicateSequenceError, bm.fork, "a", "b", must_mention=["'b'"])
    check_raises(bm, DuplicateSequenceError, bm.fork, "a", "a", must_mention=["'a'"])
    check_raises(bm, DuplicateSequenceError, bm.fork, "c", 3, must_mention=["3"])


@pytest.mark.parametrize(
    "call",
    [
        lambda bm: bm.decode_step(["a", "b", "b"], np.array([1, 2, 3])),
        lambda bm: bm.decode_step(["b", "b"], [[1], [2, 3]]),
        lambda bm: bm.can_append_slots(["b", 3, "b"]),
        lambda bm: bm.swap_out(["b", "b"]),
        lambda bm: bm.can_swap_out(["b", 3, "b"]),
    ],
    ids=["decode", "decode-ragged", "can_append", "swap_out", "can_swap_out"],
)
def test_sequence_twice_in_one_batch(bm, call):
    check_raises(bm, DuplicateSequenceError, call, bm, must_mention=["'b'"])


def test_sequence_twice_in_one_swap_in(bm):
    bm.swap_out(["b"])
    check_raises(bm, DuplicateSequenceError, bm.swap_in, ["c", "b", "c"], must_mention=["'c'"])
    check_raises(bm, DuplicateSequenceError, bm.can_swap_in, ["c", "c"], must_mention=["'c'"])


@pytest.mark.parametrize("bad", [[1], {"k": 1}, {2}, np.array([1])], ids=["list", "dict", "set", "ndarray"])
def test_unhashable_sequence_id(bm, bad):
    calls = [
        lambda: bm.allocate(bad, [1, 2]),
        lambda: bm.fork("a", bad),
        lambda: bm.fork(bad, "z"),
        lambda: bm.free(bad),
        lambda: bm.num_tokens(bad),
        lambda: bm.block_table(bad),
        lambda: bm.slot_mapping(bad, 0, 1),
        lambda: bm.append_slots(bad, [1]),
        lambda: bm.decode_step(["a", bad], np.array([1, 2])),
        lambda: bm.can_append_slots([bad]),
        lambda: bm.swap_out([bad]),
        lambda: bm.can_swap_out([bad]),
        lambda: bm.swap_in([bad]),
        lambda: bm.can_swap_in([bad]),
    ]
    for call in calls:
        check_raises(bm, InvalidArgumentError, call, must_mention=["hashable"])
    assert bad not in bm


# ---------------------------------------------------------------------- sequence state
def test_swap_state_errors(bm):
    check_raises(bm, SequenceStateError, bm.swap_in, ["a"], must_mention=["'a'", "not swapped"])
    check_raises(bm, SequenceStateError, bm.swap_in, ["c", "b"], must_mention=["'b'"])
    check_raises(bm, SequenceStateError, bm.can_swap_in, ["a"], must_mention=["'a'"])
    check_raises(bm, SequenceStateError, bm.swap_out, ["c"], must_mention=["'c'", "already"])
    check_raises(bm, SequenceStateError, bm.swap_out, ["a", "c"], must_mention=["'c'"])
    check_raises(bm, SequenceStateError, bm.can_swap_out, ["c"], must_mention=["'c'"])
    bm.swap_out([3])
    check_raises(bm, SequenceStateError, bm.swap_out, [3], must_mention=["3"])  # swapping out twice


def test_appending_to_a_swapped_out_sequence(bm):
    check_raises(bm, SequenceStateError, bm.append_slots, "c", [1], must_mention=["'c'", "swapped"])
    check_raises(bm, SequenceStateError, bm.decode_step, ["a", "c"], np.array([1, 2]), must_mention=["'c'"])
    check_raises(bm, SequenceStateError, bm.decode_step, ["c"], [[1, 2]], must_mention=["'c'"])
    check_raises(bm, SequenceStateError, bm.can_append_slots, ["c"], must_mention=["'c'"])
    check_raises(bm, SequenceStateError, bm.slot_mapping, "c", 0, 1, must_mention=["'c'"])


def test_memoised_batch_does_not_hide_a_swap():
    bm = populated(enable_prefix_caching=True)
    bm.decode_step(["a", "b"], np.array([1, 2]))
    bm.swap_out(["b"])
    check_raises(bm, SequenceStateError, bm.decode_step, ["a", "b"], np.array([1, 2]), must_mention=["'b'"])
    bm.free("b")
    check_raises(bm, UnknownSequenceError, bm.decode_step, ["a", "b"], np.array([1, 2]), must_mention=["'b'"])


def test_slot_mapping_of_positions_released_by_the_window():
    bm = BlockManager(16, 2, sliding_window=3, watermark=0)
    bm.allocate("w", [1, 2, 3, 4, 5])
    bm.decode_step(["w"], np.array([6]))
    assert bm.block_table("w")[0] == -1
    check_raises(bm, SequenceStateError, bm.slot_mapping, "w", 0, 3, must_mention=["'w'", "window"])
    assert bm.slot_mapping("w", 2, 6).size == 4


# ---------------------------------------------------------------------- out of blocks
def test_prompt_too_long(bm):
    e = check_raises(bm, PromptTooLongError, bm.allocate, "long", list(range(65)), must_mention=["65", "17"])
    assert isinstance(e, OutOfBlocksError)
    assert bm.can_allocate(list(range(65))) is AllocStatus.NEVER
    assert bm.can_allocate(list(range(64))) is not AllocStatus.NEVER


def test_prompt_too_long_counts_the_watermark():
    bm = BlockManager(10, 4, watermark=0.2)  # 2 blocks kept free
    check_raises(bm, PromptTooLongError, bm.allocate, "p", list(range(33)), must_mention=["33"])
    bm.allocate("p", list(range(32)))


@pytest.mark.parametrize("kw", [{}, dict(enable_prefix_caching=True)], ids=["nocache", "cache"])
def test_out_of_blocks(kw):
    bm = full_manager(**kw)
    assert bm.can_allocate([9]) is AllocStatus.LATER
    check_raises(bm, OutOfBlocksError, bm.allocate, "z", [9], must_mention=["free"])
    assert not bm.can_append_slots(["x"])
    check_raises(bm, OutOfBlocksError, bm.decode_step, ["x"], np.array([1]), must_mention=["free"])
    check_raises(bm, OutOfBlocksError, bm.decode_step, ["x", "y"], [[1], [2, 3]])
    check_raises(bm, OutOfBlocksError, bm.append_slots, "y", [1, 2])
    bm.free("y")
    # 2 free blocks: one step with lookahead needing 3 does not fit, and changes nothing
    check_raises(bm, OutOfBlocksError, bm.append_slots, "x", [1], num_lookahead_slots=4)
    check_raises(bm, OutOfBlocksError, bm.allocate, "z", [7, 7, 7, 7, 7])  # (no prefix hit)
    bm.allocate("z", [1, 2, 3])


def test_out_of_blocks_with_copy_on_write():
    bm = BlockManager(3, 4, watermark=0)
    bm.allocate("p", [1, 2, 3, 4, 5])  # 2 blocks, the last one partial
    bm.fork("p", "q")
    bm.allocate("r", [1])  # the pool is full
    assert not bm.can_append_slots(["q"])
    check_raises(bm, OutOfBlocksError, bm.decode_step, ["q"], np.array([7]), must_mention=["1"])
    check_raises(bm, OutOfBlocksError, bm.append_slots, "p", [7])
    bm.free("r")
    # one free block: one copy fits, but p and q both writing their shared block needs only one copy too
    bm.decode_step(["p", "q"], np.array([7, 8]))
    bm.check_invariants()


def test_swap_out_with_a_small_cpu_pool():
    bm = BlockManager(8, 2, num_cpu_blocks=2, watermark=0)
    bm.allocate("a", [1, 2, 3, 4, 5])  # 3 blocks
    bm.allocate("b", [1, 2])
    assert not bm.can_swap_out(["a"])
    check_raises(bm, OutOfBlocksError, bm.swap_out, ["a"], must_mention=["CPU"])
    check_raises(bm, OutOfBlocksError, bm.swap_out, ["b", "a"], must_mention=["CPU"])
    bm.swap_out(["b"])
    nocpu = BlockManager(8, 2, watermark=0)
    nocpu.allocate("a", [1])
    assert not nocpu.can_swap_out(["a"])
    check_raises(nocpu, OutOfBlocksError, nocpu.swap_out, ["a"], must_mention=["CPU"])


@pytest.mark.parametrize("kw", [{}, dict(enable_prefix_caching=True)], ids=["nocache", "cache"])
def test_swap_in_with_a_full_gpu(kw):
    bm = BlockManager(4, 2, num_cpu_blocks=4, watermark=0, **kw)
    bm.allocate("a", [1, 2, 3])
    bm.swap_out(["a"])
    bm.allocate("x", [7, 8, 9, 9, 9])
    bm.allocate("y", [6])
    assert bm.can_swap_in(["a"]) is AllocStatus.LATER
    check_raises(bm, OutOfBlocksError, bm.swap_in, ["a"], must_mention=["GPU"])
    bm.free("y")
    check_raises(bm, OutOfBlocksError, bm.swap_in, ["a"], must_mention=["GPU"])
    assert bm.can_swap_in(["a"], 8) is AllocStatus.NEVER


# ---------------------------------------------------------------------- token ids
EMPTY = [[], (), np.array([], dtype=np.int64), np.zeros(0)]
BAD_TOKENS = {
    "float": [1.0, 2.0],
    "float-array": np.array([1.5, 2.0]),
    "str": ["a", "b"],
    "str-scalar": "ab",
    "bool": [True, False],
    "bool-array": np.array([True]),
    "none": [1, None],
    "object": np.array([1, object()], dtype=object),
    "negative": [1, -1],
    "too-large": [2**31],
    "huge": [2**70],
    "2d": [[1, 2], [3, 4]],
    "scalar": 5,
    "complex": [1 + 2j],
}


@pytest.mark.parametrize("toks", EMPTY, ids=["list", "tuple", "int-array", "float-array"])
def test_empty_token_ids(bm, toks):
    check_raises(bm, InvalidTokensError, bm.allocate, "z", toks, must_mention=["empty"])
    check_raises(bm, InvalidTokensError, bm.can_allocate, toks, must_mention=["empty"])
    check_raises(bm, InvalidTokensError, bm.append_slots, "a", toks, must_mention=["empty"])
    check_raises(bm, InvalidTokensError, bm.decode_step, ["a", "b"], [[1], toks])
    assert "z" not in bm


@pytest.mark.parametrize("toks", list(BAD_TOKENS.values()), ids=list(BAD_TOKENS))
def test_bad_token_ids(bm, toks):
    check_raises(bm, InvalidTokensError, bm.allocate, "z", toks, must_mention=["token_ids"])
    check_raises(bm, InvalidTokensError, bm.can_allocate, toks, must_mention=["token_ids"])
    check_raises(bm, InvalidTokensError, bm.append_slots, "a", toks, must_mention=["token_ids"])
    assert "z" not in bm


BAD_STEP_TOKENS = {
    "float": np.array([1.0, 2.0]),
    "float-list": [1.0, 2.0],
    "str": ["a", "b"],
    "bool": np.array([True, False]),
    "negative": np.array([1, -1]),
    "negative-list": [-1, 1],
    "negative-2d": np.array([[1], [-3]]),
    "negative-ragged": [[1, 2], [-3]],
    "too-large": np.array([1, 2**31]),
    "too-few": np.array([1]),
    "too-many": np.array([1, 2, 3]),
    "2d-wrong-rows": np.array([[1, 2]]),
    "2d-no-columns": np.zeros((2, 0), dtype=np.int64),
    "3d": np.ones((2, 1, 1), dtype=np.int64),
    "scalar": 1,
    "ragged-wrong-count": [[1], [2], [3]],
    "ragged-empty": [[1], []],
    "ragged-float": [[1], [2.5]],
    "ragged-nested": [[[1, 2]], [3]],
    "ragged-scalar": [[1], 2],
    "none": None,
}


@pytest.mark.parametrize("toks", list(BAD_STEP_TOKENS.values()), ids=list(BAD_STEP_TOKENS))
def test_bad_decode_step_tokens(bm, toks):
    check_raises(bm, InvalidTokensError, bm.decode_step, ["a", "b"], toks, must_mention=["token"])
    check_raises(bm, InvalidTokensError, bm.decode_step, ["b", 3], toks, must_mention=["token"])


BAD_FLAT_STEPS = {  # (token_ids, num_new_tokens) for the batch ["a", "b"]
    "counts-short": (np.array([1, 2]), np.array([2])),
    "counts-long": (np.array([1, 2, 3]), np.array([1, 1, 1])),
    "counts-zero": (np.array([1, 2]), np.array([2, 0])),
    "counts-negative": (np.array([1, 2]), np.array([3, -1])),
    "counts-float": (np.array([1, 2]), np.array([1.0, 1.0])),
    "counts-2d": (np.array([1, 2]), np.array([[1, 1]])),
    "sum-too-small": (np.array([1, 2]), np.array([2, 1])),
    "sum-too-large": (np.array([1, 2, 3, 4]), np.array([2, 1])),
    "tokens-2d": (np.array([[1, 2], [3, 4]]), np.array([2, 2])),
    "tokens-float": (np.array([1.0, 2.0, 3.0]), np.array([2, 1])),
    "tokens-negative": (np.array([1, -2, 3]), np.array([2, 1])),
}


@pytest.mark.parametrize("toks,counts", list(BAD_FLAT_STEPS.values()), ids=list(BAD_FLAT_STEPS))
def test_bad_flat_decode_step(bm, toks, counts):
    check_raises(bm, InvalidTokensError, bm.decode_step, ["a", "b"], toks, num_new_tokens=counts,
                 must_mention=["token"])


def test_tokens_of_other_integer_dtypes_are_accepted(bm):
    bm.allocate("u8", np.array([1, 2, 3], dtype=np.uint8))
    bm.append_slots("u8", np.array([4], dtype=np.uint64))
    bm.decode_step(["u8", "a"], np.array([5, 6], dtype=np.int16))
    assert bm.num_tokens("u8") == 5
    bm.check_invariants()


# ---------------------------------------------------------------------- sizes and options
BAD_CTOR = [
    (dict(num_gpu_blocks=0), "num_gpu_blocks"),
    (dict(num_gpu_blocks=-3), "num_gpu_blocks"),
    (dict(num_gpu_blocks=4.0), "num_gpu_blocks"),
    (dict(num_gpu_blocks="4"), "num_gpu_blocks"),
    (dict(num_gpu_blocks=True), "num_gpu_blocks"),
    (dict(num_gpu_blocks=None), "num_gpu_blocks"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=-1), "block_size"),
    (dict(block_size=2.5), "block_size"),
    (dict(num_cpu_blocks=-1), "num_cpu_blocks"),
    (dict(num_cpu_blocks=1.0), "num_cpu_blocks"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=-4), "sliding_window"),
    (dict(sliding_window=4.0), "sliding_window"),
    (dict(watermark=-0.01), "watermark"),
    (dict(watermark=1.0), "watermark"),
    (dict(watermark=1.5), "watermark"),
    (dict(watermark=math.nan), "watermark"),
    (dict(watermark="0.1"), "watermark"),
    (dict(watermark=True), "watermark"),
    (dict(watermark=None), "watermark"),
]


@pytest.mark.parametrize("kw,name", BAD_CTOR, ids=[f"{n}={list(k.values())[0]!r}" for k, n in BAD_CTOR])
def test_bad_constructor_arguments(kw, name):
    args = dict(num_gpu_blocks=8, block_size=4)
    args.update(kw)
    with pytest.raises(InvalidArgumentError) as info:
        BlockManager(args.pop("num_gpu_blocks"), **args)
    assert name in str(info.value)
    assert isinstance(info.value, ValueError)


def test_good_constructor_edge_values():
    for kw in [dict(watermark=0), dict(watermark=0.99), dict(num_cpu_blocks=0), dict(sliding_window=1),
               dict(block_size=1), dict(num_gpu_blocks=np.int64(3))]:
        args = dict(num_gpu_blocks=8, block_size=4)
        args.update(kw)
        BlockManager(args.pop("num_gpu_blocks"), **args).check_invariants()


BAD_LOOKAHEAD = [-1, 1.0, "1", True, None]


@pytest.mark.parametrize("la", BAD_LOOKAHEAD, ids=[repr(x) for x in BAD_LOOKAHEAD])
def test_bad_num_lookahead_slots(bm, la):
    m = ["num_lookahead_slots"]
    check_raises(bm, InvalidArgumentError, bm.can_allocate, [1, 2], la, must_mention=m)
    check_raises(bm, InvalidArgumentError, bm.can_append_slots, ["a"], la, must_mention=m)
    check_raises(bm, InvalidArgumentError, bm.append_slots, "a", [1], la, must_mention=m)
    check_raises(bm, InvalidArgumentError, bm.decode_step, ["a", "b"], np.array([1, 2]), la, must_mention=m)
    check_raises(bm, InvalidArgumentError, bm.decode_step, ["b"], [[1, 2]], la, must_mention=m)
    check_raises(bm, InvalidArgumentError, bm.can_swap_in, ["c"], la, must_mention=m)


@pytest.mark.parametrize("k", [0, -1, 1.0, True])
def test_bad_num_new_tokens(bm, k):
    check_raises(bm, InvalidArgumentError, bm.can_append_slots, ["a"], num_new_tokens=k, must_mention=["num_new_tokens"])


def test_bad_slot_mapping_ranges(bm):
    cap = len(bm.block_table("a")) * bm.block_size
    for start, end, what in [(-1, 2, "start"), (3, 2, "end"), (0, cap + 1, str(cap)), (1.0, 2, "start"),
                             (0, "2", "end"), (None, 1, "start"), (True, 2, "start")]:
        check_raises(bm, InvalidArgumentError, bm.slot_mapping, "a", start, end, must_mention=[what])
    assert bm.slot_mapping("a", cap - 2, cap).size == 2
    assert bm.slot_mapping("a", 2, 2).size == 0


@pytest.mark.parametrize("ns", [1.5, [1], ("t",), True, object(), {"t": 1}], ids=["float", "list", "tuple", "bool", "object", "dict"])
def test_bad_namespace(bm, ns):
    check_raises(bm, InvalidArgumentError, bm.allocate, "z", [1, 2, 3], namespace=ns, must_mention=["namespace"])
    check_raises(bm, InvalidArgumentError, bm.can_allocate, [1, 2, 3], namespace=ns, must_mention=["namespace"])
    assert "z" not in bm


def test_good_namespaces_do_not_share(bm):
    for s in ["a", "b", 3, "c"]:
        bm.free(s)
    toks = list(range(9))
    bm.allocate("first", toks)
    bm.append_slots("first", [1])  # its two full blocks enter the cache
    hits = []
    for i, ns in enumerate(["x", b"x", 0, ""]):
        hits.append(bm.allocate(f"ns{i}", toks, namespace=ns))
        bm.free(f"ns{i}", cache=False)
    assert hits == [0, 0, 0, 0]
    assert bm.allocate("again", toks) == (8 if bm.config.enable_prefix_caching else 0)


def test_failed_allocate_in_a_new_namespace(bm):
    check_raises(bm, PromptTooLongError, bm.allocate, "z", list(range(99)), namespace="fresh-ns")
    check_raises(bm, DuplicateSequenceError, bm.allocate, "a", [1], namespace="fresh-ns-2")
    check_raises(bm, InvalidTokensError, bm.allocate, "z", [-1], namespace="fresh-ns-3")


def test_every_error_leaves_a_working_manager(bm):
    """After a burst of failing calls, the manager still works and its invariants hold."""
    for call in [lambda: bm.allocate("a", [1]), lambda: bm.free("ghost"), lambda: bm.swap_in(["a"]),
                 lambda: bm.decode_step(["a"], np.array([-1.0])), lambda: bm.allocate("z", list(range(999)))]:
        with pytest.raises(PagedKVError):
            call()
    bm.decode_step(["a", "b"], np.array([1, 2]))
    bm.swap_in(["c"])
    bm.decode_step(["c"], np.array([3]))
    bm.check_invariants()
