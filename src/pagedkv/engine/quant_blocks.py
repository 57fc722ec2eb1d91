"""The file's quantized weights in the layout the kernels read (:mod:`pagedkv.engine.cpu`): split at load, once.

Each weight is rebuilt by the kernels in float32 bit for bit as ``gguf.quants.dequantize`` rebuilds it (Q4_1:
``d * q + m``, Q5_0: ``d * (q - 16)``, Q8_0: ``d * q``; Q4_K read as Q4_1 and Q6_K as int8 with a scale per 16,
their sub-block scales folded in; ``d * q`` of a float16 scale is exact in float32). O(quantized bytes) per file.

Layout of one group of 32 weights in a Q4_1 row (the kernel reads 16 bytes of values, a scale and an offset)::

    qs:  byte j = q[j] | q[j + 16] << 4        (j = 0..15)       d, m: float32, one each per group
    w[j] = d * q[j] + m                        x[32 g .. 32 g + 31] float32, one fused multiply-add each
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["QUANT_KINDS", "QuantBlocks", "load_blocks", "split_blocks"]

#: GGUF quantization types the kernels read (names of ``gguf.GGMLQuantizationType``); Q4_K is read in Q4_1's
#: layout and Q6_K in "Q8_16"'s (int8 values, a scale per 16), both rebuilt exactly (``_qkernels.c``)
QUANT_KINDS = ("Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
_BLOCK_BYTES = {"Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}


class QuantBlocks(NamedTuple):
    """One weight matrix ``(N, K)`` in a kernel's layout (module ``_qkernels.c``; ``kind`` names the layout:
    ``"Q4_1"``, ``"Q5_0"``, ``"Q8_0"``, ``"Q8_16"``): ``qs`` uint8 ``(N, K // 2)`` (Q4_1, Q5_0: two 4-bit values a
    byte) or int8 ``(N, K)`` (Q8_0, Q8_16), ``d`` float32 ``(N, K // 32)`` (the scales; ``(N, K // 16)`` for
    Q8_16), ``aux`` ``(N, K // 32)``: Q4_1's offsets ``m`` (float32), Q5_0's fifth bits (uint32), ``None`` for
    the others."""

    kind: str
    qs: np.ndarray
    d: np.ndarray
    aux: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        n = self.qs.shape[0]
        return n, self.d.shape[1] * (16 if self.kind == "Q8_16" else 32)

    def take_rows(self, convert: Any) -> QuantBlocks:
        """The same blocks with ``convert`` (a row permutation such as ``unpermute_qk``) applied to every part."""
        return QuantBlocks(self.kind, convert(self.qs), convert(self.d),
                           None if self.aux is None else convert(self.aux))

    @staticmethod
    def concat(parts: list[QuantBlocks]) -> QuantBlocks:
        """The blocks of several matrices of one kind stacked along the output rows (a fused projection)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack blocks of different kinds {sorted(kinds)}")
        cat = lambda xs: np.ascontiguousarray(np.concatenate(xs, axis=0))  # noqa: E731
        aux = None if parts[0].aux is None else cat([p.aux for p in parts])
        return QuantBlocks(parts[0].kind, cat([p.qs for p in parts]), cat([p.d for p in parts]), aux)


def split_blocks(kind: str, raw: np.ndarray) -> QuantBlocks:
    """A GGUF tensor's raw blocks (``uint8 (N, K / 32 * block bytes)``, as ``gguf.ReaderTensor.data`` holds them)
    split into the kernel's layout. ``ValueError`` for another kind."""
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"no kernel for {kind}; supported: {', '.join(QUANT_KINDS)}")
    raw = np.asarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, _BLOCK_BYTES[kind])
    part = lambda lo, hi: np.ascontiguousarray(blocks[:, :, lo:hi])  # noqa: E731
    d = part(0, 2).view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        return QuantBlocks(kind, part(4, 20).reshape(n, -1), d, part(2, 4).view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q5_0":
        return QuantBlocks(kind, part(6, 22).reshape(n, -1), d, part(2, 6).view("<u4")[..., 0].astype(np.uint32))
    if kind == "Q8_0":
        return QuantBlocks(kind, part(2, 34).view(np.int8).reshape(n, -1), d, None)
    if kind == "Q4_K":
        return _q4k_as_q41(blocks)
    return _q6k_as_q816(blocks)


def _q4k_as_q41(blocks: np.ndarray) -> QuantBlocks:
    """Q4_K super-blocks ``(N, nb, 144)`` in Q4_1's layout: per 32 weights, ``d = d_block * scale`` and
    ``m = -(dmin_block * min)`` (float32, exact: 11 x 6 significant bits), the 4-bit values repacked (Q4_K keeps
    sub-blocks 2c and 2c + 1 in the low and high nibbles of the same 32 bytes; Q4_1 keeps values j and j + 16 of
    one sub-block in one byte). ``d * q + m`` is then gguf's ``d * q - dm`` bit for bit."""
    from gguf.quants import Q4_K

    n, nb = blocks.shape[:2]
    f16 = lambda lo: np.ascontiguousarray(blocks[:, :, lo:lo + 2]).view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, :, 4:16]).reshape(n * nb, 12))
    d = (f16(0)[..., None] * sc.reshape(n, nb, 8).astype(np.float32)).reshape(n, nb * 8)
    m = -(f16(2)[..., None] * mn.reshape(n, nb, 8).astype(np.float32)).reshape(n, nb * 8)
    qs = blocks[:, :, 16:144].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & np.uint8(15)).reshape(n, nb * 8, 32)
    packed = (q[..., :16] | (q[..., 16:] << np.uint8(4))).reshape(n, -1)
    return QuantBlocks("Q4_1", np.ascontiguousarray(packed), np.ascontiguousarray(d), np.ascontiguousarray(m))


def _q6k_as_q816(blocks: np.ndarray) -> QuantBlocks:
    """Q6_K super-blocks ``(N, nb, 210)`` as int8 values with a float32 scale per 16 (``d_block * scale``, exact:
    11 x 8 significant bits). The values are decoded by gguf's own dequantize with the scales set to 1 (exact
    small integers), so their interleaved layout is gguf's, not re-derived here; ``d * q`` is then gguf's product,
    its one rounding included."""
    from gguf.quants import Q6_K

    n, nb = blocks.shape[:2]
    unit = np.array(blocks, dtype=np.uint8, copy=True)
    unit[:, :, 192:208] = 1  # int8 scales of 1
    unit[:, :, 208:210] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)  # d = 1.0
    q = Q6_K.dequantize_blocks(unit.reshape(n * nb, 210)).astype(np.int8).reshape(n, nb * 256)
    d_block = np.ascontiguousarray(blocks[:, :, 208:210]).view(np.float16)[..., 0].astype(np.float32)
    scales = np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).astype(np.float32)
    d = (d_block[..., None] * scales).reshape(n, nb * 16)
    return QuantBlocks("Q8_16", np.ascontiguousarray(q), np.ascontiguousarray(d), None)


def load_blocks(path: Any, convert: Any = None) -> dict[str, QuantBlocks]:
    """The tensors of a GGUF file (a path or an open ``gguf.GGUFReader``) whose type a kernel reads
    (:data:`QUANT_KINDS`), in the kernel's layout, keyed by name; ``convert(name, array)`` (a row permutation, e.g.
    ``gguf_loader.llama_row_convert(config)``) applied to each part. Reads the memory-mapped blocks only:
    O(quantized bytes)."""
    from .gguf_loader import open_gguf

    reader = path if hasattr(path, "tensors") else open_gguf(path)
    out: dict[str, QuantBlocks] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in _BLOCK_BYTES and len(t.shape) == 2 and int(t.shape[0]) % 32 == 0:
            b = split_blocks(kind, t.data)
            out[t.name] = b if convert is None else b.take_rows(lambda a, n=t.name: convert(n, a))
    return out

