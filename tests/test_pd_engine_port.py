"""The engine's KV port (``pagedkv.engine.kv_port.EngineKVPort``) without a model: a real Scheduler and
BlockManager on each side, a small torch KV cache, and the engine's step reduced to its KV writes (each computed
token's K/V set to its token id through the slot mapping). The prefill side holds the prompt's whole blocks
before its last token in the step that computes it, hands over exactly those blocks' bytes and releases them; the
decode side writes the bytes into the blocks its scheduler allocates as external tokens (after its own prefix
hit), computes the rest, and every block of its prompt then reads back the prompt's tokens. Holds expire and are
refused to readers once released."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv import BlockManager  # noqa: E402
from pagedkv.scheduler import Scheduler  # noqa: E402

BS = 4
L, H, D = 2, 1, 3


def engine():
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=True,
                      incremental_tables=True)
    kv = torch.zeros(L, 2, 32, BS, H, D)
    llm = SimpleNamespace(block_manager=bm, scheduler=sched, kv_cache=kv, kv_tiers=None, kv_cache_groups=None,
                          model=SimpleNamespace(w=torch.arange(3.0)), plugged=[])
    llm.add_kv_connector = lambda c, first=False: llm.plugged.append(c)  # (EngineCore's: the connectors stepped)
    return llm


def step(llm, port, by_id):
    """One engine step: schedule, the port's loads, the forward's KV writes (token ids), the port's hook, update."""
    plan = llm.scheduler.schedule()
    port.write_loads(plan, llm.kv_cache)
    for pw in plan.prefills:
        prompt = by_id[pw.request_id].prompt_token_ids
        for pos, slot in zip(pw.positions.tolist(), np.asarray(pw.slot_mapping).tolist()):
            llm.kv_cache[:, :, slot // BS, slot % BS] = float(prompt[pos]) if pos < len(prompt) else -1.0
    port.store_computed(plan, llm.kv_cache, by_id)
    sampled = [7] * len(plan.prefills) + ([7] * len(plan.decode.seq_ids) if plan.decode is not None else [])
    done = llm.scheduler.update(plan, sampled)
    llm.block_manager.check_invariants()
    return plan, done


def block_tokens(kv, block):
    return kv[0, 0, block, :, 0, 0].tolist()


def add(llm, port, rid, prompt, max_tokens):
    req = SimpleNamespace(request_id=rid, prompt_token_ids=tuple(prompt))
    wait = port.on_add(rid, prompt, None, llm.block_manager)
    llm.scheduler.add_request(rid, prompt, max_tokens=max_tokens, wait_for_kv=wait)
    return req


def test_blocks_held_on_one_engine_arrive_in_the_right_blocks_of_another():
    from pagedkv.engine.kv_port import EngineKVPort

    pre, dec = engine(), engine()
    pport, dport = EngineKVPort(pre), EngineKVPort(dec)
    assert pre.plugged == [] and pport.payload_bytes == L * 2 * BS * H * D * 4  # (joins the loop when used)
    assert pport.fingerprint == dport.fingerprint  # the same model, dtype, block size and layout
    prompt = list(range(100, 123))  # 23 tokens: 5 whole blocks before the last token

    # prefill side: the request is marked, computed in chunks of at most 64 tokens, held at its last chunk
    req = add(pre, pport, "p", prompt, 1)
    pport.hold_on_finish(req, 30.0)
    assert pre.plugged == [pport]  # the port joined the engine's step loop (EngineCore.add_kv_connector)
    by_id = {"p": req}
    while pre.scheduler.has_unfinished():
        step(pre, pport, by_id)
    hold = pport.take_hold("p")
    assert hold.num_tokens == 20 and len(hold.block_ids) == 5 and pport.take_hold("p") is None
    payloads = pport.read_blocks(hold.hold_id, hold.block_ids)
    for i, p in enumerate(payloads):  # each block's bytes hold its 4 tokens, every layer, K and V
        arr = np.frombuffer(memoryview(p).cast("B"), dtype=np.float32).reshape(L, 2, BS, H, D)
        assert (arr == np.array(prompt[i * BS:(i + 1) * BS], dtype=np.float32)[None, None, :, None, None]).all()
    # the held blocks survive the request's end and a flood of other prompts (never evicted or reused)
    others = {f"o{i}": add(pre, pport, f"o{i}", list(range(1000 + 40 * i, 1030 + 40 * i)), 1) for i in range(4)}
    while pre.scheduler.has_unfinished():
        step(pre, pport, others)
    again = pport.read_blocks(hold.hold_id, hold.block_ids)
    assert all(bytes(memoryview(a).cast("B")) == bytes(memoryview(b).cast("B")) for a, b in zip(payloads, again))

    # decode side: the same prompt with a prefix of 2 blocks already cached there
    warm = add(dec, dport, "w", prompt[:9], 1)
    while dec.scheduler.has_unfinished():
        step(dec, dport, {"w": warm})
    dreq = SimpleNamespace(request_id="d", prompt_token_ids=tuple(prompt))
    dport.attach_external(dreq, [bytes(memoryview(p).cast("B")) for p in payloads])
    add(dec, dport, "d", prompt, 3)
    assert dec.scheduler.num_loading == 1
    first = None
    while dec.scheduler.has_unfinished():
        dport.poll(dec.scheduler)
        plan, _ = step(dec, dport, {"d": dreq})
        if first is None and plan.prefills:
            first = plan.prefills[0]
            table = first.block_table.tolist()
            # the hit's 2 blocks, 3 blocks written from the payloads, the last 3 tokens computed
            assert first.num_external_tokens == 12 and first.num_cached_tokens == 20
            assert first.positions.tolist() == [20, 21, 22]
            for i in range(6):
                want = prompt[i * BS:(i + 1) * BS] + [-1.0] * (BS - len(prompt[i * BS:(i + 1) * BS]))
                assert block_tokens(dec.kv_cache, table[i])[:len(prompt[i * BS:(i + 1) * BS])] == \
                    [float(t) for t in prompt[i * BS:(i + 1) * BS]], (i, want)
    assert dport.stats["written_blocks"] == 3 and dec.scheduler.stats.external_tokens == 12

    # release: the reader is refused afterwards, and the pool is whole again
    pport.release_hold(hold.hold_id)
    with pytest.raises(LookupError):
        pport.read_blocks(hold.hold_id, hold.block_ids)
    with pytest.raises(LookupError):
        pport.release_hold(hold.hold_id)
    assert not pre.block_manager.external.holds
    pre.block_manager.check_invariants()


def test_holds_expire_and_short_prompts_hold_nothing():
    from pagedkv.engine.kv_port import EngineKVPort

    pre = engine()
    port = EngineKVPort(pre)
    reqs = {"a": add(pre, port, "a", list(range(10, 20)), 1), "b": add(pre, port, "b", [5, 6, 7, 8], 1)}
    port.hold_on_finish(reqs["a"], 1e-9)
    port.hold_on_finish(reqs["b"], 30.0)
    while pre.scheduler.has_unfinished():
        step(pre, port, reqs)
    assert port.take_hold("b") is None  # one block, holding the last token: nothing to hand over
    h = port.take_hold("a")
    assert h.num_tokens == 8 and len(pre.block_manager.external.holds) == 1
    assert port.expire_holds() == [h.hold_id] and not pre.block_manager.external.holds
    pre.block_manager.check_invariants()


# ------------------------------------------------------------------ KV cache groups (a HybridBlockManager)
G = 2  # group 0 full attention, group 1 sliding window W


def grouped_engine(window=8, batched=16):
    from pagedkv import FullAttentionSpec, HybridBlockManager, SlidingWindowSpec

    groups = (FullAttentionSpec(), SlidingWindowSpec(window))
    bm = BlockManager(64, BS, kv_cache_groups=groups, enable_prefix_caching=True, grouped_results=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=batched, enable_chunked_prefill=True,
                      incremental_tables=True)
    kv = torch.zeros(L, 2, 64, BS, H, D)
    return SimpleNamespace(block_manager=bm, scheduler=sched, kv_cache=kv, kv_tiers=None, kv_cache_groups=groups,
                           model=SimpleNamespace(w=torch.arange(3.0)))


def grouped_step(llm, port, by_id):
    """:func:`step` with a (G, T) slot mapping: token t's K/V in group g is ``t * G + g``."""
    plan = llm.scheduler.schedule()
    port.write_loads(plan, llm.kv_cache)
    for pw in plan.prefills:
        prompt = by_id[pw.request_id].prompt_token_ids
        for g in range(G):
            for pos, slot in zip(pw.positions.tolist(), np.asarray(pw.slot_mapping)[g].tolist()):
                llm.kv_cache[:, :, slot // BS, slot % BS] = float(prompt[pos] * G + g)
    port.store_computed(plan, llm.kv_cache, by_id)
    sampled = [7] * len(plan.prefills) + ([7] * len(plan.decode.seq_ids) if plan.decode is not None else [])
    done = llm.scheduler.update(plan, sampled)
    llm.block_manager.check_invariants()
    return plan, done


def group_values(prompt, g, j):
    return [float(t * G + g) for t in prompt[j * BS:(j + 1) * BS]]


def test_kv_cache_groups_hand_over_every_full_block_and_only_the_sliding_window():
    from pagedkv.engine.kv_io import group_transfer_order
    from pagedkv.engine.kv_port import EngineKVPort
    from pagedkv.types import NULL_BLOCK

    pre, dec = grouped_engine(), grouped_engine()
    pport, dport = EngineKVPort(pre), EngineKVPort(dec)
    assert pport.windows == (None, 8) and pport.fingerprint == dport.fingerprint
    prompt = list(range(100, 131))  # 31 tokens: 7 whole blocks before the last; the window at 28 sees blocks 5, 6
    order = group_transfer_order(7, BS, (None, 8))
    assert order == [(0, j) for j in range(5)] + [(0, 5), (1, 5), (0, 6), (1, 6)]

    req = add(pre, pport, "p", prompt, 1)  # computed in chunks of 16: the window released blocks 0, 1 meanwhile
    pport.hold_on_finish(req, 30.0)
    while pre.scheduler.has_unfinished():
        grouped_step(pre, pport, {"p": req})
    hold = pport.take_hold("p")
    assert hold.num_tokens == 28 and len(hold.block_ids) == 7 and len(hold.wire_block_ids) == 9  # not 14
    assert [b for (g, _), b in zip(order, hold.wire_block_ids) if g == 0] == list(hold.block_ids)
    payloads = pport.read_blocks(hold.hold_id, hold.wire_block_ids)
    for (g, j), p in zip(order, payloads):
        arr = np.frombuffer(memoryview(p).cast("B"), dtype=np.float32).reshape(L, 2, BS, H, D)
        assert arr[0, 0, :, 0, 0].tolist() == group_values(prompt, g, j), (g, j)
    names = pport.block_names(prompt, None, 7)
    assert len(names) == 9 and len(set(names)) == 9 and names == dport.block_names(prompt, None, 7)
    assert pport.block_names(prompt, "tenant", 7) != names

    # decode side, with the prompt's first 2 blocks cached there (a hybrid hit of 8 tokens)
    warm = add(dec, dport, "w", prompt[:9], 1)
    while dec.scheduler.has_unfinished():
        grouped_step(dec, dport, {"w": warm})
    dreq = SimpleNamespace(request_id="d", prompt_token_ids=tuple(prompt))
    dport.attach_external(dreq, [bytes(memoryview(p).cast("B")) for p in payloads], 7)
    add(dec, dport, "d", prompt, 3)
    assert dec.scheduler.num_loading == 1
    first = None
    while dec.scheduler.has_unfinished():
        dport.poll(dec.scheduler)
        plan, _ = grouped_step(dec, dport, {"d": dreq})
        if first is None and plan.prefills:
            first = plan.prefills[0]
            full, sliding = (t.tolist() for t in first.block_table)
            assert first.num_external_tokens == 20 and first.num_cached_tokens == 28
            assert first.positions.tolist() == [28, 29, 30]
            assert sliding[:5] == [NULL_BLOCK] * 5  # only the window's blocks were reserved and written
            for j in range(7):
                assert block_tokens(dec.kv_cache, full[j]) == group_values(prompt, 0, j), j
            for j in (5, 6):
                assert block_tokens(dec.kv_cache, sliding[j]) == group_values(prompt, 1, j), j
    assert dport.stats["written_blocks"] == 7 and dec.scheduler.stats.external_tokens == 20  # 5 full + 2 sliding

    # a transfer cut short: the sliding window's blocks come last, so nothing of this long prompt is usable
    d2 = SimpleNamespace(request_id="d2", prompt_token_ids=tuple(prompt))
    dport.attach_external(d2, payloads[:6], 7)
    assert not dport.on_add("d2", prompt, None, dec.block_manager)  # (nothing staged: computed whole)
    # a lease that ends: every group's held blocks return
    pport.release_hold(hold.hold_id)
    req3 = add(pre, pport, "q", prompt, 1)
    pport.hold_on_finish(req3, 1e-9)
    while pre.scheduler.has_unfinished():
        grouped_step(pre, pport, {"q": req3})
    h3 = pport.take_hold("q")
    assert h3 is not None and pport.expire_holds() == [h3.hold_id] and not pre.block_manager.external.holds
    pre.block_manager.check_invariants()


def test_usable_blocks_of_a_grouped_transfer_cut_short():
    from pagedkv.engine.kv_io import group_block_ranges, group_transfer_order, usable_blocks

    w = (None, 8)
    assert group_block_ranges(7, BS, w) == [(0, 7), (5, 7)]
    assert group_block_ranges(2, BS, w) == [(0, 2), (0, 2)]  # the window at 8 sees position 1 on: all
    assert group_transfer_order(2, BS, w) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # a short prompt (inside the window): every whole position that arrived in every group is usable
    assert [usable_blocks(2, BS, w, k) for k in range(5)] == [0, 0, 1, 1, 2]
    # a long one: the window's blocks of block 7's position were never sent for a load of fewer blocks
    assert [usable_blocks(7, BS, w, k) for k in (0, 5, 8, 9)] == [0, 0, 0, 7]
    assert usable_blocks(7, BS, (None, None), 5) == 2  # two full groups: the positions both hold


def test_a_grouped_load_whose_hit_moved_is_computed():
    """The scheduler's lookup said one hit and allocate found another: the payloads do not match the range, so
    the load is aborted (its blocks parked and released at once) and the prompt computed from allocate's hit."""
    from pagedkv.engine.kv_port import EngineKVPort

    pre, dec = grouped_engine(), grouped_engine()
    pport, dport = EngineKVPort(pre), EngineKVPort(dec)
    prompt = list(range(200, 231))
    req = add(pre, pport, "p", prompt, 1)
    pport.hold_on_finish(req, 30.0)
    while pre.scheduler.has_unfinished():
        grouped_step(pre, pport, {"p": req})
    hold = pport.take_hold("p")
    payloads = pport.read_blocks(hold.hold_id, hold.wire_block_ids)
    warm = add(dec, dport, "w", prompt[:9], 1)
    while dec.scheduler.has_unfinished():
        grouped_step(dec, dport, {"w": warm})
    bm = dec.block_manager
    real = bm.lookup_prefix
    bm.lookup_prefix = lambda *a, **k: real(*a, **k)._replace(num_cached_tokens=0)  # (advice that went stale)
    dreq = SimpleNamespace(request_id="d", prompt_token_ids=tuple(prompt))
    dport.attach_external(dreq, [bytes(memoryview(p).cast("B")) for p in payloads], 7)
    add(dec, dport, "d", prompt, 2)
    first = None
    while dec.scheduler.has_unfinished():
        dport.poll(dec.scheduler)
        plan, _ = grouped_step(dec, dport, {"d": dreq})
        if first is None and plan.prefills:
            first = plan.prefills[0]
            assert first.num_external_tokens == 0 and first.num_cached_tokens == 8  # allocate's hit, computed on
            full = first.block_table[0].tolist()
            for j in range(7):
                assert block_tokens(dec.kv_cache, full[j]) == group_values(prompt, 0, j), j
    assert dec.scheduler.stats.stale_external_loads == 1 and dec.scheduler.stats.external_tokens == 0
    assert dport.stats["written_blocks"] == 0 and not bm.external.parked_seq_ids and not bm.external.loading_seq_ids
    bm.check_invariants()
