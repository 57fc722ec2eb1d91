"""The engine's tier path checked in the KV data (issue 24 item 5, the engine's side): the real scheduler, block
manager (CPU tier, preemption, chunked prefill), ``EngineTiers`` (its loads, writes and write-through stores over a
real disk tier and its I/O threads) and the engine's copy-plan executor, over a KV cache whose every slot holds the
*identity* of the prefix whose KV belongs there (namespace and tokens up to that position) instead of K/V. Loads
complete whenever their I/O thread finishes (the step loop goes on meanwhile), requests are aborted while loading
or running, prompts share prefixes across namespaces. After every forward each sequence of the step reads back its
own identities through its block table: a loaded block written at the wrong place, from another namespace or
another prompt, a store that read a reused block, or a load used past a gap would show up as a wrong read."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv import BlockManager  # noqa: E402
from pagedkv.scheduler import Scheduler  # noqa: E402
from pagedkv.tiers import ModelFingerprint  # noqa: E402

BS = 4


class _Req:
    def __init__(self, rid, prompt, ns):
        self.request_id = rid
        self.prompt_token_ids = tuple(prompt)
        self.namespace = ns


class _Ids:
    """Interned identities of (namespace, tokens[0..p]) prefixes: small exact integers (float64-safe)."""

    def __init__(self):
        self._d = {}

    def of(self, ns, toks, p):
        key = (ns, tuple(toks[: p + 1]))
        v = self._d.get(key)
        if v is None:
            v = self._d[key] = float(len(self._d) + 1)
        return v


def _write(kv, slots, values):
    flat = kv[0, 0].reshape(-1)  # (K only: K and V hold the same identity)
    flat[torch.as_tensor(np.asarray(slots, dtype=np.int64))] = torch.as_tensor(values, dtype=kv.dtype)
    kv[0, 1].reshape(-1)[torch.as_tensor(np.asarray(slots, dtype=np.int64))] = torch.as_tensor(values, dtype=kv.dtype)


def _read(kv, table, n):
    flat = kv[0, 0].reshape(-1)
    slots = [int(table[p // BS]) * BS + p % BS for p in range(n)]
    return flat[torch.as_tensor(slots)].tolist(), kv[0, 1].reshape(-1)[torch.as_tensor(slots)].tolist()


@pytest.mark.parametrize("seed", range(8))
def test_tier_loads_and_stores_read_back_in_the_data(tmp_path, seed):
    from pagedkv.engine.kv_tiers import EngineTiers
    from pagedkv.engine.model import execute_copy_plan

    rng = random.Random(seed)
    cpu = rng.random() < 0.5
    bm = BlockManager(24, BS, enable_prefix_caching=True, num_cpu_blocks=16, cpu_prefix_cache=cpu,
                      store_policy=rng.choice(["write_through", "selective", "write_back"]))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=True,
                      preemption_mode=rng.choice(["recompute", "swap"]))
    kv = torch.zeros((1, 2, 24, BS, 1, 1), dtype=torch.float64)
    cpu_kv = torch.zeros((1, 2, 16, BS, 1, 1), dtype=torch.float64)
    fp = ModelFingerprint("content-model", "float64", BS, "L1,2,B4,H1,D1")
    tiers = EngineTiers(None, kv, BS, disk_dir=tmp_path / f"d{seed}", disk_gib=0.001, max_load_ms_per_block=None,
                        fingerprint=fp, block_manager=bm, cpu_kv_cache=cpu_kv)
    ids = _Ids()
    by_id: dict = {}
    base = [rng.randrange(50) for _ in range(40)]
    heads = [base[:n] for n in (6, 13, 24, 40)] + [[rng.randrange(50) for _ in range(12)]]  # nested prefixes
    next_id = 0
    checked = loaded_used = 0
    turns: list = []  # (prompt + sample 0's answer, namespace) of finished requests: next turns continue them
    try:
        for step in range(160):
            if rng.random() < 0.4 and len(by_id) < 8:  # new requests: a shared head and a tail, a namespace
                prompt = None
                for _ in range(rng.choice([1, 1, 2, 3])):  # sometimes several at once, the same or sharing a head
                    if prompt is None or rng.random() < 0.6:
                        prompt = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
                        ns = rng.choice([None, None, "t1"])
                        if turns and rng.random() < 0.3:  # a next turn: an earlier prompt, its answer, more
                            prev, ns = rng.choice(turns)
                            prompt = list(prev) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
                    r = _Req(next_id, prompt, ns)
                    next_id += 1
                    by_id[r.request_id] = r
                    wait = tiers.on_add(r.request_id, r.prompt_token_ids, ns, bm)
                    sched.add_request(r.request_id, prompt, max_tokens=rng.randrange(1, 6), namespace=ns,
                                      wait_for_kv=wait)
            if rng.random() < 0.05 and by_id:  # an abort, wherever the request is (loading too)
                rid = rng.choice(list(by_id))
                sched.abort_request(rid)
                del by_id[rid]
            if rng.random() < 0.5:
                tiers.connector.wait(0.02)  # sometimes loads finish before this step, sometimes later
            tiers.poll(sched)
            plan = sched.schedule()
            if len(plan.copies):
                execute_copy_plan(plan.copies, kv, cpu_kv)
            tiers.start_loads(plan.kv_loads)  # (reserved blocks: read off the loop, written at a later poll)
            if plan.has_forward:
                tiers.on_blocks_filled(plan, sched, by_id)  # (as the engine: decode-filled blocks are stored too)
                for pw in plan.prefills:  # the forward: each computed token's identity at its slot
                    r = by_id[pw.request_id]
                    loaded_used += pw.num_external_tokens
                    full = list(r.prompt_token_ids) + list(sched.sequence(pw.seq_id).output)
                    _write(kv, pw.slot_mapping, [ids.of(r.namespace, full, int(p)) for p in pw.positions])
                d = plan.decode
                if d is not None:
                    starts = np.concatenate(([0], np.cumsum(d.query_lens)))
                    for i, sid in enumerate(d.seq_ids.tolist()):
                        v = sched.sequence(sid)
                        r = by_id[v.request_id]
                        full = list(r.prompt_token_ids) + list(v.output)
                        a, z = starts[i], starts[i + 1]
                        _write(kv, d.result.slot_mapping[a:z],
                               [ids.of(r.namespace, full, int(p)) for p in d.positions[a:z]])
                # every sequence of the step reads back its own identities, loaded blocks included
                for pw in plan.prefills:
                    r = by_id[pw.request_id]
                    full = list(r.prompt_token_ids) + list(sched.sequence(pw.seq_id).output)
                    want = [ids.of(r.namespace, full, p) for p in range(pw.seq_len)]
                    k, v = _read(kv, bm.block_table(pw.seq_id), pw.seq_len)
                    assert k == want and v == want, f"step {step}: request {pw.request_id} reads wrong KV"
                    checked += 1
                if d is not None:
                    for i, sid in enumerate(d.seq_ids.tolist()):
                        sv = sched.sequence(sid)
                        r = by_id[sv.request_id]
                        full = list(r.prompt_token_ids) + list(sv.output)
                        n = int(d.result.seq_lens[i])
                        k, _ = _read(kv, bm.block_table(sid), n)
                        assert k == [ids.of(r.namespace, full, p) for p in range(n)], f"step {step}: seq {sid}"
                        checked += 1
                tiers.store_computed(plan, kv, by_id)
            sampled = [rng.randrange(50) for _ in plan.prefills]
            if plan.decode is not None:
                sampled += [rng.randrange(50) for _ in plan.decode.seq_ids]
            for out in sched.update(plan, sampled):
                done_req = by_id.pop(out.request_id, None)
                if done_req is not None and out.outputs and len(turns) < 64:
                    turns.append((tuple(out.prompt_token_ids) + tuple(out.outputs[0]), done_req.namespace))
            bm.check_invariants()
            if not sched.has_unfinished() and not by_id:
                continue
        # drain: every request finishes
        deadline = time.monotonic() + 30
        while sched.has_unfinished():
            assert time.monotonic() < deadline, (sched.num_loading, sched.num_waiting)
            tiers.connector.wait(0.02)
            tiers.poll(sched)
            plan = sched.schedule()
            if len(plan.copies):
                execute_copy_plan(plan.copies, kv, cpu_kv)
            tiers.start_loads(plan.kv_loads)
            if plan.has_forward:
                tiers.on_blocks_filled(plan, sched, by_id)
                tiers.store_computed(plan, kv, by_id)
            n = len(plan.prefills) + (len(plan.decode.seq_ids) if plan.decode is not None else 0)
            for out in sched.update(plan, [0] * n):
                by_id.pop(out.request_id, None)
        assert checked > 50
        assert loaded_used > 0 and tiers.stats["written_blocks"] > 0  # the tiers really served blocks
        assert tiers.stats["store_skipped_unchecked"] == 0  # decode-filled blocks stored with their digests
        (disk,) = tiers.connector.stores()
        assert disk.stats.check_refused == 0  # every stored check digest is the one a later load computes
        tiers.connector.flush(30)
        tiers.poll(sched)  # the last stores complete their plans
        assert not bm.external.pending_stores and not bm.external.parked_seq_ids and not bm.external.loading_seq_ids
        bm.check_invariants()
    finally:
        tiers.close()


@pytest.mark.parametrize("seed", range(6))
def test_tier_loads_and_stores_with_kv_cache_groups_read_back_in_the_data(tmp_path, seed):
    """The same with KV cache groups (a HybridBlockManager: a full-attention group and a sliding group of a 2-block
    window, one KV tensor whose block ids both draw from; docs/tiers.md#kv-cache-groups): each group's identity
    carries its group, each group's blocks are stored under its own fingerprint, a load fills every group's
    reserved blocks (the sliding group only its window's), and after every forward each sequence reads back its
    own identities through each group's table: every position for the full group, the positions its last query
    sees for the sliding one. Odd seeds cut a third of the reads short (a load the window sees whole keeps what
    every group got; one cut to the window is queued again and computed)."""
    from pagedkv import FullAttentionSpec, HybridBlockManager, SlidingWindowSpec
    from pagedkv.engine.kv_tiers import EngineTiers
    from pagedkv.engine.model import execute_copy_plan

    W = 2 * BS
    rng = random.Random(1000 + seed)
    nb = 48
    bm = BlockManager(nb, BS, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(window=W)],
                            enable_prefix_caching=True, store_policy=rng.choice(["write_through", "selective"]), grouped_results=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=True,
                      incremental_tables=False)
    kv = torch.zeros((1, 2, nb, BS, 1, 1), dtype=torch.float64)
    fp = ModelFingerprint("content-model", "float64", BS, "L1,2,B4,H1,D1")
    tiers = EngineTiers(None, kv, BS, disk_dir=tmp_path / f"g{seed}", disk_gib=0.001, max_load_ms_per_block=None,
                        fingerprint=fp, block_manager=bm, windows=(None, W))
    ids = _Ids()
    by_id: dict = {}
    base = [rng.randrange(50) for _ in range(40)]
    heads = [base[:n] for n in (6, 13, 24, 40)] + [[rng.randrange(50) for _ in range(12)]]
    next_id = 0
    checked = loaded_used = 0
    if seed % 2:  # faults: a third of the tier reads come back short (a value refused or gone mid-run)
        frng = random.Random(seed)
        real = tiers.connector._read_run

        def short(t, keys, ns, checks, group=0):
            good, values = real(t, keys, ns, checks, group)
            if good and frng.random() < 0.33:
                good = frng.randrange(good)
                values = values[:good]
            return good, values

        tiers.connector._read_run = short

    def forward(plan):
        nonlocal checked, loaded_used
        for pw in plan.prefills:  # each group writes each computed token's identity (with its group) at its slot
            r = by_id[pw.request_id]
            loaded_used += pw.num_external_tokens
            full = list(r.prompt_token_ids) + list(sched.sequence(pw.seq_id).output)
            for g in range(2):
                _write(kv, pw.slot_mapping[g], [ids.of((g, r.namespace), full, int(p)) for p in pw.positions])
        d = plan.decode
        if d is not None:
            starts = np.concatenate(([0], np.cumsum(d.query_lens)))
            for i, sid in enumerate(d.seq_ids.tolist()):
                v = sched.sequence(sid)
                r = by_id[v.request_id]
                full = list(r.prompt_token_ids) + list(v.output)
                a, z = starts[i], starts[i + 1]
                for g in range(2):
                    _write(kv, d.result.slot_mapping[g][a:z],
                           [ids.of((g, r.namespace), full, int(p)) for p in d.positions[a:z]])
        seqs = [(pw.seq_id, pw.request_id, pw.seq_len) for pw in plan.prefills]
        if d is not None:
            seqs += [(sid, sched.sequence(sid).request_id, int(d.result.seq_lens[i]))
                     for i, sid in enumerate(d.seq_ids.tolist())]
        for sid, rid, n in seqs:  # each group reads back its own identities: the full group all, the window its
            r = by_id[rid]
            full = list(r.prompt_token_ids) + list(sched.sequence(sid).output)
            for g, lo in ((0, 0), (1, max(0, n - W))):
                table = bm.block_table(sid, g)
                flat = kv[0, 0].reshape(-1)
                got = [float(flat[int(table[p // BS]) * BS + p % BS]) for p in range(lo, n)]
                assert got == [ids.of((g, r.namespace), full, p) for p in range(lo, n)], \
                    f"request {rid} group {g} reads wrong KV"
            checked += 1

    try:
        for step in range(160):
            if rng.random() < 0.4 and len(by_id) < 6:
                prompt = None
                for _ in range(rng.choice([1, 1, 2])):
                    if prompt is None or rng.random() < 0.6:
                        prompt = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
                        ns = rng.choice([None, None, "t1"])
                    r = _Req(next_id, prompt, ns)
                    next_id += 1
                    by_id[r.request_id] = r
                    wait = tiers.on_add(r.request_id, r.prompt_token_ids, ns, bm)
                    sched.add_request(r.request_id, prompt, max_tokens=rng.randrange(1, 6), namespace=ns,
                                      wait_for_kv=wait)
            if rng.random() < 0.05 and by_id:
                rid = rng.choice(list(by_id))
                sched.abort_request(rid)
                del by_id[rid]
            if rng.random() < 0.5:
                tiers.connector.wait(0.02)
            tiers.poll(sched)
            plan = sched.schedule()
            if len(plan.copies):
                execute_copy_plan(plan.copies, kv, None)
            tiers.start_loads(plan.kv_loads)
            if plan.has_forward:
                tiers.on_blocks_filled(plan, sched, by_id)  # (every group's decode-filled blocks chained, stored)
                forward(plan)
                tiers.store_computed(plan, kv, by_id)
            sampled = [rng.randrange(50) for _ in plan.prefills]
            if plan.decode is not None:
                sampled += [rng.randrange(50) for _ in plan.decode.seq_ids]
            for out in sched.update(plan, sampled):
                by_id.pop(out.request_id, None)
            bm.check_invariants()
        deadline = time.monotonic() + 30
        while sched.has_unfinished():
            assert time.monotonic() < deadline, (sched.num_loading, sched.num_waiting)
            tiers.connector.wait(0.02)
            tiers.poll(sched)
            plan = sched.schedule()
            if len(plan.copies):
                execute_copy_plan(plan.copies, kv, None)
            tiers.start_loads(plan.kv_loads)
            if plan.has_forward:
                tiers.on_blocks_filled(plan, sched, by_id)  # (every group's decode-filled blocks chained, stored)
                forward(plan)
                tiers.store_computed(plan, kv, by_id)
            n = len(plan.prefills) + (len(plan.decode.seq_ids) if plan.decode is not None else 0)
            for out in sched.update(plan, [0] * n):
                by_id.pop(out.request_id, None)
            bm.check_invariants()
        assert checked > 50
        assert loaded_used > 0 and tiers.group_loaded_blocks[0] > 0 and tiers.group_loaded_blocks[1] > 0
        if seed % 2:
            assert tiers.stats["loads_failed"] > 0  # (short reads: computed, the output read back right)
        tiers.connector.flush(30)
        # every group's decode-filled blocks stored with their group's check digests, each the one a load computes
        assert tiers.stats["store_skipped_unchecked"] == 0
        stores = tiers.connector.group_stores()[0]
        assert all(st.stats.puts > 0 for st in stores) and sum(st.stats.check_refused for st in stores) == 0
        tiers.poll(sched)
        assert not bm.external.pending_stores and not bm.external.parked_seq_ids and not bm.external.loading_seq_ids
        bm.check_invariants()
    finally:
        tiers.close()
