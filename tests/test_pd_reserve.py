"""The decode side of a prefill/decode split writes the arriving KV into blocks reserved for it (issue 25 item 1:
"blocks reserved for KV that arrives from elsewhere (the sequence waits until it has arrived, and the step loop
goes on)"; docs/pd-split.md#the-decode-side).

Two real Schedulers and BlockManagers with a small torch KV cache, the engine's step reduced to its KV writes
(each computed token's K/V set to its token id through the slot mapping), and the engine's port
(``pagedkv.engine.kv_port.EngineKVPort``) on both sides. The prefill side serves its hold over HTTP through the
server's routes (``KVHandoff`` + ``add_kv_routes``), slowed down; the decode side's ``KVHandoff.fetch_into`` reads
it into the decode request's reserved blocks while a thread runs the decode engine's step loop (under a lock, as
the server's engine thread does). Checked: the request is LOADING with its blocks reserved (counted by the
manager) while another request keeps decoding; every block then reads back the prompt's tokens; the bytes read
ahead of the writes stay at a few blocks for a long transfer; an abort mid-transfer stops the read, and a payload
that arrives after the abort is never written (its blocks are reused by another request, whose KV stays
intact)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv import BlockManager  # noqa: E402
from pagedkv.scheduler import Scheduler  # noqa: E402

BS = 16
L, H, D = 2, 4, 64  # one block's payload: 2 x 2 x 16 x 4 x 64 x 4 bytes = 64 KiB
PB = L * 2 * BS * H * D * 4
NBLK = 160


def engine(num_blocks: int = NBLK):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=256, enable_chunked_prefill=True,
                      incremental_tables=True)
    kv = torch.zeros(L, 2, num_blocks, BS, H, D)
    return SimpleNamespace(block_manager=bm, scheduler=sched, kv_cache=kv, kv_tiers=None, kv_cache_groups=None,
                           model=SimpleNamespace(w=torch.arange(3.0)))


def step(llm, port, by_id):
    """One engine step as ``LLM._step`` runs it: the port's poll, schedule, (no copies here), the reads of the
    loads this step reserved may start, the port's writes, the forward's KV writes (token ids), the port's hook,
    update."""
    port.poll(llm.scheduler)
    plan = llm.scheduler.schedule()
    if plan.kv_loads:
        port.start_loads(plan.kv_loads)
    port.write_loads(plan, llm.kv_cache)
    bs = llm.block_manager.block_size
    for pw in plan.prefills:
        prompt = by_id[pw.request_id].prompt_token_ids
        for pos, slot in zip(pw.positions.tolist(), np.asarray(pw.slot_mapping).tolist()):
            llm.kv_cache[:, :, slot // bs, slot % bs] = float(prompt[pos])
    port.store_computed(plan, llm.kv_cache, by_id)
    sampled = [7] * len(plan.prefills) + ([7] * len(plan.decode.seq_ids) if plan.decode is not None else [])
    done = llm.scheduler.update(plan, sampled)
    llm.block_manager.check_invariants()
    return plan, done


def add(llm, port, rid, prompt, max_tokens):
    req = SimpleNamespace(request_id=rid, prompt_token_ids=tuple(prompt))
    wait = port.on_add(rid, prompt, None, llm.block_manager)
    llm.scheduler.add_request(rid, prompt, max_tokens=max_tokens, wait_for_kv=wait)
    return req


def block_reads_back(kv, block, tokens) -> bool:
    want = torch.tensor([float(t) for t in tokens])
    return bool((kv[:, :, block, : len(tokens)] == want[None, None, :, None, None]).all())


def prompt_reads_back(llm, rid, seq_id, prompt) -> list:
    """The indices of the prompt's whole blocks whose KV is not the prompt's tokens (empty: all good)."""
    table = llm.block_manager.block_table(seq_id)
    bad = []
    for i in range((len(prompt) - 1) // BS):
        if not block_reads_back(llm.kv_cache, int(table[i]), prompt[i * BS:(i + 1) * BS]):
            bad.append(i)
    return bad


# ---------------------------------------------------------------------------------------------- the prefill side
class Prefill:
    """A prefill replica: an engine whose port holds a prompt's blocks, served over HTTP by the server's routes.
    ``delay``: seconds each read of a few blocks (``_READ_BATCH``) takes, so the transfer is slow."""

    def __init__(self, delay: float = 0.0) -> None:
        from fastapi import FastAPI

        from pagedkv.engine.kv_port import EngineKVPort
        from pagedkv.server.kv_handoff import KVHandoff
        from pagedkv.server.routes.kv import add_kv_routes
        from pagedkv.server.launch import serve_in_thread

        self.llm = engine()
        self.port = EngineKVPort(self.llm)
        real = self.port.read_blocks

        def slow(hold_id, ids):
            time.sleep(delay)
            return real(hold_id, ids)

        self.port.read_blocks = slow
        self.handoff = KVHandoff(role="prefill", port=self.port, lease_s=60.0)
        app = FastAPI()
        add_kv_routes(app, self.handoff, lambda request: None)
        self.server, self.thread, number = serve_in_thread(app, "127.0.0.1", 0, "pd-reserve-prefill")
        self.handoff.port_number = number

    def hold(self, rid, prompt):
        """Compute ``prompt`` here and hold its blocks: the ``kv_transfer_params`` a decode replica gets."""
        from pagedkv.server.kv_transfer import parse_kv_transfer_params

        req = SimpleNamespace(request_id=rid, prompt_token_ids=tuple(prompt))
        wait = self.port.on_add(rid, prompt, None, self.llm.block_manager)
        self.handoff.expect_hold(req, prompt, None)
        self.llm.scheduler.add_request(rid, prompt, max_tokens=1, wait_for_kv=wait)
        while self.llm.scheduler.has_unfinished():
            step(self.llm, self.port, {rid: req})
        return parse_kv_transfer_params(self.handoff.answer(rid))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class DecodeLoop:
    """The decode engine's step loop in a thread, under ``lock`` (the server's engine thread), recording after
    each step what the test checks."""

    def __init__(self, llm, port, by_id, watch: str) -> None:
        self.llm, self.port, self.by_id, self.watch = llm, port, by_id, watch
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.log: list = []
        self.error = None
        self.seq_id = None  # the watched request's sequence, once its blocks are reserved
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        sched, bm = self.llm.scheduler, self.llm.block_manager
        try:
            while not self.stop.is_set():
                with self.lock:
                    if sched.has_unfinished() or sched.num_parked:
                        plan, _ = step(self.llm, self.port, self.by_id)
                        fetching = sched.is_fetching(self.watch)
                        f = self.port._fetching.get(self.watch)
                        ext = bm.external.external_blocks(f[1].seq_id) if f is not None and fetching else None
                        if f is not None:
                            self.seq_id = f[1].seq_id
                        self.log.append(SimpleNamespace(
                            fetching=fetching, decoded=plan.decode is not None and len(plan.decode.seq_ids),
                            loading=len(bm.external.loading_seq_ids), free=bm.num_free_gpu_blocks,
                            reserved=len(ext.block_ids) if ext is not None else 0))
                    idle = not (sched.num_running or sched.num_waiting)
                if idle:
                    self.port.wait(0.01)
                else:
                    time.sleep(0.003)  # (a forward's time: other threads run meanwhile)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)
        assert self.error is None, repr(self.error)


async def fetch(handoff, kvt, prompt, ticket):
    try:
        return await handoff.fetch_into(kvt, prompt, None, ticket)
    finally:
        await handoff.aclose()


def decode_side(budget_bytes: int):
    from pagedkv.engine.kv_port import EngineKVPort
    from pagedkv.server.kv_handoff import KVHandoff

    llm = engine()
    port = EngineKVPort(llm)
    handoff = KVHandoff(role="decode", port=port, fetch_timeout=30.0, fetch_buffer_bytes=budget_bytes)
    return llm, port, handoff


def test_the_request_loads_into_reserved_blocks_while_others_step_and_the_bytes_staged_stay_few():
    pre = Prefill(delay=0.03)
    try:
        prompt = [1000 + (i % 500) for i in range(100 * BS + 1)]  # 100 whole blocks before the last token
        kvt = pre.hold("p", prompt)
        assert len(kvt.remote_block_ids) == 100
        llm, port, handoff = decode_side(4 * PB)  # room for 4 blocks read ahead of the writes (6.4 MiB sent)
        assert port.payload_bytes == PB
        sched, bm = llm.scheduler, llm.block_manager
        other = add(llm, port, "o", list(range(1, 30)), 2_000)  # a stream decoding all along
        d = SimpleNamespace(request_id="d", prompt_token_ids=tuple(prompt))
        ticket = port.expect_external(d, len(kvt.remote_block_ids))
        by_id = {"o": other, "d": d}
        with DecodeLoop(llm, port, by_id, "d") as loop:
            with loop.lock:
                add(llm, port, "d", prompt, 2_000)  # queued at once, waiting for its KV
            res = asyncio.run(fetch(handoff, kvt, prompt, ticket))
            deadline = time.monotonic() + 20
            while port.stats["loaded"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)  # (a few more steps: the rest of the prompt computed)
        assert res.complete and res.num_received == 100, res
        # the step loop went on while the request's KV arrived: steps with it FETCHING that decoded the other
        during = [e for e in loop.log if e.fetching]
        assert len(during) >= 5 and sum(bool(e.decoded) for e in during) >= 5
        # the manager counted its reserved blocks meanwhile: LOADING, 100 blocks of the pool taken
        assert all(e.loading == 1 for e in during)
        assert all(e.reserved == 100 for e in during)
        assert max(e.free for e in during) <= NBLK - 101  # (its 100 blocks and one for its last token)
        # every block written as it arrived, once; the bytes read ahead of the writes stayed at a few blocks
        assert port.stats["written_blocks"] == 100 and port.stats["fetches_reserved"] == 1
        peak = handoff.staging.peak
        assert peak <= 4 * PB + 2 * PB, peak  # the bound plus what one HTTP chunk completes
        assert handoff.staging.used == 0
        print(f"peak staged {peak} bytes ({peak / PB:.1f} blocks) for a transfer of {100 * PB} bytes")
        with loop.lock:
            assert sched.has_request("d") and not sched.is_fetching("d")
            assert prompt_reads_back(llm, "d", loop.seq_id, prompt) == []
            assert sched.stats.external_tokens == 100 * BS
        assert ticket.ended == (100, None) and pre.handoff.num_holds == 0  # the hold released
    finally:
        pre.close()


def payload_of(tokens) -> bytes:
    """The KV the forward writes for a block of ``tokens`` (every layer, K and V: each token's id)."""
    t = torch.tensor([float(x) for x in tokens]).view(1, 1, BS, 1, 1).expand(L, 2, BS, H, D).contiguous()
    return t.numpy().tobytes()


def test_an_abort_while_the_blocks_arrive_never_writes_into_blocks_reused_since():
    """The client leaves while its request is FETCHING: the manager parks its reserved blocks, the read is told to
    stop (``cancelled``), payloads that arrive after the abort are never written, and once the read ends the
    parked blocks are freed; another request that then takes them keeps its own KV, whatever arrives late.
    Deterministic: the read is played by hand on the ticket, between steps."""
    from pagedkv.engine.kv_port import EngineKVPort

    llm = engine(num_blocks=24)  # small: the next request must reuse the aborted one's blocks
    port = EngineKVPort(llm)
    sched, bm = llm.scheduler, llm.block_manager
    prompt = [500 + i for i in range(20 * BS + 1)]  # 20 whole blocks
    d = SimpleNamespace(request_id="d", prompt_token_ids=tuple(prompt))
    t = port.expect_external(d, 20)
    add(llm, port, "d", prompt, 4)
    plan, _ = step(llm, port, {"d": d})
    (kl,) = plan.kv_loads
    reserved = set(kl.load.block_ids)
    assert len(reserved) == 20 and t._decided == 20 and sched.is_fetching("d")
    for i in range(3):  # three blocks arrive and are written at the next step
        t.put(payload_of(prompt[i * BS:(i + 1) * BS]))
    step(llm, port, {"d": d})
    assert port.stats["written_blocks"] == 3
    assert block_reads_back(llm.kv_cache, kl.load.block_ids[2], prompt[2 * BS:3 * BS])
    t.put(b"\xff" * PB)  # arrived, not written yet, when the client leaves
    sched.abort_request("d")
    assert sched.num_parked == 1 and set(bm.external.parked_seq_ids) == {kl.seq_id}
    step(llm, port, {})
    assert t.cancelled and port.stats["written_blocks"] == 3 and port.stats["fetches_aborted"] == 1
    t.put(b"\xff" * PB)  # the read had not seen the cancel yet: dropped
    assert not t._queue
    # the parked blocks are not reused while the read may still write
    x = [900 + i for i in range(12 * BS + 1)]
    add(llm, port, "x", x, 50)
    plan, _ = step(llm, port, {"x": SimpleNamespace(request_id="x", prompt_token_ids=tuple(x))})
    assert not plan.prefills and sched.num_waiting == 1  # (24 blocks: 20 parked, x needs 13)
    t.end(4, None)  # the read ends (it saw the cancel)
    by_id = {"x": SimpleNamespace(request_id="x", prompt_token_ids=tuple(x))}
    plan, _ = step(llm, port, by_id)  # the port reports the end: the parked blocks are freed, x admitted
    while not plan.prefills:
        plan, _ = step(llm, port, by_id)
    (pw,) = plan.prefills
    xs = set(pw.block_table.tolist()[:12])
    assert xs & reserved  # x took blocks the aborted request had reserved
    t.put(b"\xff" * PB)  # a payload arriving after everything: never written
    step(llm, port, by_id)
    assert port.stats["written_blocks"] == 3
    assert prompt_reads_back(llm, "x", pw.seq_id, x) == []
    assert sched.num_parked == 0 and not bm.external.parked_seq_ids and not port._fetching


def test_an_abort_mid_transfer_stops_the_read_and_frees_the_blocks():
    """Over HTTP from a slow prefill replica: the request is aborted after its first blocks were written; the
    read stops at the next chunk (its result says so), the parked blocks are freed by the step loop, which
    stepped on although nothing else ran, and the pool is whole again."""
    pre = Prefill(delay=0.05)
    try:
        prompt = [3000 + (i % 700) for i in range(60 * BS + 1)]
        kvt = pre.hold("p", prompt)
        llm, port, handoff = decode_side(2 * PB)
        sched, bm = llm.scheduler, llm.block_manager
        free0 = bm.num_free_gpu_blocks
        d = SimpleNamespace(request_id="d", prompt_token_ids=tuple(prompt))
        ticket = port.expect_external(d, 60)
        with DecodeLoop(llm, port, {"d": d}, "d") as loop:
            with loop.lock:
                add(llm, port, "d", prompt, 4)

            async def go():
                task = asyncio.ensure_future(fetch(handoff, kvt, prompt, ticket))
                while port.stats["written_blocks"] < 2:
                    await asyncio.sleep(0.01)
                with loop.lock:
                    sched.abort_request("d")
                return await task

            res = asyncio.run(go())
            deadline = time.monotonic() + 10
            while (sched.num_parked or port._fetching) and time.monotonic() < deadline:
                time.sleep(0.02)
        assert res.num_received < 60 and "ended" in res.error, res
        assert ticket.cancelled and port.stats["fetches_aborted"] == 1
        assert sched.num_parked == 0 and not bm.external.parked_seq_ids and not port._fetching
        assert bm.num_free_gpu_blocks == free0 and handoff.staging.used == 0
        bm.check_invariants()
    finally:
        pre.close()


def test_a_prefill_replica_killed_mid_transfer_leaves_the_blocks_written_so_far():
    """A prefill replica in its own process (tests/kv_fakes.py: a fake engine, 64-byte blocks of 4 tokens) sends
    the first 8 blocks of 13, stalls, and is killed with SIGKILL while the decode engine's request is FETCHING:
    the 8 blocks that arrived checked are in its reserved blocks, the read ends with the error, the scheduler is
    told 8 blocks arrived and computes the rest of the prompt."""
    import os
    import select
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    from pagedkv.engine.kv_io import read_blocks
    from pagedkv.engine.kv_port import EngineKVPort
    from pagedkv.server.kv_handoff import KVHandoff
    from pagedkv.server.kv_transfer import parse_kv_transfer_params, prefill_body
    from kv_fakes import FakePort, block_payload

    fbs = 4
    bm = BlockManager(64, fbs, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=True,
                      incremental_tables=True)
    llm = SimpleNamespace(block_manager=bm, scheduler=sched, kv_cache=torch.zeros(1, 2, 64, fbs, 1, 2),
                          kv_tiers=None, kv_cache_groups=None, model=None)
    port = EngineKVPort(llm)
    port._fingerprint = FakePort(fbs).fingerprint  # (the fake prefill replica's model: its names check)
    assert port.payload_bytes == 64
    handoff = KVHandoff(role="decode", port=port, fetch_timeout=20.0)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("kv_fakes.py"))], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})

    def line(timeout):
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        return proc.stdout.readline().decode().strip() if ready else ""

    try:
        first = line(60)
        assert first.startswith("url "), first
        body = {"prompt": "a prompt long enough for thirteen blocks of four bytes", "max_tokens": 3}
        kvp = httpx.post(first[4:] + "/v1/completions", json=prefill_body(body), timeout=30).json()
        kvt = parse_kv_transfer_params(kvp["kv_transfer_params"])
        assert len(kvt.remote_block_ids) == 13
        prompt = list(body["prompt"].encode())
        d = SimpleNamespace(request_id="d", prompt_token_ids=tuple(prompt))
        ticket = port.expect_external(d, 13)
        with DecodeLoop(llm, port, {"d": d}, "d") as loop:
            with loop.lock:
                add(llm, port, "d", prompt, 500)

            async def go():
                task = asyncio.ensure_future(fetch(handoff, kvt, prompt, ticket))
                assert await asyncio.to_thread(line, 20) == "stalled"  # 8 blocks on the wire
                os.kill(proc.pid, signal.SIGKILL)
                return await task

            res = asyncio.run(go())
            deadline = time.monotonic() + 10
            while sched.stats.prefills < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.1)
        assert res.num_received == 8 and res.error is not None, res
        assert ticket.ended[0] == 8 and port.stats["written_blocks"] == 8 and port.stats["fetches_partial"] == 1
        with loop.lock:
            assert sched.stats.external_tokens == 8 * fbs and sched.stats.prefills == 1
            table = bm.block_table(loop.seq_id).tolist()
            got = [bytes(memoryview(p).cast("B")) for p in read_blocks(llm.kv_cache, table[:8])]
            assert got == [block_payload(prompt[i:i + fbs], 64) for i in range(0, 8 * fbs, fbs)]
        assert handoff.stats["fetches_partial"] == 1 and handoff.stats["releases_failed"] == 1
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_a_request_dropped_before_the_scheduler_saw_it_reads_nothing_and_releases_the_hold():
    """The engine never queued the request (aborted in the same batch as its add, or the engine failed): its read
    waits for blocks that will never be reserved until ``gone`` says its stream ended, then reads nothing and
    releases the prefill replica's hold at once."""
    pre = Prefill()
    try:
        prompt = [7000 + i for i in range(10 * BS + 1)]
        kvt = pre.hold("p", prompt)
        assert pre.handoff.num_holds == 1
        llm, port, handoff = decode_side(1 << 20)
        d = SimpleNamespace(request_id="d", prompt_token_ids=tuple(prompt))
        ticket = port.expect_external(d, 10)
        ended = []

        async def go():
            try:
                return await handoff.fetch_into(kvt, prompt, None, ticket, gone=lambda: bool(ended))
            finally:
                await handoff.aclose()

        async def main():
            task = asyncio.ensure_future(go())
            await asyncio.sleep(0.7)
            assert not task.done()  # (waiting for its blocks)
            ended.append(True)
            return await asyncio.wait_for(task, 5)

        res = asyncio.run(main())
        assert res.num_received == 0 and res.asked == 0 and ticket.cancelled and ticket.ended == (0, None)
        assert pre.handoff.num_holds == 0 and handoff.stats["bytes_fetched"] == 0
        assert not port.on_add("d", prompt, None, llm.block_manager)  # (added late: computed, no wait)
    finally:
        pre.close()


def test_a_refused_value_keeps_the_good_leading_blocks_and_the_rest_is_computed():
    """The decode replica's prompt differs from the prefill replica's in block 3 (another prompt's block arrives
    there: refused, MISMATCH): blocks 0-2 are kept in their reserved blocks, the read stops, the hold is
    released, and the rest of the prompt is computed from the decode replica's own tokens: every block reads back
    its prompt."""
    pre = Prefill()
    try:
        prompt = [8000 + i for i in range(12 * BS + 1)]
        kvt = pre.hold("p", prompt)
        mine = prompt[:3 * BS] + [5] + prompt[3 * BS + 1:]  # block 3 differs
        llm, port, handoff = decode_side(1 << 20)
        sched = llm.scheduler
        d = SimpleNamespace(request_id="d", prompt_token_ids=tuple(mine))
        ticket = port.expect_external(d, 12)
        with DecodeLoop(llm, port, {"d": d}, "d") as loop:
            with loop.lock:
                add(llm, port, "d", mine, 500)
            res = asyncio.run(fetch(handoff, kvt, mine, ticket))
            deadline = time.monotonic() + 10
            while sched.stats.prefills < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.1)
        assert res.num_received == 3 and "block 3 refused: MISMATCH" in res.error, res
        assert port.stats["written_blocks"] == 3 and handoff.stats["fetches_partial"] == 1
        assert pre.handoff.num_holds == 0  # released once the read ended
        with loop.lock:
            assert sched.stats.external_tokens == 3 * BS
            assert prompt_reads_back(llm, "d", loop.seq_id, mine) == []
    finally:
        pre.close()


def test_a_request_whose_blocks_do_not_fit_waits_in_the_queue_and_nothing_is_read_for_it():
    """Admission control: the decode request's 20 blocks do not fit beside a running request, so it waits in the
    queue like any request, its read not started (``reserved()`` undecided); once the other request is gone its
    blocks are reserved and the read may start."""
    from pagedkv.engine.kv_port import EngineKVPort

    llm = engine(num_blocks=24)
    port = EngineKVPort(llm)
    sched, bm = llm.scheduler, llm.block_manager
    o_prompt = [100 + i for i in range(12 * BS)]
    o = add(llm, port, "o", o_prompt, 1000)
    step(llm, port, {"o": o})
    prompt = [600 + i for i in range(20 * BS + 1)]
    d = SimpleNamespace(request_id="d", prompt_token_ids=tuple(prompt))
    t = port.expect_external(d, 20)
    add(llm, port, "d", prompt, 4)
    by_id = {"o": o, "d": d}
    for _ in range(5):
        plan, _ = step(llm, port, by_id)
        assert not plan.kv_loads and plan.decode is not None  # o decodes; d waits
    assert sched.num_waiting == 1 and not sched.is_fetching("d") and t._decided is None
    assert not bm.external.loading_seq_ids
    sched.abort_request("o")
    plan, _ = step(llm, port, by_id)
    (kl,) = plan.kv_loads
    assert kl.request_id == "d" and len(kl.load.block_ids) == 20 and t._decided == 20
    sched.abort_request("d")  # (the read never comes: its end frees the parked blocks)
    t.end(0, "test over")
    step(llm, port, by_id)
    assert sched.num_parked == 0 and not bm.external.parked_seq_ids
