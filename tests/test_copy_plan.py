"""The step's copy plan (BlockManager.take_copy_plan): the three KV corruptions of issue 14 reproduced exactly
(small pools, block size 4), the plan's order and type, and the calls refused within a step.

Each scenario runs a block-level KV store beside the manager: a block holds the identity of the prefix whose KV
it holds (``tuple(tokens[: (j + 1) * block_size])`` for table position j), a forward writes the blocks of the
positions a call handed out, and copies move identities. The same calls are executed twice: with the copies in
the old documented order (the tier's demotions, its promotions, swap-outs, swap-ins, copy-on-writes), which
corrupts a sequence's KV, and with the plan in order, which does not.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import BlockManager, CopyKind, CopyPlan
from pagedkv.errors import SequenceStateError

BS = 4


class Blocks:
    """Block-level KV store: ``gpu[b]`` / ``cpu[c]`` is the identity of the KV a block holds."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm, self.gpu, self.cpu = bm, {}, {}
        self.toks: dict = {}
        self.lists = {"out": [], "in": [], "cow": []}

    # calls (they record the per-call copy lists for the documented order)
    def allocate(self, sid, toks):
        hit = self.bm.allocate(sid, toks)
        self.toks[sid] = list(toks)
        return sid, hit

    def swap_out(self, ids):
        self.lists["out"] += self.bm.swap_out(ids)

    def swap_in(self, ids):
        self.lists["in"] += self.bm.swap_in(ids)

    def step(self, writes, order: str) -> None:
        """Take the step's copies, execute them in ``order``, then the forward's ``writes`` ((seq, hit) pairs)."""
        if order == "plan":
            plan = self.bm.take_copy_plan()
            for s, d, k in zip(plan.src.tolist(), plan.dst.tolist(), plan.kind.tolist()):
                a, b = {0: (self.gpu, self.cpu), 1: (self.cpu, self.gpu), 2: (self.gpu, self.gpu)}[k]
                b[d] = a.get(s)
        else:
            dem, pro = self.bm.take_copies() if self.bm.config.cpu_prefix_cache else ([], [])
            for pairs, a, b in ((dem, self.gpu, self.cpu), (pro, self.cpu, self.gpu),
                                (self.lists["out"], self.gpu, self.cpu), (self.lists["in"], self.cpu, self.gpu),
                                (self.lists["cow"], self.gpu, self.gpu)):
                vals = [a.get(int(s)) for s, _ in pairs]  # (a batched copy: every source read first)
                for (_, d), v in zip(pairs, vals):
                    b[int(d)] = v
        self.lists = {"out": [], "in": [], "cow": []}
        for sid, hit in writes:
            toks = self.toks[sid]
            for j, blk in enumerate(self.bm.block_table(sid).tolist()):
                if (j + 1) * BS > hit:
                    self.gpu[blk] = tuple(toks[: (j + 1) * BS])

    def reads_own_kv(self, sid) -> bool:
        toks, store = self.toks[sid], self.cpu if self.bm.is_swapped(sid) else self.gpu
        return all(store.get(b) == tuple(toks[: (j + 1) * BS]) for j, b in enumerate(self.bm.block_table(sid).tolist()))


def tier(gpu, cpu):
    return BlockManager(gpu, BS, num_cpu_blocks=cpu, enable_prefix_caching=True, cpu_prefix_cache=True, watermark=0)


X = list(range(9))  # two full blocks and one token
A = list(range(100, 116))


def case1(order: str) -> Blocks:
    """swap_out(A), then allocate(B) whose prefix hit continues in the CPU tier, in one step: the promotion is
    handed a GPU block that A's swap-out has just freed."""
    kv = Blocks(tier(4, 8))
    kv.step([kv.allocate("x", X)], order)
    kv.bm.free("x")  # x's two full blocks stay cached
    kv.step([kv.allocate("a", A)], order)  # evicts them: demoted to the CPU tier
    assert kv.bm.stats.num_cpu_cached_blocks == 2
    kv.swap_out(["a"])  # A's 4 GPU blocks are cached: they wait in the evictor
    hit = kv.allocate("b", X)  # x's blocks come back from the CPU tier into blocks A's swap-out frees
    assert hit[1] == 8 and kv.bm.stats.promotions == 2
    kv.step([hit], order)
    return kv


def case2(order: str) -> Blocks:
    """swap_in(A), then in the same step an allocate that evicts a cached GPU block: the demotion is handed a
    CPU block that A's swap-in has just released."""
    kv = Blocks(tier(4, 4))
    kv.step([kv.allocate("x", X)], order)
    kv.bm.free("x")
    kv.step([kv.allocate("a", list(range(100, 105)))], order)
    kv.swap_out(["a"])  # CPU 0, 1
    kv.step([], order)
    kv.step([kv.allocate("y", list(range(200, 216)))], order)  # evicts x's blocks: demoted, the CPU pool is full
    kv.bm.free("y")  # four cached blocks in the evictor
    kv.swap_in(["a"])  # releases CPU 0, 1
    kv.step([kv.allocate("z", list(range(300, 305)))], order)  # evicts y's blocks: demoted into CPU 0, 1
    return kv


def case3(order: str) -> Blocks:
    """swap_in(A), then swap_out(B) in the same step: swap_out reuses the CPU blocks swap_in released."""
    kv = Blocks(BlockManager(4, BS, num_cpu_blocks=2, watermark=0))
    kv.step([kv.allocate("a", list(range(5))), kv.allocate("b", list(range(10, 15)))], order)
    kv.swap_out(["a"])
    kv.step([], order)
    kv.swap_in(["a"])
    kv.swap_out(["b"])
    kv.step([], order)
    return kv


@pytest.mark.parametrize("case, victim", [(case1, "a"), (case2, "a"), (case3, "a")])
def test_the_old_order_corrupts_and_the_plan_does_not(case, victim):
    old = case("documented")
    assert not old.reads_own_kv(victim)  # the corruption, reproduced
    new = case("plan")
    for sid in new.toks:
        if sid in new.bm:
            assert new.reads_own_kv(sid), sid
    new.bm.check_invariants()


def test_case1_plan_order():
    kv = Blocks(tier(4, 8))
    kv.step([kv.allocate("x", X)], "plan")
    kv.bm.free("x")
    kv.step([kv.allocate("a", A)], "plan")
    table = kv.bm.block_table("a").tolist()
    kv.swap_out(["a"])
    kv.allocate("b", X)
    plan = kv.bm.take_copy_plan()
    kinds = plan.kind.tolist()
    assert kinds[:4] == [CopyKind.GPU_TO_CPU] * 4 and plan.src[:4].tolist() == table  # the swap-out first
    promoted = plan.pairs(CopyKind.CPU_TO_GPU)[:, 1]
    assert set(promoted.tolist()) <= set(table)  # into blocks the swap-out read before
    assert len(plan) == plan.src.size == plan.dst.size == plan.kind.size


def test_plan_type_and_batches():
    plan = CopyPlan.build([(CopyKind.GPU_TO_CPU, [17], [5]), (CopyKind.CPU_TO_GPU, [3, 4], [17, 2]),
                           (CopyKind.GPU_TO_CPU, [9], [3]), (CopyKind.GPU_TO_GPU, [12, 30], [30, 31])])
    assert len(plan) == 6 and plan.src.dtype == np.int64 and plan.kind.dtype == np.int8
    with pytest.raises(ValueError):
        plan.src[0] = 1  # read-only
    b = [(int(k), s.tolist(), d.tolist()) for k, s, d in plan.batches()]
    # the last GPU->GPU copy reads block 30, which the one before it writes: two batches
    assert b == [(0, [17], [5]), (1, [3, 4], [17, 2]), (0, [9], [3]), (2, [12], [30]), (2, [30], [31])]
    assert plan.pairs(CopyKind.CPU_TO_GPU).tolist() == [[3, 17], [4, 2]]
    assert len(CopyPlan.build([])) == 0 and CopyPlan.build([]).batches() == []


def test_a_sequence_handed_slots_in_this_step_is_not_swapped_out_or_forked():
    bm = BlockManager(8, BS, num_cpu_blocks=8)
    bm.allocate("a", list(range(5)))
    bm.take_copy_plan()  # the checks are on from here
    bm.allocate("b", list(range(5)))
    bm.decode_step(["a"], np.array([7]))
    for seq in ("a", "b"):
        free_before = bm.num_free_gpu_blocks
        with pytest.raises(SequenceStateError):
            bm.swap_out([seq])
        with pytest.raises(SequenceStateError):
            bm.fork(seq, seq + "/1")
        assert bm.num_free_gpu_blocks == free_before and not bm.is_swapped(seq) and seq + "/1" not in bm
    assert len(bm.take_copy_plan()) == 0
    bm.fork("a", "a/1")  # after the step: fine
    assert len(bm.swap_out(["a", "a/1"])) == 2
    assert bm.take_copy_plan().kind.tolist() == [CopyKind.GPU_TO_CPU] * 2
    bm.check_invariants()


def test_the_plan_holds_every_copy_in_call_order():
    bm = BlockManager(8, BS, num_cpu_blocks=8)
    bm.allocate("a", list(range(6)))
    bm.allocate("c", list(range(20, 25)))
    bm.take_copy_plan()
    bm.fork("a", "b")
    pairs = bm.swap_out(["c"])
    r = bm.decode_step(["a", "b"], np.array([1, 2]))  # one of them copies the shared partial block
    back = bm.swap_in(["c"])
    plan = bm.take_copy_plan()
    assert plan.kind.tolist() == [0, 0, 2, 1, 1]
    assert plan.pairs(CopyKind.GPU_TO_CPU).tolist() == [list(p) for p in pairs]
    assert plan.pairs(CopyKind.GPU_TO_GPU).tolist() == r.cow.tolist()
    assert plan.pairs(CopyKind.CPU_TO_GPU).tolist() == [list(p) for p in back]
    assert len(bm.take_copy_plan()) == 0  # taken: the next step starts empty
