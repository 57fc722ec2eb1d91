"""The paged forward (slot mapping + block tables) against the contiguous reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from engine_helpers import ATOL, NULL, ScrambledPager, paged_step  # noqa: E402

pytestmark = pytest.mark.engine

N_NEW = 10


def _prompts(engine) -> list[tuple[int, ...]]:
    tok = engine.tokenizer
    return [
        tuple(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])),
        tuple(tok.encode("The quick brown fox")),
        tuple(tok.apply_chat_template([{"role": "user", "content": "Write a haiku about paged memory."}])),
    ]


def paged_generate(engine, prompts, n_new, block_size, *, chunks, window=None, num_blocks=96, seed=0, model=None):
    """Greedy-decode ``prompts`` together through the paged model.

    ``chunks[i]`` limits how many prompt tokens sequence ``i`` prefills per step (``None``: all at
    once), so prefill chunks and decode tokens share steps. With ``window``, blocks that fell out of
    every query's window are released (``NULL_BLOCK`` in the table) before each step and reused.
    Returns (generated ids per sequence, stacked logits per sequence, number of released blocks).
    """
    model = model or engine.paged
    kv = model.allocate_kv_cache(num_blocks, block_size)
    kv.uniform_(-50.0, 50.0)  # garbage everywhere: any read of an unwritten or masked slot shows up
    pager = ScrambledPager(num_blocks, block_size, seed=seed)
    pending = [list(p) for p in prompts]
    gen: list[list[int]] = [[] for _ in prompts]
    logits: list[list] = [[] for _ in prompts]
    released = 0
    seqs = list(range(len(prompts)))
    while any(len(g) < n_new for g in gen):
        active = [s for s in seqs if len(gen[s]) < n_new]
        if window is not None:
            for s in active:
                first_query = pager.lens.get(s, 0)
                for b in range(max(0, first_query - window + 1) // block_size):
                    if pager.tables[s][b] != NULL:
                        pager.release(s, b)
                        released += 1
        new_tokens = []
        for s in active:
            if pending[s]:
                n = chunks[s] or len(pending[s])
                new_tokens.append(pending[s][:n])
                del pending[s][:n]
            else:
                new_tokens.append([gen[s][-1]])
        out = paged_step(engine, kv, pager, active, new_tokens, window=window, model=model).cpu()
        assert out.shape == (len(active), engine.config.vocab_size)
        for row, s in enumerate(active):
            if not pending[s]:  # the prompt is complete: this row predicts the next token
                gen[s].append(int(out[row].argmax()))
                logits[s].append(out[row])
    return gen, [torch.stack(lg) for lg in logits], released


@pytest.mark.parametrize("block_size", [16, 4])
def test_paged_batch_matches_reference(engine, block_size):
    prompts = _prompts(engine)
    # sequence 2 is prefilled in chunks of 16 while the others already decode
    gen, logits, _ = paged_generate(engine, prompts, N_NEW, block_size, chunks=[None, None, 16])
    for i, prompt in enumerate(prompts):
        ref = engine.reference_greedy(prompt, N_NEW)
        assert gen[i] == ref.token_ids, f"sequence {i} (prompt of {len(prompt)} tokens)"
        torch.testing.assert_close(logits[i], ref.logits, atol=ATOL, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_on_cuda_matches_reference(engine):
    """The same mixed batch with weights, KV cache and metadata on the GPU."""
    from pagedkv.engine.model import PagedLlama

    model = PagedLlama(engine.config, engine.weights, device="cuda")
    prompts = _prompts(engine)
    gen, logits, _ = paged_generate(engine, prompts, N_NEW, 16, chunks=[None, None, 16], model=model)
    for i, prompt in enumerate(prompts):
        ref = engine.reference_greedy(prompt, N_NEW)
        assert gen[i] == ref.token_ids, f"sequence {i}"
        # GPU kernels sum in other orders than the CPU ones: a looser bound
        torch.testing.assert_close(logits[i], ref.logits, atol=4 * ATOL, rtol=1e-4)


def test_paged_sliding_window_matches_reference(engine):
    window, block_size = 8, 4
    prompts = [_prompts(engine)[0][:21], _prompts(engine)[1]]
    gen, logits, released = paged_generate(
        engine, prompts, N_NEW, block_size, chunks=[6, None], window=window, num_blocks=24, seed=3
    )
    assert released > 0
    for i, prompt in enumerate(prompts):
        ref = engine.reference_greedy(prompt, N_NEW, window)
        assert gen[i] == ref.token_ids, f"sequence {i}"
        torch.testing.assert_close(logits[i], ref.logits, atol=ATOL, rtol=1e-5)
    # the window matters for the long prompt: full attention gives other logits
    full = engine.reference_greedy(prompts[0], N_NEW)
    assert not torch.allclose(full.logits, logits[0], atol=1e-2)


def test_prefill_logits_for_every_position(engine):
    prompt = list(_prompts(engine)[1]) + list(_prompts(engine)[0][:9])
    kv = engine.paged.allocate_kv_cache(16, 4)
    pager = ScrambledPager(16, 4, seed=7)
    out = paged_step(engine, kv, pager, ["s"], [prompt], logits="all")
    ref = engine.reference.forward(prompt, engine.reference.new_cache(len(prompt)))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)


def test_metadata_validation(engine):
    from pagedkv.engine.model import build_attention_metadata

    with pytest.raises(ValueError, match="disagrees"):
        build_attention_metadata([[1, 2]], [0], [8, 10], [[2]], block_size=4)  # slot 10 is offset 2, not 1
    with pytest.raises(ValueError, match="columns"):
        build_attention_metadata([[1]], [4], [0], [[3]], block_size=4)  # position 4 needs a second block
    with pytest.raises(ValueError, match="negative"):
        build_attention_metadata([[1]], [0], [-1], [[0]], block_size=4)
    meta = build_attention_metadata([[5, 6, 7], [8]], [0, 5], [12, 13, 14, 5], [[3], [0, 1]], block_size=4)
    assert meta.positions.tolist() == [0, 1, 2, 5]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.context_lens.tolist() == [3, 6]
    assert meta.block_tables.tolist() == [[3, NULL], [0, 1]]
    assert meta.block_tables.dtype == torch.int32
    assert meta.logits_indices.tolist() == [2, 3]


def test_reading_a_released_block_is_an_error(engine):
    """A NULL_BLOCK entry that a query still needs must not be silently skipped."""
    from pagedkv.engine.model import build_attention_metadata

    kv = engine.paged.allocate_kv_cache(8, 4)
    # position 9 with window 8 needs keys 2..9; block 0 (keys 0..3) is released too early
    meta = build_attention_metadata([[5]], [9], [2 * 4 + 1], [[NULL, 1, 2]], block_size=4, sliding_window=8)
    with pytest.raises(RuntimeError, match="NULL_BLOCK"):
        engine.paged.forward(meta, kv)
    # with window 6 (keys 4..9) block 0 is out of every window: fine
    meta = build_attention_metadata([[5]], [9], [2 * 4 + 1], [[NULL, 1, 2]], block_size=4, sliding_window=6)
    assert engine.paged.forward(meta, kv).shape == (1, engine.config.vocab_size)
