"""The plain-Python small-batch step (``manager/_small.py``) against the vectorised one, call for call.

Two managers get the same random calls, one with the small path (batches up to ``SMALL_BATCH``, and the batch-of-one
variant ``_step_one``) and one with ``_small_batch = 0`` (always vectorised). Every result, every error type and
the state after each call must be equal. The token arguments cover every form ``decode_step`` accepts at batch
one, and forms it refuses, so the small path's own input checks are held to the vectorised path's.
"""

import numpy as np
import pytest

import pagedkv
from pagedkv import BlockManager
from pagedkv.manager._small import SMALL_BATCH

from test_errors import check_memo


def _one_token_forms(t: int) -> list:
    """``token_ids`` for one sequence and one token ``t``, in the forms an engine may pass (all valid)."""
    return [[t], np.array([t]), np.array([t], dtype=np.int32), np.array([t], dtype=np.uint16 if t < 2**16 else np.int64),
            np.array([[t]]), (t,), [np.int64(t)]]


BAD_ONE = [[1.0], np.array([1.5]), [True], np.array([True]), np.array([1], dtype=object), [-1], np.array([-1]),
           [2**31], np.array([2**31]), np.array(5), 5, None, ["a"], [], np.zeros(0, dtype=np.int64), [1, 2],
           np.array([1, 2]), np.ones((1, 1, 1), dtype=np.int64), [[1], [2]]]


def _state(bm: BlockManager) -> tuple:
    seqs = sorted(bm.seq_ids, key=repr)
    return (tuple((s, bm.num_tokens(s), bm.is_swapped(s), tuple(bm.block_table(s).tolist())) for s in seqs),
            bm.num_free_gpu_blocks, bm.stats.num_cached_blocks, bm.stats)


def _call(bm: BlockManager, name: str, *args, **kw):
    try:
        out = getattr(bm, name)(*args, **kw)
    except pagedkv.errors.PagedKVError as e:
        return ("error", type(e))
    if isinstance(out, pagedkv.StepResult):
        return tuple(a.tolist() for a in out) + tuple(str(a.dtype) for a in out)
    return out


@pytest.mark.parametrize("width", [None, 6], ids=["width-longest", "width-6"])
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("seed", range(3))
def test_small_and_vectorised_paths_agree_call_for_call(caching, seed, width):
    rng = np.random.default_rng([seed, caching, width or 0])
    bs = int(rng.choice([1, 2, 4]))
    small, vec = (BlockManager(40, bs, num_cpu_blocks=16, enable_prefix_caching=caching, block_table_width=width)
                  for _ in range(2))
    vec._small_batch = 0
    live: list = []
    nxt = 0
    for _ in range(500):
        op = rng.random()
        if op < 0.15 or not live:  # admit a prompt (shared prefixes: cache hits, and blocks shared by hits)
            n = int(rng.integers(1, 4 * bs + 2))
            toks = [int(x) for x in rng.integers(0, 3, size=n)]
            out = [_call(m, "allocate", nxt, toks) for m in (small, vec)]
            assert out[0] == out[1]
            if out[0] != ("error", pagedkv.OutOfBlocksError):
                live.append(nxt)
            nxt += 1
        elif op < 0.22:  # fork: the next writes into shared blocks copy on write
            parent = live[int(rng.integers(len(live)))]
            out = [_call(m, "fork", parent, nxt) for m in (small, vec)]
            assert out[0] == out[1]
            if out[0] is None:
                live.append(nxt)
            nxt += 1
        elif op < 0.30:
            s = live.pop(int(rng.integers(len(live))))
            assert [_call(m, "free", s) for m in (small, vec)] == [None, None]
        elif op < 0.34:  # swap one out and back in later (the memo must drop it)
            s = live[int(rng.integers(len(live)))]
            name = "swap_in" if small.is_swapped(s) else "swap_out"
            out = [_call(m, name, [s]) for m in (small, vec)]
            assert out[0] == out[1]
        elif op < 0.50:  # batch of one: every token form, sometimes a bad one
            s = live[int(rng.integers(len(live)))]
            if rng.random() < 0.2:
                toks = BAD_ONE[int(rng.integers(len(BAD_ONE)))]
            else:
                forms = _one_token_forms(int(rng.integers(0, 3)))
                toks = forms[int(rng.integers(len(forms)))]
            name = "append_slots" if rng.random() < 0.3 else "decode_step"
            arg = s if name == "append_slots" else ([s] if rng.random() < 0.8 else (s,))
            out = [_call(m, name, arg, toks) for m in (small, vec)]
            assert out[0] == out[1], (name, arg, toks)
        else:  # a batch of 2..SMALL_BATCH + 2 (sometimes the same list again: the memo; sometimes a repeated id)
            k = int(rng.integers(2, SMALL_BATCH + 3))
            batch = [live[int(i)] for i in rng.integers(len(live), size=k)] if rng.random() < 0.1 else \
                [live[int(i)] for i in rng.permutation(len(live))[:k]]
            toks = rng.integers(0, 3, size=len(batch))
            if rng.random() < 0.5:
                toks = toks.tolist()
            out = [_call(m, "decode_step", batch, toks) for m in (small, vec)]
            assert out[0] == out[1]
            out = [_call(m, "decode_step", batch, toks) for m in (small, vec)]  # the same list: a memo hit
            assert out[0] == out[1]
        assert _state(small) == _state(vec)
        check_memo(small)
    small.check_invariants()
    vec.check_invariants()


def test_small_batch_memo_drops_swapped_and_freed_sequences():
    bm = BlockManager(64, 4, num_cpu_blocks=16)
    for s in "abc":
        bm.allocate(s, [1, 2, 3])
    ids = ["a", "b", "c"]
    assert bm.decode_step(ids, [1, 1, 1]).seq_lens.tolist() == [4, 4, 4]
    bm.swap_out(["b"])
    with pytest.raises(pagedkv.SequenceStateError):
        bm.decode_step(ids, [1, 1, 1])
    bm.swap_in(["b"])
    assert bm.decode_step(ids, [1, 1, 1]).seq_lens.tolist() == [5, 5, 5]
    bm.free("c")
    with pytest.raises(pagedkv.UnknownSequenceError):
        bm.decode_step(ids, [1, 1, 1])
    ids[2] = "a"  # a repeated id in the memoised list object
    with pytest.raises(pagedkv.DuplicateSequenceError):
        bm.decode_step(ids, [1, 1, 1])
    bm.check_invariants()
