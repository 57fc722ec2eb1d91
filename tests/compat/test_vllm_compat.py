"""Compatibility with vLLM 0.33, checked with vLLM's own code (docs/compat.md).

vLLM runs in its own virtualenv, .venv-vllm (scripts/setup_vllm_compat.sh, run by scripts/setup.sh), through
tests/compat/vllm_side.py in subprocesses: this process never imports vllm. A missing virtualenv fails the tests
(it is never a skip) with the command that makes it.

- every payload pagedkv publishes (a block manager's events through the server's publisher, every medium, KV cache
  groups, cache salts, resets) decodes with vLLM's KVEventBatch decoder, and the replay socket answers frame for
  frame and byte for byte what a real vLLM ZmqEventPublisher answers for the same batches;
- pagedkv's vLLM-scheme block hashes equal vLLM's own request block hasher's, for random prompts, block sizes,
  salts, LoRA adapters and multimodal items, every --prefix-caching-hash-algo and seeds;
- ``pagedkv router --hash-scheme vllm`` in front of two replica stubs that publish with vLLM's ZmqEventPublisher
  and hash with vLLM's functions sends each request to the replica holding its prefix, and predicts the stub's
  hit exactly.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")
httpx = pytest.importorskip("httpx")

from pagedkv import BlockManager, FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from pagedkv import events as ev  # noqa: E402
from pagedkv.cluster.vllm_hash import ALGOS, VLLMHasher  # noqa: E402
from pagedkv.server.kv_events import KVEventPublisher, to_wire  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SIDE = Path(__file__).with_name("vllm_side.py")
SETUP = "bash scripts/setup_vllm_compat.sh"


def vllm_python() -> str:
    """The compat virtualenv's interpreter; the test fails (never skips) without it."""
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: the vLLM compatibility suite needs it; run `{SETUP}` "
                    "(scripts/setup.sh does)")
    return str(VENV_PYTHON)


def side_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update(PYTHONPATH=str(ROOT / "src"), VLLM_LOGGING_LEVEL="WARNING", **extra)
    return env


def run_side(*args: str, stdin: str | None = None, timeout: float = 300) -> object:
    """Run vllm_side.py in .venv-vllm; its JSON answer (the last line of its output)."""
    r = subprocess.run([vllm_python(), str(SIDE), *args], input=stdin, capture_output=True, text=True,
                       timeout=timeout, env=side_env(), cwd=str(ROOT))
    assert r.returncode == 0, f"vllm_side.py {args[0]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------- (a) KV events
def workload_batches() -> list:
    """Every kind of batch a replica publishes: a block manager with a CPU tier (stores, evictions, demotions to
    CPU, withdrawals, a reset), prompts with and without a cache salt (namespace), a hybrid manager's group
    events, and the disk and shared tiers' media."""
    rng = random.Random(5)
    batches = []
    bm = BlockManager(12, 4, num_cpu_blocks=8, enable_prefix_caching=True, cpu_prefix_cache=True, watermark=0,
                      enable_kv_events=True)
    stems = [[rng.randrange(5000) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    live = []
    for i in range(40):
        if live and (len(live) > 3 or rng.random() < 0.4):
            sid = live.pop(rng.randrange(len(live)))
            bm.free(sid, cache=rng.random() < 0.85)
        else:
            toks = rng.choice(stems) + [rng.randrange(5000) for _ in range(rng.randrange(0, 12))]
            sid = f"s{i}"
            try:
                bm.allocate(sid, toks, namespace=rng.choice([None, None, "tenant-a"]))
                live.append(sid)
            except Exception:  # out of blocks: no event
                pass
        if i == 30:
            bm.reset_prefix_cache()
        bm.take_copies()  # (the engine's step: demotions to the CPU tier done)
        got = bm.events.take()
        if got:
            batches.append(got)
    hm = BlockManager(60, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(8)],
                            enable_prefix_caching=True, watermark=0.0, enable_kv_events=True, grouped_results=True)
    for j in range(6):
        hm.allocate(f"h{j}", stems[j % 4] + list(range(j * 7, j * 7 + 9)), namespace="t" if j % 2 else None)
        if j % 3 == 2:
            hm.free(f"h{j - 1}", cache=False)
        got = hm.events.take()
        if got:
            batches.append(got)
    batches.append([ev.BlockStored([7, 2**64 - 1], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "DISK"),
                    ev.BlockStored([9], 7, [9, 9, 9, 9], 4, None, "SHARED"), ev.BlockRemoved([7], "DISK"),
                    ev.BlockRemoved([9], "SHARED"), ev.AllBlocksCleared()])
    return batches


def expected_summary(e) -> dict:
    """What vLLM's decoder must read of a pagedkv event: its wire struct's fields, vLLM's defaults filled in."""
    w = to_wire(e)
    d = {"type": type(w).__name__}
    if d["type"] == "BlockStored":
        d.update(block_hashes=w.block_hashes, parent_block_hash=w.parent_block_hash, token_ids=w.token_ids,
                 block_size=w.block_size, lora_id=None, medium=w.medium, lora_name=None, extra_keys=w.extra_keys,
                 group_idx=w.group_idx, kv_cache_spec_kind=w.kv_cache_spec_kind,
                 kv_cache_spec_sliding_window=w.kv_cache_spec_sliding_window)
    elif d["type"] == "BlockRemoved":
        d.update(block_hashes=w.block_hashes, medium=w.medium, group_idx=w.group_idx)
    return d


def test_every_published_payload_decodes_with_vllms_kveventbatch_and_replays_framed_as_vllms():
    batches = workload_batches()
    kinds = {(type(e).__name__, getattr(e, "medium", None), getattr(e, "group_idx", None) is not None,
              bool(getattr(e, "namespace", None))) for b in batches for e in b}
    for want in [("BlockStored", "GPU", False, False), ("BlockStored", "GPU", False, True),
                 ("BlockStored", "CPU", False, False), ("BlockRemoved", "GPU", False, False),
                 ("BlockStored", "GPU", True, False), ("BlockRemoved", "GPU", True, False),
                 ("AllBlocksCleared", None, False, False)]:
        assert want in kinds, f"the workload lacks {want}"
    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv-events")
    try:
        for b in batches:
            pub.publish(b)
        pub.flush()
        out = run_side("replay", pub.replay_endpoint, "kv-events")
    finally:
        pub.close()
    n = len(batches)
    ours = [[bytes.fromhex(f) for f in fr] for fr in out["ours"]]
    theirs = [[bytes.fromhex(f) for f in fr] for fr in out["vllm"]]
    # decoded by vLLM's KVEventBatch, every payload, every field as published
    assert len(out["events"]) == n and out["ranks"] == [0] * n
    assert out["events"] == [[expected_summary(e) for e in b] for b in batches]
    # framed as vLLM's publisher frames its replay: [b"", topic, seq, payload] ..., [b"", b"", END, b""]
    assert [len(fr) for fr in ours] == [4] * (n + 1)
    assert ours[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert [fr[2] for fr in ours[:-1]] == [i.to_bytes(8, "big") for i in range(n)]
    # and frame for frame, byte for byte, what vLLM's own ZmqEventPublisher answers for the same batches
    assert ours == theirs


# ---------------------------------------------------------------------------------------------- (b) block hashes
def hash_cases() -> list:
    rng = random.Random(33)
    cases = []
    for algo in ALGOS:
        seeds = [None, "0", "12345"] if algo.startswith("sha256") else ["0", "777"]
        for seed in seeds:
            for _ in range(5):
                bs = rng.choice([1, 2, 4, 16, 17, 32])
                n = rng.randrange(0, 5 * bs + 3)
                toks = [rng.choice([rng.randrange(256), rng.randrange(70000), rng.randrange(2**31)])
                        for _ in range(n)]
                mm, pos = [], rng.randrange(0, 8)
                while rng.random() < 0.5 and pos < n:
                    length = rng.randrange(1, 2 * bs + 2)
                    mm.append([f"img-{rng.randrange(1000)}", pos, length])
                    pos += length + rng.randrange(0, bs + 1)
                cases.append({"tokens": toks, "block_size": bs, "algo": algo, "seed": seed,
                              "cache_salt": rng.choice([None, "", "salt-é", "tenant"]),
                              "lora": rng.choice([None, ["sql-lora", "/adapters/sql"]]), "mm": mm})
    return cases


def test_vllm_scheme_hashes_equal_vllms_own_request_block_hasher():
    cases = hash_cases()
    got = run_side("hashes", stdin=json.dumps(cases))
    assert len(got) == len(cases)
    checked = 0
    for c, g in zip(cases, got):
        h = VLLMHasher(c["algo"], c["seed"], c["block_size"])
        assert h.none_hash.hex() == g["none_hash"], c
        lora = tuple(c["lora"]) if c["lora"] else None
        digests = h.block_digests(c["tokens"], cache_salt=c["cache_salt"], lora=lora,
                                  mm=[tuple(m) for m in c["mm"]])
        assert [d.hex() for d in digests] == g["digests"], c
        if lora is None and not c["mm"]:
            assert h.keys(c["tokens"], cache_salt=c["cache_salt"]) == g["event_keys"]
        checked += len(digests)
    assert checked > 100  # (some prompts are shorter than a block)


# --------------------------------------------------------------------------------------------- (c) the router
class Procs:
    """Subprocesses started by a test, each one's output in a log file, terminated at the end."""

    def __init__(self, logdir: Path) -> None:
        self.procs: list = []
        self.logdir = logdir

    def start(self, name: str, args, env) -> subprocess.Popen:
        log = self.logdir / f"{name}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(args, env=env, cwd=str(ROOT), stdout=f, stderr=subprocess.STDOUT)
        p.log = log
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[:4]} exited: {proc.log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {timeout} s")


def index_blocks(router_url: str) -> float:
    for line in httpx.get(router_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pagedkv_router_index_blocks "):
            return float(line.split()[-1])
    return -1.0


def test_router_in_front_of_vllm_stubs_routes_by_prefix_and_predicts_their_hits(tmp_path):
    bs, algo, seed, model = 16, "sha256_cbor", "1234", "smollm2-135m"
    procs = Procs(tmp_path)
    try:
        backends, stubs = [], []
        for i in range(2):
            port, replay = free_port(), free_port()
            pub = f"ipc://{tmp_path}/pub{i}"
            p = procs.start(f"stub{i}", [vllm_python(), str(SIDE), "stub", str(port), pub, f"tcp://127.0.0.1:{replay}", str(bs),
                             algo, model], side_env(PYTHONHASHSEED=seed))
            stubs.append((f"http://127.0.0.1:{port}", p))
            backends.append(f"http://127.0.0.1:{port},{pub},tcp://127.0.0.1:{replay}")
        for url, p in stubs:
            wait_http(url + "/health", p, 240)
        rport = free_port()
        args = [sys.executable, "-m", "pagedkv.cli", "router", "--port", str(rport), "--block-size", str(bs),
                "--hash-scheme", "vllm", "--vllm-hash-algo", algo, "--vllm-hash-seed", seed,
                "--health-interval", "0.5"]
        for b in backends:
            args += ["--backend", b]
        router = procs.start("router", args, dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path])))
        rurl = f"http://127.0.0.1:{rport}"
        wait_http(rurl + "/health", router, 120)
        c = httpx.Client(base_url=rurl, timeout=60)
        seen = []  # (replica, predicted, the stub's own hit)

        def ask(prompt, salt=None):
            body = {"model": model, "prompt": prompt, "max_tokens": 1}
            if salt is not None:
                body["cache_salt"] = salt
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            got = (r.headers["x-pagedkv-replica"], int(r.headers["x-pagedkv-predicted-cached-tokens"]),
                   r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            seen.append(got)
            return got

        def settle():
            """Wait until the router's index holds every block the stubs hold (their events all applied)."""
            def held():
                return sum(httpx.get(u + "/stub/stats", timeout=10).json()["blocks"] for u, _ in stubs)

            deadline = time.monotonic() + 20
            while index_blocks(rurl) != held() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert index_blocks(rurl) == held() > 0

        rng = random.Random(7)
        a = [rng.randrange(1, 40000) for _ in range(5 * bs + 3)]
        b = [rng.randrange(1, 40000) for _ in range(5 * bs + 3)]
        ra, pa, ha = ask(a)
        assert pa == ha == 0
        settle()
        rb, pb, hb = ask(b)
        assert rb != ra and pb == hb == 0  # no prefix anywhere: the other replica (fewer decisions)
        settle()
        # each request goes to the replica holding its prefix, and the router predicts the replica's hit
        assert ask(a[:3 * bs + 5] + [40001] * 20) == (ra, 3 * bs, 3 * bs)
        assert ask(b + [40002] * 9) == (rb, 5 * bs, 5 * bs)
        assert ask(a) == (ra, 5 * bs, 5 * bs)  # (capped: the last token is always computed)
        assert ask(b[:2 * bs] + [40003] * 40) == (rb, 2 * bs, 2 * bs)
        r, p, h = ask(a, salt="tenant")  # the salt is in vLLM's first block hash: nothing cached
        assert p == h == 0
        settle()
        assert ask(a, salt="tenant") == (r, 5 * bs, 5 * bs)
        assert ask(a[:4 * bs] + [1], salt="tenant") == (r, 4 * bs, 4 * bs)
        assert all(pred == hit for _, pred, hit in seen), seen
        stats = [httpx.get(u + "/stub/stats", timeout=10).json() for u, _ in stubs]
        assert sum(s["requests"] for s in stats) == len(seen)
    finally:
        procs.close()
