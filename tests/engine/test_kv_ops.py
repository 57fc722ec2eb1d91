"""Copy-on-write and swap helpers, alone and inside a generation."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from engine_helpers import ATOL, ScrambledPager, paged_step  # noqa: E402

pytestmark = pytest.mark.engine


def _cache(num_blocks: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, num_blocks, 4, 2, 5, generator=g)  # (layers, k/v, blocks, bs, heads, dim)


def test_copy_blocks_copies_whole_blocks_in_every_layer():
    from pagedkv.engine.model import copy_blocks

    kv = _cache(6)
    before = kv.clone()
    copy_blocks(kv, np.array([[1, 4], [3, 0]], dtype=np.int64))
    assert torch.equal(kv[:, :, 4], before[:, :, 1])
    assert torch.equal(kv[:, :, 0], before[:, :, 3])
    for b in (1, 2, 3, 5):
        assert torch.equal(kv[:, :, b], before[:, :, b])
    # all sources are read before any destination is written
    kv = _cache(6)
    before = kv.clone()
    copy_blocks(kv, [(0, 1), (1, 2)])
    assert torch.equal(kv[:, :, 1], before[:, :, 0]) and torch.equal(kv[:, :, 2], before[:, :, 1])
    copy_blocks(kv, np.zeros((0, 2), dtype=np.int64))  # no pairs: no-op
    copy_blocks(kv, [])


def test_swap_blocks_between_caches_of_different_sizes():
    from pagedkv.engine.model import swap_blocks

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = _cache(8, seed=1).to(device)
    cpu = torch.zeros(3, 2, 5, 4, 2, 5)
    swap_blocks(gpu, cpu, [(7, 0), (2, 3)])
    assert torch.equal(cpu[:, :, 0], gpu[:, :, 7].cpu()) and torch.equal(cpu[:, :, 3], gpu[:, :, 2].cpu())
    assert not cpu[:, :, [1, 2, 4]].any()
    expect = gpu[:, :, [7, 2]].clone()
    gpu.zero_()
    swap_blocks(cpu, gpu, torch.tensor([[0, 5], [3, 1]]))
    assert torch.equal(gpu[:, :, 5], expect[:, :, 0]) and torch.equal(gpu[:, :, 1], expect[:, :, 1])
    with pytest.raises(ValueError):
        swap_blocks(gpu, torch.zeros(3, 2, 5, 8, 2, 5), [(0, 0)])


def test_fork_with_copy_on_write_matches_reference(engine):
    """Two sequences share a prompt's blocks; the shared partial block is copied before they diverge."""
    from pagedkv.engine.model import copy_blocks

    bs = 4
    prompt = engine.tokenizer.encode("Once upon a time, in a small village,")  # partial last block
    assert len(prompt) % bs
    kv = engine.paged.allocate_kv_cache(32, bs)
    pager = ScrambledPager(32, bs, seed=11)
    first = int(paged_step(engine, kv, pager, ["x"], [prompt])[0].argmax())
    # fork: y shares all of x's blocks
    pager.tables["y"] = list(pager.tables["x"])
    pager.lens["y"] = pager.lens["x"]
    forced = first + 1  # y continues with another token than x's greedy choice
    src, dst = pager.tables["y"][-1], pager.new_block()
    copy_blocks(kv, [(src, dst)])
    pager.tables["y"][-1] = dst
    toks = {"x": [first], "y": [forced]}
    for _ in range(4):
        out = paged_step(engine, kv, pager, ["x", "y"], [[toks["x"][-1]], [toks["y"][-1]]])
        toks["x"].append(int(out[0].argmax()))
        toks["y"].append(int(out[1].argmax()))
    assert toks["x"] == engine.reference_greedy(tuple(prompt), 5).token_ids
    assert toks["y"][1:] == engine.reference_greedy(tuple(prompt) + (forced,), 4).token_ids


def test_swap_out_and_in_continues_generation(engine):
    """Swap a sequence's blocks to a CPU cache, clobber the device cache, swap back into other blocks."""
    from pagedkv.engine.model import swap_blocks

    bs = 4
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    kv = engine.paged.allocate_kv_cache(24, bs)
    cpu_kv = engine.paged.allocate_kv_cache(10, bs, device="cpu")
    pager = ScrambledPager(24, bs, seed=5)
    out = [int(paged_step(engine, kv, pager, ["s"], [prompt])[0].argmax())]
    out.append(int(paged_step(engine, kv, pager, ["s"], [[out[-1]]])[0].argmax()))

    table = pager.tables["s"]
    cpu_ids = list(range(9, 9 - len(table), -1))
    swap_blocks(kv, cpu_kv, list(zip(table, cpu_ids)))
    kv.uniform_(-50.0, 50.0)
    new_ids = [pager.new_block() for _ in table]
    assert set(new_ids).isdisjoint(table)
    swap_blocks(cpu_kv, kv, list(zip(cpu_ids, new_ids)))
    pager.tables["s"] = new_ids

    logits = []
    for _ in range(3):
        lg = paged_step(engine, kv, pager, ["s"], [[out[-1]]])[0]
        logits.append(lg)
        out.append(int(lg.argmax()))
    ref = engine.reference_greedy(tuple(prompt), 5)
    assert out == ref.token_ids
    torch.testing.assert_close(torch.stack(logits), ref.logits[2:], atol=ATOL, rtol=1e-5)
