"""Many replicas, torch-free part: the KV-event-fed prefix index, the routing policies and the cluster replay
(``pagedkv replay --replicas``)."""

import json
import random
from pathlib import Path

import pytest

from pagedkv import BlockManager, block_hashes
from pagedkv.cli import main as cli_main
from pagedkv.cluster import MemoryIndex, predicted_tokens
from pagedkv.cluster.policy import ApproxPrefixPolicy, LeastLoaded, PrefixPolicy, RoundRobin, make_policy
from pagedkv.replay.cluster import replay_cluster, replay_pooled
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.replay import parse_trace_lines, replay_sequence

SAMPLE = Path(__file__).parent / "data" / "mooncake_conversation_sample.jsonl"


def stored(hashes, medium="GPU"):
    return BlockStored(list(hashes), None, [], 16, None, medium)


# ---------------------------------------------------------------------------------------------- the index
def test_longest_prefix_counts_leading_blocks_per_replica():
    ix = MemoryIndex()
    ix.apply("a", stored([1, 2, 3, 4]))
    ix.apply("b", stored([1, 2]))
    ix.apply("c", stored([9]))
    assert ix.longest_prefix([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert ix.longest_prefix([1, 2, 3]) == {"a": 3, "b": 2}
    assert ix.longest_prefix([7, 1, 2]) == {}  # a match starts at the first block
    assert ix.longest_prefix([]) == {}
    ix.apply("a", BlockRemoved([2]))
    assert ix.longest_prefix([1, 2, 3, 4]) == {"a": 1, "b": 2}  # 3 and 4 stay but are unreachable
    ix.apply("a", BlockRemoved([2, 77]))  # removing what is absent: a no-op
    ix.apply("b", stored([1, 2]))  # storing twice: a no-op
    assert ix.longest_prefix([1, 2]) == {"a": 1, "b": 2}
    assert ix.num_blocks() == 3 + 2 + 1 and ix.num_blocks("a") == 3


def test_all_blocks_cleared_and_drop_replica():
    ix = MemoryIndex()
    ix.apply("a", stored([1, 2]))
    ix.apply("b", stored([1, 2, 3]))
    ix.apply("a", AllBlocksCleared())
    assert ix.longest_prefix([1, 2, 3]) == {"b": 3} and "a" in ix.replicas() and ix.num_blocks("a") == 0
    ix.apply("a", stored([1]))
    ix.drop_replica("b")
    assert ix.longest_prefix([1, 2, 3]) == {"a": 1} and ix.replicas() == ["a"]
    ix.drop_replica("nobody")
    ix.apply("c", stored([1, 2]))  # reuses b's bit: none of b's blocks may leak into c
    assert ix.longest_prefix([1, 2, 3]) == {"a": 1, "c": 2}
    with pytest.raises(ValueError):
        ix.apply("a", object())
    with pytest.raises(ValueError):
        ix.apply("a", stored([1], medium="TAPE"))


def test_cpu_tier_counts_for_either_medium_and_policy_prefers_gpu():
    ix = MemoryIndex()
    ix.apply("gpu", stored([1, 2, 3]))
    ix.apply("mixed", stored([1, 2]))
    ix.apply("mixed", stored([3, 4], medium="CPU"))
    assert ix.has_cpu
    assert ix.longest_prefix([1, 2, 3, 4]) == {"gpu": 3, "mixed": 4}
    assert ix.longest_prefix([1, 2, 3, 4], "GPU") == {"gpu": 3, "mixed": 2}
    assert ix.longest_prefix([1, 2, 3, 4], "CPU") == {}
    # gpu: 3 GPU blocks = 3; mixed: 2 GPU + 2 CPU at weight 0.5 = 3; tie -> least loaded; weight 0.4 -> gpu
    pol = PrefixPolicy(ix, slack=None, cpu_weight=0.4)
    assert pol.choose(["gpu", "mixed"], {"gpu": 5, "mixed": 0}, [1, 2, 3, 4]).replica == "gpu"
    pol = PrefixPolicy(ix, slack=None, cpu_weight=0.9)
    assert pol.choose(["gpu", "mixed"], {"gpu": 0, "mixed": 5}, [1, 2, 3, 4]).replica == "mixed"


def test_index_fed_by_events_predicts_every_hit_of_a_real_manager():
    """Random prompts sharing prefixes over 3 small managers, some requests kept running a while: after every
    call the events go to the index, and the index's match on the replica a request goes to, capped as the
    engine caps it, is exactly its hit; at the end the index holds exactly each manager's cached blocks."""
    rng = random.Random(7)
    bs = 4
    bms = [BlockManager(40, bs, enable_prefix_caching=True, watermark=0.0, enable_kv_events=True) for _ in range(3)]
    ix = MemoryIndex()
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    running: list = []
    for i in range(400):
        prompt = rng.choice(stems)[: rng.randrange(1, 41)] + [rng.randrange(1000) for _ in range(rng.randrange(0, 9))]
        r = rng.randrange(3)
        while running and (len(running) > 3 or rng.random() < 0.5):
            rr, seq = running.pop(rng.randrange(len(running)))
            bms[rr].free(seq)
            ix.apply_all(rr, bms[rr].events.take())
        want = ix.longest_prefix(block_hashes(prompt, bs)).get(r, 0)
        if bms[r].can_allocate(prompt).name != "OK":
            continue
        assert bms[r].allocate(i, prompt) == predicted_tokens(want, len(prompt), bs), (i, r)
        ix.apply_all(r, bms[r].events.take())
        running.append((r, i))
    for r, bm in enumerate(bms):
        assert ix.num_blocks(r) == len(bm._cache) > 0


# ---------------------------------------------------------------------------------------------- policies
def test_round_robin_and_least_loaded():
    rr = RoundRobin()
    assert [rr.choose(["a", "b", "c"], {}).replica for _ in range(4)] == ["a", "b", "c", "a"]
    assert LeastLoaded().choose(["a", "b", "c"], {"a": 3, "b": 1, "c": 1}).replica == "b"
    with pytest.raises(ValueError):
        rr.choose([], {})
    with pytest.raises(ValueError):
        make_policy("random")
    with pytest.raises(ValueError):
        make_policy("prefix")


def test_prefix_policy_respects_the_balance_limit():
    ix = MemoryIndex()
    ix.apply("a", stored([1, 2, 3]))
    ix.apply("b", stored([1]))
    reps = ["a", "b", "c"]
    pol = PrefixPolicy(ix, slack=0.2)
    d = pol.choose(reps, {"a": 10, "b": 10, "c": 10}, [1, 2, 3], cost=1)
    assert d == ("a", 3, "prefix")
    # a would hold 21 of 31 + 1 (limit 1.2 * 32 / 3 = 12.8): skipped; b is next best
    assert pol.choose(reps, {"a": 20, "b": 5, "c": 6}, [1, 2, 3], cost=1).replica == "b"
    # nobody matches: the least loaded of the allowed
    assert pol.choose(reps, {"a": 10, "b": 9, "c": 8}, [7], cost=1).replica == "c"
    # without a limit the longest prefix always wins
    assert PrefixPolicy(ix, slack=None).choose(reps, {"a": 100, "b": 0, "c": 0}, [1, 2, 3]).replica == "a"
    # abs_slack lets small absolute loads through (the live router counts requests in flight)
    assert PrefixPolicy(ix, slack=0.2, abs_slack=2).choose(reps, {"a": 1, "b": 0, "c": 0}, [1, 2, 3]).replica == "a"
    assert PrefixPolicy(ix, slack=0.2).choose(reps, {"a": 1, "b": 0, "c": 0}, [1, 2, 3]).replica == "b"
    # per-replica costs (the live router: only the tokens a replica lacks): a's hit makes it cheap enough
    loads = {"a": 100, "b": 90, "c": 90}
    assert pol.choose(reps, loads, [1, 2, 3], {"a": 10, "b": 40, "c": 40}).replica == "a"  # 110 <= 1.2 * 290 / 3
    assert pol.choose(reps, loads, [1, 2, 3], 40).replica == "b"  # a: 140 > 1.2 * 320 / 3; b holds block 1


def test_prefix_approx_learns_from_its_own_decisions_only():
    pol = ApproxPrefixPolicy(capacity_blocks=4, slack=None)
    reps = ["a", "b"]
    assert pol.choose(reps, {}, [1, 2, 3]).replica == "a"
    pol.routed("a", [1, 2, 3])
    assert pol.choose(reps, {"a": 1}, [1, 2, 3, 9]) == ("a", 3, "prefix-approx")
    pol.routed("a", [5, 6, 7])  # 6 blocks routed to a capacity of 4: the oldest tails go first
    assert pol.index.longest_prefix([1, 2, 3]) == {"a": 1} and pol.index.num_blocks("a") == 4
    pol.forget("a")
    assert pol.index.longest_prefix([5, 6]) == {}


# ---------------------------------------------------------------------------------------------- cluster replay
def trace_of(*reqs):
    return parse_trace_lines([json.dumps({"timestamp": 0, "input_length": n, "output_length": 0, "hash_ids": ids})
                              for n, ids in reqs], "hand")


def test_cluster_replay_on_a_hand_made_trace():
    # two conversations alternating, each turn extending its own history by one 512-token block
    reqs = []
    for turn in range(1, 5):
        reqs.append((512 * turn, [10 + k for k in range(turn)]))
        reqs.append((512 * turn, [100 + k for k in range(turn)]))
    tr = trace_of(*reqs)
    # round robin over 2 replicas sends all of conversation A to replica 0, B to 1: every turn hits its history
    rr = replay_cluster(tr, 100_000, 2, "round-robin")
    pre = replay_cluster(tr, 100_000, 2, "prefix")
    pooled = replay_pooled(tr, 100_000, 2)
    hist = 2 * 512 * (0 + 1 + 2 + 3)
    assert rr.hit_tokens == pre.hit_tokens == pooled.hit_tokens == hist
    assert pre.load_imbalance == 1.0 and pre.predicted_hit_tokens == pre.hit_tokens
    # 3 replicas: round robin scatters the turns, prefix keeps each conversation together
    rr3 = replay_cluster(tr, 100_000, 3, "round-robin")
    pre3 = replay_cluster(tr, 100_000, 3, "prefix", balance_slack=None)  # the longest prefix alone
    assert rr3.hit_tokens < hist and pre3.hit_tokens == hist
    assert [p["requests"] for p in pre3.per_replica].count(0) == 1
    d = pre3.to_json()
    assert d["replicas"] == 3 and d["route"] == "prefix" and d["load_imbalance"] == pytest.approx(1.5)


def conversations(n_conv=12, turns=6, seed=3):
    """Multi-turn chats, interleaved at random: turn t of a chat is its system block (shared by all chats),
    then its own history, one new 512-token block per turn."""
    rng = random.Random(seed)
    left = {c: 1 for c in range(n_conv)}
    reqs = []
    while left:
        c = rng.choice(sorted(left))
        t = left[c]
        reqs.append((512 * (t + 1) - rng.randrange(0, 100), [0] + [1000 * (c + 1) + k for k in range(t)]))
        left[c] += 1
        if left[c] > turns:
            del left[c]
    return trace_of(*reqs)


def test_cluster_replay_prefix_beats_round_robin_and_one_replica_is_the_plain_replay():
    tr = conversations()
    one = replay_cluster(tr, 40_000, 1, "prefix")
    assert one.hit_tokens == replay_sequence(tr, 40_000).hit_tokens
    rr = replay_cluster(tr, 8_000, 4, "round-robin")
    pre = replay_cluster(tr, 8_000, 4, "prefix", balance_slack=0.2)
    approx = replay_cluster(tr, 8_000, 4, "prefix-approx", balance_slack=0.2)
    pooled = replay_pooled(tr, 8_000, 4)
    assert pre.hit_rate > 1.5 * rr.hit_rate and pre.load_imbalance <= 1.2 + 1e-9
    assert pre.hit_rate >= 0.8 * pooled.hit_rate and approx.hit_rate > rr.hit_rate
    assert pre.predicted_hit_tokens == pre.hit_tokens  # the events-fed index predicts every hit
    assert sum(p["prompt_tokens"] for p in pre.per_replica) == pre.prompt_tokens == rr.prompt_tokens


def test_replay_command_with_replicas(tmp_path, capsys):
    out = tmp_path / "c.json"
    rc = cli_main(["replay", str(SAMPLE), "--replicas", "3", "--capacity", "100k", "--limit", "120",
                   "--route", "round-robin", "--route", "prefix", "--no-progress", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "pooled (1 manager)" in text and "prefix" in text
    doc = json.loads(out.read_text())
    assert doc["cluster"] and doc["replicas"] == 3 and [p["route"] for p in doc["points"]] == ["round-robin", "prefix"]
    for p in doc["points"]:
        assert {"replicas", "route", "load_imbalance", "per_replica", "pooled_hit_rate"} <= set(p)
        assert p["pooled_hit_rate"] == doc["pooled"][0]["hit_rate"] and doc["pooled"][0]["capacity_tokens"] == 300_000


@pytest.mark.parametrize("args, words", [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--mode", "timed"], "sequence mode only"),
    (["--replicas", "2", "--bound"], "does not combine"),
    (["--replicas", "2", "--balance-slack", "-1"], "--balance-slack must be >= 0"),
])
def test_replay_command_with_replicas_bad_input(args, words, capsys):
    assert cli_main(["replay", str(SAMPLE), "--limit", "5", "--no-progress", *args]) == 2
    assert words in capsys.readouterr().err


def test_replay_command_unknown_route(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["replay", str(SAMPLE), "--replicas", "2", "--route", "random"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_min_match_ignores_a_prefix_everybody_shares():
    ix = MemoryIndex()
    ix.apply("a", stored([1, 2, 3, 4]))
    reps = ["a", "b"]
    # the request shares only block 1 (a system prompt) with a: 1 of 4 blocks < 0.3 -> least decisions wins
    pol = PrefixPolicy(ix, slack=0.2, abs_slack=2, min_match=0.3)
    assert pol.choose(reps, {"a": 0, "b": 0}, [1, 7, 8, 9], 1, {"a": 1, "b": 0}) == ("b", 0, "prefix")
    assert pol.choose(reps, {"a": 0, "b": 0}, [1, 2, 8, 9], 1, {"a": 1, "b": 0}) == ("a", 2, "prefix")
    with pytest.raises(ValueError):
        PrefixPolicy(ix, min_match=2)


@pytest.mark.parametrize("args, words", [
    (["--backend", "localhost:8000"], "--backend must be URL"),
    (["--backend", "http://a:1,tcp://b:2,tcp://b:3,x"], "--backend must be URL"),
    (["--backend", "http://a:1", "--backend", "http://a:1"], "listed twice"),
    (["--backend", "http://a:1", "--index", "mongodb://x"], "--index must be 'memory' or redis://"),
    (["--backend", "http://a:1", "--balance-slack", "-1"], "must be >= 0"),
    (["--backend", "http://a:1", "--min-match", "2"], "--min-match"),
    (["--backend", "http://a:1,ipc:///tmp/ev"], "cannot derive a replay endpoint"),
    (["--backend", "http://a:1", "--index", "redis://127.0.0.1:1"], "cannot reach the Redis index"),
])
def test_router_command_bad_input(args, words, capsys):
    if "redis://" in " ".join(args):
        pytest.importorskip("redis")
    assert cli_main(["router", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv router: error:") and words in err


def test_router_command_needs_a_backend(capsys):
    try:  # exit status 2 with the reason, whether the parser or the options check says it
        rc = cli_main(["router"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and "--backend" in capsys.readouterr().err


def test_trace_workload_keeps_conversations_and_their_shared_prefixes(tmp_path):
    from pagedkv.replay.workload import trace_prompts

    lines = [json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": ids})
             for t, n, ids in [(0, 1024, [0, 1]), (5, 1536, [0, 1, 2]), (9, 700, [0, 7]), (12, 2048, [0, 1, 2, 3]),
                               (20, 1100, [0, 7, 8]), (30, 600, [0, 9])]]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    ps = trace_prompts(path, conversations=5, min_turns=2, tokens_per_id=8)
    # conversation (0, 1): 3 turns, (0, 7): 2 turns; (0, 9) has one request and is left out; arrival order kept
    assert [len(p) for p in ps] == [16, 24, 11, 32, 18]
    assert ps[1][:16] == ps[0] and ps[3][:24] == ps[1] and ps[4][:11] == ps[2]
    assert ps[0][:8] == ps[2][:8] and ps[0][8:16] != ps[2][8:16]  # the shared first block, then their own
    assert all(1000 <= t < 20000 for p in ps for t in p)
    again, times = trace_prompts(path, conversations=5, min_turns=2, tokens_per_id=8, return_times=True)
    assert again == ps and times == [0.0, 0.005, 0.009, 0.012, 0.02]
    one = trace_prompts(path, conversations=1, min_turns=2, tokens_per_id=8, seed=1)
    assert [len(p) for p in one] in ([16, 24, 32], [11, 18])
    with pytest.raises(ValueError):
        trace_prompts(path, min_turns=9)


def test_pending_prompts_steer_a_burst_before_the_events_arrive():
    from pagedkv.router.state import PendingIndex, Replica, RouterState

    st = RouterState([Replica("http://a"), Replica("http://b"), Replica("http://c")], route="prefix", block_size=4,
                     balance_abs=100)
    prompt = list(range(40))
    h = block_hashes(prompt, 4)
    first = st.choose(h, 40)
    second = st.choose(h, 40)  # no event yet, but the first request's prompt is pending there
    assert second[0] == first[0] and second[1] == 36 and second[2] == 4
    other = st.choose(block_hashes(list(range(100, 140)), 4), 40)
    assert other[0] != first[0]
    st.done(first[0], first[2], h)
    assert st.pending.index.longest_prefix(h) == {first[0]: 10}  # the second still holds it
    st.done(second[0], second[2], h)
    assert st.pending.index.longest_prefix(h) == {} and st.replicas[first[0]].inflight_tokens == 0
    p = PendingIndex()
    p.add("x", [1, 2])
    p.drop_replica("x")
    p.remove("x", [1, 2])  # after a drop: nothing to remove, no error
    assert p.index.longest_prefix([1, 2]) == {}
