"""The KV connector seam (issue 32 item 4, :mod:`pagedkv.engine.connector`): a fake connector plugged into a real
engine (SmolLM2, blocks of 4) is driven by the step loop in the documented order (on_add -> poll reports the match
-> the admission reserves blocks -> start_loads after the step's copy plan -> poll reports the load -> write_loads
and on_blocks_filled before the forward -> store_computed after it -> close); a plain engine has no connector at
all; the storage tiers and the P/D port are instances of the interface; the composite asks and hands on as
documented."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

BS = 4
MARK = [200, 201, 202]  # prompts starting with these are the fake connector's
LONG = MARK + list(range(203, 241))  # 41 tokens: the fake reserves its first 2 blocks


def greedy(n=4):
    from pagedkv.engine.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make(engine, **kw):
    from pagedkv.engine.config import engine_configs
    from pagedkv.engine.llm import LLM

    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("num_gpu_blocks", 64)
    return LLM(engine.paged, block_size=BS, **engine_configs(**kw))


def ref(engine, p, n=4):
    return list(engine.reference_greedy(tuple(p), n).token_ids)


def fake_connector():
    from pagedkv.engine.connector import KVConnector

    class Recording(KVConnector):
        """Claims the prompts that start with MARK: reports 2 blocks available, then that none arrived (the
        reserved blocks are computed). Records every call with what it concerns."""

        def __init__(self):
            self.calls = []
            self.state = {}  # request id -> "asked" | "ready" | "loading" | "done"
            self.loads = {}

        def on_add(self, request_id, token_ids, namespace, block_manager):
            mine = list(token_ids[: len(MARK)]) == MARK
            self.calls.append(("on_add", request_id, mine))
            if mine:
                self.state[request_id] = "asked"
            return mine

        def poll(self, scheduler):
            n = 0
            for rid, st in list(self.state.items()):
                if st == "asked":
                    assert scheduler.kv_ready(rid, 0, 2 * BS, reserve=True)
                    self.state[rid] = "ready"
                    self.calls.append(("kv_ready", rid))
                    n += 1
                elif st == "loading":
                    assert scheduler.is_fetching(rid)
                    scheduler.kv_loaded(rid, 0)  # nothing arrived: the reserved blocks are computed
                    self.state[rid] = "done"
                    self.calls.append(("kv_loaded", rid))
            return n

        def start_loads(self, kv_loads):
            mine = [kl for kl in kv_loads if self.state.get(kl.request_id) == "ready"]
            for kl in mine:
                self.state[kl.request_id] = "loading"
                self.loads[kl.request_id] = kl.load
            self.calls.append(("start_loads", tuple(kl.request_id for kl in mine)))
            return [kl for kl in kv_loads if kl not in mine]

        def write_loads(self, plan, kv_cache):
            self.calls.append(("write_loads", tuple(pw.request_id for pw in plan.prefills)))

        def on_blocks_filled(self, plan, scheduler, requests):
            self.calls.append(("on_blocks_filled", tuple(pw.request_id for pw in plan.prefills)))

        def store_computed(self, plan, kv_cache, requests):
            assert all(pw.request_id in requests for pw in plan.prefills)
            self.calls.append(("store_computed", tuple(pw.request_id for pw in plan.prefills)))

        def wait(self, timeout):
            self.calls.append(("wait",))
            return False

        def close(self, timeout=30.0):
            self.calls.append(("close",))

    return Recording()


def test_the_step_loop_calls_a_connector_in_the_documented_order(engine):
    llm = make(engine)
    assert llm.core.kv_connectors is None  # a plain engine: no connector code on its path
    fake = fake_connector()
    llm.core.add_kv_connector(fake)
    other = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173]
    outs = llm.generate([{"prompt_token_ids": LONG}, {"prompt_token_ids": other}], greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [ref(engine, LONG), ref(engine, other)]
    rid, plain = outs[0].request_id, outs[1].request_id
    c = fake.calls
    assert ("on_add", rid, True) in c and ("on_add", plain, False) in c
    # the claimed request: matched, reserved and loaded (2 blocks from token 0) before it is computed
    load = fake.loads[rid]
    assert load.start_token == 0 and load.num_tokens == 2 * BS and len(load.block_ids) == 2
    first_compute = next(i for i, e in enumerate(c) if e[0] == "store_computed" and rid in e[1])
    order = [c.index(("on_add", rid, True)), c.index(("kv_ready", rid)), c.index(("start_loads", (rid,))),
             c.index(("kv_loaded", rid)), first_compute]
    assert order == sorted(order) and len(set(order)) == 5
    # the plain request was computed in the first step; every forward's calls come in order
    assert any(e[0] == "store_computed" and plain in e[1] for e in c[: c.index(("kv_loaded", rid))])
    steps = [i for i, e in enumerate(c) if e[0] == "store_computed"]
    for i in steps:
        assert [e[0] for e in c[i - 2: i]] == ["write_loads", "on_blocks_filled"]
        assert c[i - 2][1] == c[i - 1][1] == c[i][1]  # (the same plan)
    llm.close()
    assert c[-1] == ("close",)
    llm.block_manager.check_invariants()


def test_a_failed_add_is_forgotten_by_the_connector_that_claimed_it(engine):
    llm = make(engine)
    fake = fake_connector()
    forgotten = []
    fake.forget = forgotten.append
    llm.core.add_kv_connector(fake)
    req = llm.core.make_request({"prompt_token_ids": LONG}, greedy())
    llm.core.add_request(req)
    assert forgotten == []
    with pytest.raises(Exception):  # (the scheduler refuses a request id it has)
        llm.core.add_request(req)
    assert forgotten == [req.request_id]
    llm.core.abort(req.request_id)


def test_the_tiers_and_the_port_are_connectors_and_the_port_joins_only_when_used(engine, tmp_path):
    from pagedkv.engine.connector import KVConnector
    from pagedkv.engine.kv_port import EngineKVPort
    from pagedkv.engine.kv_tiers import EngineTiers

    llm = make(engine, kv_disk_dir=str(tmp_path / "disk"), kv_disk_gib=0.01)
    tiers = llm.kv_tiers
    assert isinstance(tiers, EngineTiers) and isinstance(tiers, KVConnector)
    assert llm.core.kv_connectors.connectors == (tiers,)
    port = EngineKVPort(llm)
    assert isinstance(port, KVConnector)
    assert llm.core.kv_connectors.connectors == (tiers,)  # not used yet: not stepped
    req = llm.core.make_request({"prompt_token_ids": LONG}, greedy(1))
    port.hold_on_finish(req, 30.0)
    assert llm.core.kv_connectors.connectors == (port, tiers)  # asked first, the tiers after it
    assert llm.kv_tiers is tiers and port.inner is tiers
    llm.core.add_request(req)
    while llm.core.has_unfinished():
        llm.core.step()
    hold = port.take_hold(req.request_id)
    assert hold is not None and len(hold.block_ids) == (len(LONG) - 1) // BS
    port.release_hold(hold.hold_id)
    llm.close()
    llm.block_manager.check_invariants()


def test_the_composite_asks_in_order_and_hands_leftover_loads_on():
    from pagedkv.engine.connector import KVConnector, KVConnectors

    log = []

    class C(KVConnector):
        def __init__(self, name, claims, takes, busy=False):
            self.name, self.claims, self.takes, self.busy = name, claims, takes, busy

        def on_add(self, rid, toks, ns, bm):
            log.append((self.name, "on_add", rid))
            return rid in self.claims

        def poll(self, scheduler):
            return 1

        def start_loads(self, kv_loads):
            log.append((self.name, "start_loads", tuple(kv_loads)))
            return [k for k in kv_loads if k not in self.takes]

        def store_computed(self, plan, kv_cache, requests):
            log.append((self.name, "store_computed"))

        def wait(self, timeout):
            log.append((self.name, "wait", timeout))
            return self.busy

    a, b = C("a", {"x"}, {"l1"}), C("b", {"y"}, {"l2"})
    both = KVConnectors((a, b))
    assert both.on_add("x", (), None, None) and log == [("a", "on_add", "x")]  # claimed by a: b not asked
    log.clear()
    assert both.on_add("y", (), None, None) and [e[0] for e in log] == ["a", "b"]
    assert not both.on_add("z", (), None, None)
    log.clear()
    assert both.start_loads(["l1", "l2", "l3"]) == ["l3"]
    assert log == [("a", "start_loads", ("l1", "l2", "l3")), ("b", "start_loads", ("l2", "l3"))]
    assert both.poll(None) == 2
    log.clear()
    assert not both.wait(1.0) and log == [("a", "wait", 0.005), ("b", "wait", 1.0)]
    log.clear()
    a.busy = True
    assert both.wait(1.0) and log == [("a", "wait", 0.005), ("b", "wait", 0.0)]
    assert both.with_connector(a) is both
    assert KVConnectors((a,)).with_connector(b, first=True).connectors == (b, a)
    with pytest.raises(TypeError):
        KVConnectors((object(),))
    with pytest.raises(NotImplementedError):
        KVConnector().on_add("r", (), None, None)


def test_a_plain_served_request_calls_no_kv_connector_code_and_a_handoff_plugs_the_port_in(engine):
    import sys
    import threading

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from pagedkv.engine import LLM
    from pagedkv.engine.kv_port import EngineKVPort
    from pagedkv.server.launch import make_server

    kv_files = ("engine/connector.py", "engine/kv_port.py", "engine/kv_fetch.py", "engine/kv_tiers.py",
                "server/kv_handoff.py", "server/kv_transfer.py", "server/kv_reader.py", "server/kv_staging.py")
    seen, on = set(), threading.Event()

    def profile(frame, event, arg):  # (every call on every thread: the files of the functions called)
        if on.is_set() and event == "call":
            seen.add(frame.f_code.co_filename.replace("\\", "/"))

    llm = LLM(engine.paged, num_gpu_blocks=64, max_num_seqs=4, block_size=BS)
    threading.setprofile(profile)  # (before the server's threads start)
    sys.setprofile(profile)
    try:
        srv = make_server(llm, model_name="m").start_in_thread()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    try:
        body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        with httpx.Client(timeout=60) as c:
            c.post(srv.url + "/v1/completions", json=body).raise_for_status()  # warm-up
            on.set()
            r = c.post(srv.url + "/v1/completions", json=body)
            on.clear()
            r.raise_for_status()
            assert any(f.endswith("engine/core.py") for f in seen)  # (the recorder saw the request)
            assert [f for f in seen if f.endswith(kv_files)] == []
            assert llm.core.kv_connectors is None
            # a prefill for a remote decode: the port joins the step loop and holds the prompt's blocks
            r = c.post(srv.url + "/v1/completions", json={**body, "kv_transfer_params": {"do_remote_decode": True}})
            r.raise_for_status()
            assert r.json()["kv_transfer_params"]["remote_block_ids"]
            (port,) = llm.core.kv_connectors.connectors
            assert isinstance(port, EngineKVPort)
    finally:
        sys.setprofile(None)
        srv.close()
