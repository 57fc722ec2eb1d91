"""The ragged paged attention (issue 36): every mode of ``plan_paged_attention`` against a straightforward masked
attention on random data (random block tables, mixed query lengths and contexts, sliding windows, grouped queries,
float32), the C kernel's variants, the bucketing and the NULL_BLOCK checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.engine import paged_attention as pa  # noqa: E402
from pagedkv.engine.model import NULL_BLOCK, build_attention_metadata  # noqa: E402

MODES = pa.ATTENTION_MODES


def _kernel_or_skip():
    if pa._kernel() is None:
        from pagedkv.engine import cpu

        pytest.skip(f"kernels: {cpu.kernel_status()}")


def dense(q, k, v, positions, window, scale):
    """Softmax attention of the queries at ``positions`` over keys 0..len(k)-1, causal (+ window), float64."""
    n_head, n_kv = q.shape[1], k.shape[1]
    kh = k.double().repeat_interleave(n_head // n_kv, dim=1)
    vh = v.double().repeat_interleave(n_head // n_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kh) * scale
    kp = torch.arange(k.shape[0])
    pos = torch.as_tensor(positions)
    allowed = kp[None, :] <= pos[:, None]
    if window is not None:
        allowed &= kp[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vh).reshape(len(positions), -1)


def random_step(seed, q_lens, ctx, *, n_head, n_kv, d, bs, window=None, extra_blocks=7):
    """One step over a cache with shuffled block ids; the cached keys written beforehand, the new ones passed.
    Blocks wholly outside every query's window are NULL in the table (as a sliding window releases them)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    need = [-(-c // bs) for c in ctx]
    num_blocks = sum(need) + extra_blocks
    ids = rng.permutation(num_blocks)
    tables, at = [], 0
    for b, n in enumerate(need):
        t = [int(x) for x in ids[at:at + n]]
        at += n
        if window is not None:
            first_key = max(0, ctx[b] - q_lens[b] - window + 1)
            t[: first_key // bs] = [NULL_BLOCK] * (first_key // bs)
        tables.append(t)
    cache = torch.randn(2, num_blocks, bs, n_kv, d, generator=g)  # stale data everywhere not written
    keys = [torch.randn(c, n_kv, d, generator=g) for c in ctx]
    vals = [torch.randn(c, n_kv, d, generator=g) for c in ctx]
    for t, kk, vv, c, ql in zip(tables, keys, vals, ctx, q_lens):
        for p in range(c - ql):
            if t[p // bs] != NULL_BLOCK:
                cache[0, t[p // bs], p % bs], cache[1, t[p // bs], p % bs] = kk[p], vv[p]
    slots = [t[p // bs] * bs + p % bs for t, c, ql in zip(tables, ctx, q_lens) for p in range(c - ql, c)]
    meta = build_attention_metadata([[1] * ql for ql in q_lens], [c - ql for c, ql in zip(ctx, q_lens)], slots,
                                    tables, block_size=bs, sliding_window=window)
    qkv = torch.randn(sum(q_lens), n_head + 2 * n_kv, d, generator=g)  # a fused projection's view, as models pass
    q = qkv[:, :n_head]
    new = [slice(c - ql, c) for c, ql in zip(ctx, q_lens)]
    k = torch.cat([kk[s] for kk, s in zip(keys, new)])
    v = torch.cat([vv[s] for vv, s in zip(vals, new)])
    want = torch.cat([dense(q[s:s + ql], kk, vv, list(range(c - ql, c)), window, 1 / math.sqrt(d))
                      for s, kk, vv, c, ql in zip(np.cumsum([0, *q_lens]), keys, vals, ctx, q_lens)])
    return meta, q, k, v, cache, want


CASES = [  # (q_lens, contexts): decodes at mixed contexts, chunks after cached tokens, a fresh prompt, prefix hits
    ([1, 1, 1, 1, 1], [3000, 100, 97, 130, 5]),
    ([1] * 8, [40, 41, 300, 1, 17, 16, 700, 33]),
    ([1, 6, 1, 9, 9, 1], [50, 6, 900, 40, 300, 2]),
    ([3, 3, 12, 1], [3, 80, 500, 64]),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [None, 7, 64])
@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (4, 1, 256, 16), (4, 1, 32, 4), (2, 2, 8, 8)])  # heads, kv, d, bs
@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_mode_matches_masked_attention(mode, window, shape, case):
    n_head, n_kv, d, bs = shape
    q_lens, ctx = CASES[case]
    meta, q, k, v, cache, want = random_step(case, q_lens, ctx, n_head=n_head, n_kv=n_kv, d=d, bs=bs, window=window)
    plan = pa.plan_paged_attention(meta, bs, mode=mode)
    out = pa.paged_attention(q, k, v, cache, plan, scale=1 / math.sqrt(d), workspace=pa.AttentionWorkspace())
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_ragged_plan_sends_decodes_and_short_queries_to_the_kernel_and_long_chunks_to_sdpa():
    _kernel_or_skip()
    assert pa.KERNEL_MAX_QUERY_LEN == 4
    q_lens, ctx = [1, 1, 40, 1, 5, 3, 7], [3000, 100, 600, 9, 5, 50, 60]  # sequence 4 is a fresh prompt
    meta = random_step(0, q_lens, ctx, n_head=4, n_kv=2, d=8, bs=16)[0]
    plan = pa.plan_paged_attention(meta, 16, mode="ragged")
    assert plan.ragged.seqs.tolist() == [[0, 0, 1, 3000], [1, 1, 1, 100], [3, 42, 1, 9], [5, 48, 3, 50]]
    assert sorted((g.q_len, g.num_seqs, g.fresh) for g in plan.groups) == [(5, 1, True), (7, 1, False),
                                                                          (40, 1, False)]


def test_buckets_keep_a_long_sequence_apart_and_equal_contexts_together():
    # one 3k decode among short ones: the short ones are no longer gathered up to 3,000 keys
    meta = random_step(1, [1] * 5, [3000, 100, 97, 130, 5], n_head=4, n_kv=2, d=8, bs=16)[0]
    plan = pa.plan_paged_attention(meta, 16, mode="bucketed")
    assert sorted((g.num_seqs, g.num_keys) for g in plan.groups) == [(1, 3000), (4, 9 * 16)]
    padded = pa.plan_paged_attention(meta, 16, mode="padded")
    assert [(g.num_seqs, g.num_keys) for g in padded.groups] == [(5, 188 * 16)]
    # equal contexts: one group, no mask, exactly the context (as before)
    meta = random_step(2, [1] * 4, [300] * 4, n_head=4, n_kv=2, d=8, bs=16)[0]
    (g,) = pa.plan_paged_attention(meta, 16, mode="bucketed").groups
    assert (g.num_seqs, g.num_keys, g.mask, g.token_idx) == (4, 300, None, None)


@pytest.mark.parametrize("arch", [("-mavx2", "-mfma"), ()], ids=["avx2", "plain"])
def test_kernel_variants_match(arch, monkeypatch):
    from pagedkv.engine import cpu

    _kernel_or_skip()
    if arch and "avx2" not in cpu._cpu_tag():
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setattr(pa, "_KERNEL", [pa.bind_kernel(cpu.build_kernels(arch))])
    meta, q, k, v, cache, want = random_step(3, [1, 4, 1], [700, 30, 2], n_head=9, n_kv=3, d=64, bs=16, window=100)
    plan = pa.plan_paged_attention(meta, 16, mode="ragged")
    assert plan.ragged is not None
    out = pa.paged_attention(q, k, v, cache, plan, scale=1 / 8)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_a_cache_the_kernel_cannot_read_falls_back_to_sdpa():
    _kernel_or_skip()
    meta, q, k, v, cache, want = random_step(4, [1, 1, 2], [500, 20, 40], n_head=4, n_kv=2, d=8, bs=8)
    plan = pa.plan_paged_attention(meta, 8, mode="ragged")
    assert plan.ragged is not None
    wide = torch.zeros(2, cache.shape[1], 8, 2, 16)  # a layer that is a non-contiguous view
    wide[..., :8] = cache
    out = pa.paged_attention(q, k, v, wide[..., :8], plan, scale=1 / math.sqrt(8))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    out = pa.paged_attention(q.double(), k.double(), v.double(), cache.double(), plan, scale=1 / math.sqrt(8))
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("mode", MODES)
def test_a_released_block_inside_a_window_is_an_error_in_every_mode(mode):
    # a decode at position 99 with window 40 reads keys 60..99: blocks 3.. of 16; block 3 released is an error
    table = list(range(7))
    meta = build_attention_metadata([[1]], [99], [6 * 16 + 3], [[NULL_BLOCK] * 3 + table[3:]], block_size=16,
                                    sliding_window=40)
    pa.plan_paged_attention(meta, 16, mode=mode)
    meta = build_attention_metadata([[1]], [99], [6 * 16 + 3], [[NULL_BLOCK] * 4 + table[4:]], block_size=16,
                                    sliding_window=40)
    with pytest.raises(RuntimeError, match="NULL_BLOCK"):
        pa.plan_paged_attention(meta, 16, mode=mode)


def test_kernel_reports_out_of_range_block_ids():
    _kernel_or_skip()
    meta = build_attention_metadata([[1]], [20], [1 * 16 + 4], [[50, 1]], block_size=16, validate=False)
    plan = pa.plan_paged_attention(meta, 16, mode="ragged")
    cache = torch.zeros(2, 4, 16, 1, 8)
    with pytest.raises(RuntimeError, match="out-of-range"):
        pa.paged_attention(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), cache, plan, scale=1.0)


def test_mode_switch():
    prev = pa.set_attention_mode("padded")
    try:
        assert pa.attention_mode() == "padded"
        meta = build_attention_metadata([[1], [1]], [10, 2], [10, 16 + 2], [[0], [1]], block_size=16)
        assert pa.plan_paged_attention(meta, 16).mode == "padded"
        with pytest.raises(ValueError, match="attention mode"):
            pa.set_attention_mode("fast")
        assert pa.attention_mode() == "padded"
    finally:
        pa.set_attention_mode(prev)
