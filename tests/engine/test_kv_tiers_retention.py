"""Issue 34 item 1 through the engine (SmolLM2): a disk tier far smaller than the traffic keeps what prefixes
need across a restart. Two different prompts A then B, a tier holding 14 blocks of their 22: before, plain LRU
kept B and A's *tail* (A hit nothing after the restart); now A keeps its first blocks and hits them, B hits all
of its blocks, and no stored block lies past a missing one. Greedy output equal to the reference."""

from __future__ import annotations

import pytest

import pagedkv

pytestmark = pytest.mark.engine

BS = 4
N_NEW = 5
A = list(range(200, 241))  # 41 tokens: 10 full prompt blocks + 1 filled by decoding (44 tokens fed)
B = list(range(300, 341))


def make(engine, **kw):
    from pagedkv.engine.config import engine_configs
    from pagedkv.engine.llm import LLM

    return LLM(engine.paged, block_size=BS, max_num_seqs=4, num_gpu_blocks=96, **engine_configs(**kw))


def gen(llm, prompt):
    from pagedkv.engine.sampling import SamplingParams

    (o,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=N_NEW,
                                                                      ignore_eos=True), use_tqdm=False)
    return o


def test_a_small_disk_tier_keeps_both_prompts_heads_across_a_restart(engine, tmp_path):
    from pagedkv.engine.kv_io import payload_bytes
    from pagedkv.tiers import codec

    with make(engine) as probe:
        vb = payload_bytes(probe.kv_cache) + codec.OVERHEAD_BYTES
    gib = (14 * vb + 0.5) / 2**30  # 14 blocks
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=gib) as a:
        for p in (A, B):  # one after the other, each stored before the next (as the two requests)
            gen(a, p)
            a.kv_tiers.connector.flush(30)
        per_prompt = a.kv_tiers.stats["stored_blocks"] // 2
        assert per_prompt == (len(A) + N_NEW - 1) // BS == 11
    # the restart (a fresh GPU pool), loads only: what A computes again must not evict B before B is asked
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=gib, kv_store="off") as b:
        oa = gen(b, A)
        assert list(oa.outputs[0].token_ids) == list(engine.reference_greedy(tuple(A), N_NEW).token_ids)
        # A keeps its head: 14 - 11 blocks (plain LRU kept its last 3 blocks, useless: 0 tokens)
        assert oa.num_cached_tokens == BS * (14 - per_prompt)
    with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=gib, kv_store="off") as c:
        ob = gen(c, B)
        assert list(ob.outputs[0].token_ids) == list(engine.reference_greedy(tuple(B), N_NEW).token_ids)
        assert ob.num_cached_tokens == BS * ((len(B) - 1) // BS)
        disk = c.kv_tiers.connector.stores()[0]
        for p in (A, B):  # no block kept past a missing one
            ks = pagedkv.block_hashes(p, BS)
            held = disk.contains_many(ks)
            n = disk.prefix_length(ks)
            assert n > 0 and not any(held[n:])


def test_generate_reports_the_cached_prompt_tokens(engine, tmp_path):
    # issue 34: `pagedkv generate` said nothing of the cache; now one stderr line (pagedkv.cli._cache_line)
    from pagedkv.cli import _cache_counts, _cache_line
    from pagedkv.engine.sampling import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    lines = []
    for _ in range(2):  # two runs of the command over one disk tier: the second loads the prompt's blocks
        with make(engine, kv_disk_dir=tmp_path, kv_disk_gib=0.05) as llm:
            before = _cache_counts(llm)
            "".join(llm.stream({"prompt_token_ids": A}, sp))
            lines.append(_cache_line(llm, before))
            llm.kv_tiers.connector.flush(30)
    assert lines[0] == f"pagedkv: 0 of {len(A)} prompt tokens from cache (0 loaded from the KV tiers)"
    n = BS * ((len(A) - 1) // BS)
    assert lines[1] == f"pagedkv: {n} of {len(A)} prompt tokens from cache ({n} loaded from the KV tiers)"
