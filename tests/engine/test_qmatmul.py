"""The quantized kernels (built by pagedkv.engine.cpu, called by pagedkv.engine.model.QuantLinear): weights rebuilt
bit for bit as gguf's dequantize rebuilds them, products within float32 rounding of the float64 product, every tile
shape and ISA variant, the fallbacks, and the model's decode steps through them."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from pagedkv.engine import cpu  # noqa: E402
from pagedkv.engine.cpu import build_kernels  # noqa: E402
from pagedkv.engine.model import QuantLinear  # noqa: E402
from pagedkv.engine.quant_blocks import QuantBlocks, split_blocks  # noqa: E402
from pagedkv.engine.config import ModelRunConfig

KINDS = ("Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")


def _kernels_or_skip():
    if cpu.kernels() is None:
        pytest.skip(f"quantized kernels: {cpu.kernel_status()}")


#: K-quant super-blocks: bytes per 256 weights, and where their float16 scales lie
_K_QUANTS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}


def _quantized(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, QuantBlocks]:
    """A random ``(n, k)`` matrix of ``kind`` as the dense float32 matrix gguf's dequantize gives and as the
    kernel's blocks. Q4_1 / Q5_0 / Q8_0: random rows of mixed scale quantized by gguf (a constant group among
    them). Q4_K / Q6_K (gguf-py cannot quantize them; ``k`` rounded up to a multiple of 256): random bytes, every
    bit of the packed values and sub-block scales exercised, the float16 block scales set to finite values."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[kind]
    if kind in _K_QUANTS:
        size, scale_at = _K_QUANTS[kind]
        k = -(-k // 256) * 256
        raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
        for at in scale_at:
            scales = rng.uniform(1e-3, 0.1, (n, k // 256)).astype(np.float16)
            raw[:, :, at:at + 2] = scales[..., None].view(np.uint8).reshape(n, k // 256, 2)
        raw = raw.reshape(n, -1)
    else:
        a = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3.0, (n, 1)).astype(np.float32)
        a[0, :32] = 0.25  # a constant group (Q4_1: d = 0)
        raw = quantize(a, qtype)
    dense = torch.from_numpy(dequantize(raw, qtype).astype(np.float32).reshape(n, k).copy())
    return dense, split_blocks(kind, raw)


def _bound(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|float32 result - exact| allowed: gamma_k * sum |w||x| (float32 summation in any order), per entry."""
    k = w.shape[1]
    gamma = 1.01 * (k + 2) * 2.0 ** -24 / (1 - (k + 2) * 2.0 ** -24)
    return gamma * (x.double().abs() @ w.double().abs().T) + 1e-30


@pytest.mark.parametrize("kind", KINDS)
def test_weights_are_rebuilt_exactly_as_gguf_dequantizes(kind):
    """x = e_j picks column j of the weight: every entry equals gguf's float32 dequantization bit for bit (the
    nibble order, the group of each scale and offset, the sign of Q8_0's bytes)."""
    _kernels_or_skip()
    dense, blocks = _quantized(kind, 37, 96, seed=1)
    lin = QuantLinear(dense, blocks)
    k = dense.shape[1]
    eye = torch.eye(k)
    for lo in range(0, k, 8):  # 8 rows at a time: the tiled path
        got = lin(eye[lo:lo + 8])
        assert torch.equal(got, dense[:, lo:lo + 8].T.contiguous()), (kind, lo)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 32])
def test_products_within_float32_rounding(kind, rows):
    _kernels_or_skip()
    dense, blocks = _quantized(kind, 67, 160, seed=rows)  # 67 rows: tiles of 4 / 2 and a short last tile
    lin = QuantLinear(dense, blocks)
    x = torch.randn(rows, dense.shape[1])
    got = lin(x).double()
    exact = x.double() @ dense.double().T
    assert ((got - exact).abs() <= _bound(dense, x)).all()


def test_strided_rows_and_batch_invariance():
    """Rows of x with a stride (a slice of a wider tensor) are read in place; a row's result does not depend on the
    other rows in its batch (every tile sums a row in the same order)."""
    _kernels_or_skip()
    dense, blocks = _quantized("Q4_1", 40, 64, seed=3)
    lin = QuantLinear(dense, blocks)
    wide = torch.randn(7, 100)
    x = wide[:, 10:74]
    assert x.stride(0) == 100
    batch = lin(x)
    for i in range(7):
        assert torch.equal(lin(x[i:i + 1]), batch[i:i + 1])
    assert torch.equal(lin(x.contiguous()), batch)


@pytest.mark.parametrize("arch", [("-mavx2", "-mfma"), ()], ids=["avx2", "plain-c"])
def test_other_isa_variants_agree(arch, tmp_path, monkeypatch):
    """The AVX2 and plain-C builds (for CPUs without AVX-512) give the same weights and products within rounding."""
    _kernels_or_skip()
    if arch and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("the CPU has no AVX2")
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path))
    dll = build_kernels(arch)
    assert dll.pkv_isa().decode() == ("avx2" if arch else "scalar")
    for kind in KINDS:
        dense, blocks = _quantized(kind, 21, 64, seed=5)
        lin = QuantLinear(dense, blocks)
        lin.set_kernels(dll)
        k = dense.shape[1]
        for lo in range(0, k, 8):
            assert torch.equal(lin(torch.eye(k)[lo:lo + 8]), dense[:, lo:lo + 8].T.contiguous()), (kind, lo)
        x = torch.randn(6, k)
        assert ((lin(x).double() - x.double() @ dense.double().T).abs() <= _bound(dense, x)).all()


def test_parts_of_different_kinds():
    """A fused projection whose parts have different kinds (Gemma 3: Q5_0 Q and K, a Q8_0 V): one call per run of
    one kind, each writing its columns; adjacent parts of one kind merged."""
    _kernels_or_skip()
    (qd, qb), (kd, kb), (vd, vb) = (_quantized(k, n, 64, seed=i) for i, (k, n) in
                                    enumerate((("Q5_0", 24), ("Q5_0", 8), ("Q8_0", 8))))
    dense = torch.cat([qd, kd, vd])
    lin = QuantLinear(dense, [qb, kb, vb])
    assert lin.kinds == ("Q5_0", "Q8_0") and lin.kind == "Q5_0+Q8_0"
    assert torch.equal(lin(torch.eye(64)[:7]), dense[:, :7].T.contiguous())
    x = torch.randn(3, 64)
    assert ((lin(x).double() - x.double() @ dense.double().T).abs() <= _bound(dense, x)).all()
    with pytest.raises(ValueError, match="shape"):
        QuantLinear(dense, [qb, kb])


def test_dense_fallback_and_errors():
    dense, blocks = _quantized("Q8_0", 16, 64)
    lin = QuantLinear(dense, blocks, max_rows=4)
    x = torch.randn(5, 64)  # more rows than max_rows: F.linear on the dense weight
    assert torch.equal(lin(x), torch.nn.functional.linear(x, dense))
    with pytest.raises(ValueError, match="features"):
        lin(torch.randn(1, 32))
    with pytest.raises(ValueError, match="shape"):
        QuantLinear(dense[:8], blocks)
    with pytest.raises(ValueError, match="different kinds"):
        QuantBlocks.concat([blocks, _quantized("Q4_1", 16, 64)[1]])
    with pytest.raises(ValueError, match="no kernel"):
        split_blocks("Q5_K", np.zeros((1, 176), dtype=np.uint8))


def test_disabled_by_environment(monkeypatch):
    """PAGEDKV_QKERNELS=0: no kernels, QuantLinear is the dense product (and says so)."""
    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.setenv("PAGEDKV_QKERNELS", "0")
    assert cpu.kernels() is None
    assert "disabled" in cpu.kernel_status()
    dense, blocks = _quantized("Q4_1", 8, 32)
    lin = QuantLinear(dense, blocks)
    assert not lin.uses_kernel
    x = torch.randn(1, 32)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, dense))


def test_a_failed_build_falls_back(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.delenv("PAGEDKV_QKERNELS", raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path))
    assert cpu.kernels() is None
    assert cpu.kernel_status().startswith("unavailable")
    assert "using float32 products" in caplog.text


def test_model_decode_steps_use_the_kernels_and_match_dense(engine):
    """The SmolLM2 model reads its Q4_1 blocks in few-row steps, and its hidden states match the dense model's
    within float32 rounding noise (the greedy references are checked by the other engine tests, which run on it)."""
    _kernels_or_skip()
    from pagedkv.engine.model import PagedLlama, build_attention_metadata

    paged = engine.paged
    assert paged.quant_kernels
    assert all(type(lin).__name__ == "QuantLinear" and lin.kind == "Q4_1" for lin in paged.linears[0])
    dense = PagedLlama(engine.config, engine.weights, tokenizer_metadata=engine.tokenizer_meta)
    assert not dense.quant_kernels
    bs = 16
    kv_a = paged.allocate_kv_cache(8, bs)
    kv_b = dense.allocate_kv_cache(8, bs)
    prompt = [1, 504, 3458, 282, 4077, 30, 216, 1234, 87, 5]
    n = len(prompt)
    meta = build_attention_metadata([prompt], [0], list(range(n)), [[0, 1]], block_size=bs)
    ha, hb = paged.hidden(meta, kv_a), dense.hidden(meta, kv_b)  # 10 rows: the kernels too
    step = build_attention_metadata([[42]], [n], [n], [[0, 1]], block_size=bs)
    ha1, hb1 = paged.hidden(step, kv_a), dense.hidden(step, kv_b)
    for a, b in ((ha, hb), (ha1, hb1)):
        rel = float((a - b).norm() / b.norm())
        assert 0 <= rel < 1e-5, rel
    assert not math.isnan(float(ha1.sum()))


def test_lm_head_reads_the_quantized_table_for_few_greedy_and_top_k_rows(engine):
    """SmolLM2's tied Q8_0 table: greedy and top-k steps of up to QUANT_ROWS rows take the kernel's float32 logits
    (bound 2 gamma C ||x||, checked against float64); the tokens equal those of the bf16 path and of float32 argmax;
    a plain-sampling row keeps the bf16 proposals whatever its batch (seeded draws unchanged)."""
    _kernels_or_skip()
    from pagedkv.engine.sampling import LMHead
    from pagedkv.engine.sampling import SamplingParams, sample_bounded

    head = engine.paged.head
    assert head.quantized is not None and head.quantized.kind == "Q8_0"
    plain_head = LMHead(head.weight)  # the same table, no quantized copy
    g = torch.Generator().manual_seed(11)
    h = torch.randn(3, head.weight.shape[1], generator=g) * 3
    ap = head.approx(h, proposals=False)
    assert ap.kernel == "quantized"
    exact64 = h.double() @ head.weight.double().T
    assert ((ap.values.double() - exact64).abs().amax(dim=1) <= ap.bound / 2).all()
    assert head.approx(h).kernel == "bf16"  # proposals (the default): bf16 at any row count
    assert head.approx(torch.cat([h, h]), proposals=False).kernel == "bf16"  # more rows than QUANT_ROWS

    greedy = [SamplingParams(temperature=0.0)] * 3
    topk = [SamplingParams(temperature=0.9, top_k=20, seed=5)] * 3
    for params in (greedy, topk):
        gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(3)]  # noqa: E731
        before = head.stats["quantized"]
        got = sample_bounded(head, h, params, [1, 1, 1], gens())
        assert head.stats["quantized"] == before + 1
        assert got == sample_bounded(plain_head, h, params, [1, 1, 1], gens())
    assert [t[0] for t in sample_bounded(head, h, greedy, [1] * 3, [None] * 3)] == \
        exact64.argmax(dim=1).tolist()

    before = head.stats["quantized"]
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)]
    sample_bounded(head, h[:2], mixed, [1, 1], [None, torch.Generator().manual_seed(3)])
    assert head.stats["quantized"] == before  # a plain row in the batch: the bf16 product


def test_the_switch_from_the_command_line_to_the_model(engine):
    """--no-quant-kernels / LLM(quant_kernels=False) / from_gguf(quant_kernels=False): the dense float32 products
    only, the same greedy tokens; a model loaded with the kernels is refused with quant_kernels=False."""
    import argparse

    from pagedkv.engine.gguf_loader import find_default_model
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.model import PagedLlama
    from pagedkv.engine.options import add_engine_args
    from pagedkv.engine.sampling import SamplingParams
    from pagedkv.errors import InvalidArgumentError

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).quant_kernels is True
    assert p.parse_args(["--no-quant-kernels"]).quant_kernels is False

    with pytest.raises(InvalidArgumentError, match="quant_kernels=False"):
        LLM(engine.paged, num_gpu_blocks=8, run_config=ModelRunConfig(quant_kernels=False))
    dense = PagedLlama.from_gguf(find_default_model(), quant_kernels=False)
    assert not dense.quant_kernels and dense.head.quantized is None
    fast = LLM(engine.paged, num_gpu_blocks=16)
    slow = LLM(dense, num_gpu_blocks=16, run_config=ModelRunConfig(quant_kernels=False))
    assert fast.quant_kernels is (cpu.kernels() is not None) and slow.quant_kernels is False
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = {"prompt_token_ids": [1, 504, 3458, 282, 4077, 30, 216]}
    assert fast.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == \
        slow.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids


def test_without_a_usable_home_a_private_temporary_folder_holds_the_kernels(monkeypatch, tmp_path):
    """No PAGEDKV_KERNEL_CACHE and no home to write in: the kernels go to this user's private folder in the
    temporary directory (mode 0700); such a folder writable by others is refused (another user could plant a
    library there)."""
    import os
    import stat
    import tempfile
    from pathlib import Path

    def no_home():
        raise RuntimeError("no home directory")

    monkeypatch.delenv("PAGEDKV_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    got = cpu._cache_dir()
    assert got == tmp_path / f"pagedkv-kernels-{os.getuid()}"
    assert stat.S_IMODE(got.stat().st_mode) == 0o700
    got.chmod(0o777)
    with pytest.raises(OSError, match="private"):
        cpu._cache_dir()
