"""Engine equality under the CPU tier + swap preemption + a small pool: swaps, tier demotions and promotions
happen in the same steps, the engine executes each step's copy plan in order, and greedy output still equals
the HF reference (tests/data/smollm2_greedy.json) token for token."""

from __future__ import annotations

import pytest
from pagedkv.engine.config import CacheConfig, SchedulerConfig

pytestmark = pytest.mark.engine


def test_greedy_equals_hf_with_cpu_tier_swap_and_a_small_pool(engine, reference_case):
    from pagedkv import CopyKind
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling import SamplingParams

    prompt, gen = reference_case["prompt_ids"], reference_case["gen_ids"]
    # the reference prompt continued by k reference tokens: greedy goes on with gen[k:]; prefixes are shared
    cases = [(0, 24), (8, 16), (4, 20), (0, 12), (12, 14), (8, 12), (0, 20), (16, 10), (4, 12), (12, 8)]
    # (18 blocks: since a swapped-out copy comes back as the block caching its content (issue 23 item 1), 20 gave
    # no step with both a swap and a tier copy; 18 gives one, 376 swapped blocks, 2 demotions)
    llm = LLM(engine.paged, block_size=4, num_gpu_blocks=18, max_num_seqs=4,
              cache_config=CacheConfig(num_cpu_blocks=96, cpu_prefix_cache=True),
              scheduler_config=SchedulerConfig(preemption_mode="swap"))
    plans = []
    schedule = llm.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        plans.append(plan)
        return plan

    llm.scheduler.schedule = recording_schedule
    reqs = [({"prompt_token_ids": prompt + gen[:k]}, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
            for k, m in cases]
    outs = llm.generate([r for r, _ in reqs], [p for _, p in reqs], use_tqdm=False)
    for (k, m), out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == gen[k : k + m], (k, m)
    llm.block_manager.check_invariants()

    swaps = demotions = promotions = both = 0
    for p in plans:
        c = p.copies
        n_out, n_in = len(p.swap_out), len(p.swap_in)
        dem = int((c.kind == CopyKind.GPU_TO_CPU).sum()) - n_out
        pro = int((c.kind == CopyKind.CPU_TO_GPU).sum()) - n_in
        swaps += n_out + n_in
        demotions += dem
        promotions += pro
        both += (n_out + n_in) > 0 and (dem + pro) > 0
    st = llm.block_manager.stats
    print(f"steps {len(plans)}: swapped blocks {swaps}, demotions {demotions}, promotions {promotions}, "
          f"steps with a swap and a tier copy {both}; cpu hit tokens {st.cpu_hit_tokens}")
    assert demotions == st.demotions and promotions == st.promotions
    # (promotions: since held copies inherit a cached content at eviction (issue 23 item 1), every prefix this
    # workload asks for again is still on the GPU: 0 promotions at 16-26 blocks, where 20 gave 2 before; the CPU
    # tier's promotions through the engine need a new workload, see the findab branch's report)
    assert swaps > 0 and demotions > 0 and both > 0
