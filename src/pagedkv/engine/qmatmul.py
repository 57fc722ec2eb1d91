"""Products with the file's quantized weights for the few-row steps (decode), exact to the float32 model.

Why: at batch 1 a decode step reads every weight once, and the float32 weights of SmolLM2-135M are 428 MB per
token (31.7 ms of a 45.7 ms step on one thread, measured); the file's Q4_1 blocks are 0.625 bytes per weight
instead of 4. llama.cpp reads them as they are, but rounds the activations to 8 bits first, so its products are
not those of the float32 model. Here the activations stay float32 and each weight is rebuilt in float32 on the
fly, bit for bit as ``gguf.quants.dequantize`` rebuilds it (Q4_1: ``d * q + m``, Q5_0: ``d * (q - 16)``, Q8_0:
``d * q``; Q4_K read as Q4_1 and Q6_K as int8 with a scale per 16, their sub-block scales folded in; ``d * q`` of a
float16 scale is exact in float32): the result is the product with the dequantized float32 matrix, up to the
float32 summation order (which any GEMM already chooses freely). Greedy tokens stay those of the reference.

The kernels (``_qkernels.c``, AVX-512 / AVX2 / plain C by what the CPU has) are compiled once per machine with
the system's C compiler (``cc -O3 -march=native -ffp-contract=off -fopenmp``) into ``~/.cache/pagedkv/kernels``
(``PAGEDKV_KERNEL_CACHE`` overrides; a home that cannot be written: a private folder in the temporary directory)
and loaded with ctypes. No compiler, a failed build or
``PAGEDKV_QKERNELS=0``: :func:`kernels` returns ``None`` and every product is the dense float32 one.

:class:`QuantLinear` keeps both forms of one weight: the quantized blocks for steps of up to ``max_rows`` rows
(decode of a few sequences, where reading the weights dominates) and the dense float32 matrix for the rest
(prefill, large batches: compute-bound, where the BLAS kernel wins). Cost: the quantized copy, 1/6.4 (Q4_1) to
1/3.8 (Q8_0) of the float32 one. :func:`make_linear` picks it or :class:`DenseLinear` for a model's projection,
:func:`head_linear` for the LM head (few greedy / top-k rows, :class:`pagedkv.engine.lm_head.LMHead`).

Layout of one group of 32 weights in a Q4_1 row (the kernel reads 16 bytes of values, a scale and an offset)::

    qs:  byte j = q[j] | q[j + 16] << 4        (j = 0..15)       d, m: float32, one each per group
    w[j] = d * q[j] + m                        x[32 g .. 32 g + 31] float32, one fused multiply-add each
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["QUANT_KINDS", "DenseLinear", "QuantBlocks", "QuantLinear", "build_kernels", "kernel_status", "kernels",
           "head_linear", "load_blocks", "make_linear", "split_blocks"]

log = logging.getLogger(__name__)

#: GGUF quantization types the kernels read (names of ``gguf.GGMLQuantizationType``); Q4_K is read in Q4_1's
#: layout and Q6_K in "Q8_16"'s (int8 values, a scale per 16), both rebuilt exactly (``_qkernels.c``)
QUANT_KINDS = ("Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
_BLOCK_BYTES = {"Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
_NATIVE = ("-march=native",)
_ENTRY = {"Q4_1": "pkv_q4_1_mm", "Q5_0": "pkv_q5_0_mm", "Q8_0": "pkv_q8_0_mm", "Q8_16": "pkv_q8_16_mm"}


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


# --------------------------------------------------------------------------------------------------- the build

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _cache_dir() -> Path:
    """Where compiled kernels live: ``PAGEDKV_KERNEL_CACHE`` when set, else ``~/.cache/pagedkv/kernels``, else (a
    home that cannot be written) a private folder of this user in the temporary directory. ``OSError`` when none
    can be used."""
    env = os.environ.get("PAGEDKV_KERNEL_CACHE")
    if env:
        Path(env).mkdir(parents=True, exist_ok=True)
        return Path(env)
    try:
        home = Path.home() / ".cache" / "pagedkv" / "kernels"
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except (OSError, RuntimeError):  # (RuntimeError: no home directory)
        pass
    uid = os.getuid() if hasattr(os, "getuid") else 0
    tmp = Path(tempfile.gettempdir()) / f"pagedkv-kernels-{uid}"
    tmp.mkdir(mode=0o700, exist_ok=True)
    st = tmp.stat()
    if getattr(st, "st_uid", uid) != uid or st.st_mode & 0o022:  # another user's, or writable by others
        raise OSError(f"{tmp} is not a private folder of this user")
    return tmp


def build_kernels(arch: tuple[str, ...] = _NATIVE) -> ctypes.CDLL:
    """Compile (once; cached by source, compiler, flags and CPU) and load the kernels for the target ``arch``
    (compiler flags; default ``-march=native``; ``("-mavx2", "-mfma")`` or ``()`` for the AVX2 and plain-C
    variants, which the tests check too). ``RuntimeError`` when there is no compiler or it fails."""
    src = resources.files("pagedkv.engine").joinpath("_qkernels.c").read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = [*_FLAGS, *arch]
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode() + _cpu_tag().encode()).hexdigest()[:16]
    cache = _cache_dir()
    lib = cache / f"qkernels-{key}.so"
    if not lib.is_file():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            c_file = Path(tmp) / "_qkernels.c"
            c_file.write_bytes(src)
            out = Path(tmp) / lib.name
            r = subprocess.run([cc, *flags, str(c_file), "-o", str(out)], capture_output=True, text=True,
                               timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
            os.replace(out, lib)  # atomic: concurrent builders each install a complete file
    dll = ctypes.CDLL(str(lib))
    vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in _ENTRY.values():  # one signature: (x, B, ldx, K, qs, d, aux, n0, n1, y, ldy, threads)
        fn = getattr(dll, name)
        fn.argtypes = [vp, i64, i64, i64, vp, vp, vp, i64, i64, vp, i64, ci]
        fn.restype = None
    dll.pkv_isa.restype = ctypes.c_char_p
    return dll


def kernels() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use (a second or two); ``None`` when disabled
    (``PAGEDKV_QKERNELS=0``) or the build failed (:func:`kernel_status` says why; logged once)."""
    if "dll" not in _state:
        with _lock:
            if "dll" not in _state:
                if os.environ.get("PAGEDKV_QKERNELS", "1") == "0":
                    _state["dll"], _state["why"] = None, "disabled by PAGEDKV_QKERNELS=0"
                else:
                    try:
                        dll = build_kernels()
                        _state["dll"], _state["why"] = dll, f"built ({dll.pkv_isa().decode()})"
                    except Exception as e:  # noqa: BLE001 - any failure falls back to the dense products
                        _state["dll"], _state["why"] = None, f"unavailable: {e}"
                        log.warning("pagedkv: quantized kernels %s; using float32 products", _state["why"])
    return _state["dll"]


def kernel_status() -> str:
    """Whether the kernels are in use, and why not: ``"built (avx512)"``, ``"disabled by ..."``, ``"unavailable:
    ..."``."""
    kernels()
    return _state["why"]


# --------------------------------------------------------------------------------------------------- the linear


class QuantLinear:
    """``y = x @ W.T`` for a weight held both dense (float32 ``(N, K)``) and quantized: one :class:`QuantBlocks`, or
    several stacked along the output rows (a fused projection whose parts have different kinds, e.g. Gemma 3's
    Q5_0 Q/K with a Q8_0 V; adjacent parts of one kind are merged).

    ``x`` of up to ``max_rows`` rows (float32, on the CPU) goes through the quantized kernels (one call per part,
    each writing its columns of ``y``) on ``torch.get_num_threads()`` threads; anything else through ``F.linear``
    on the dense weight. Both give the product with the same float32 matrix (summation order aside).
    O(rows x N x K). ``ValueError`` when the shapes differ or ``x`` has another number of features."""

    __slots__ = ("weight", "kinds", "max_rows", "_parts", "_n", "_k", "_on")

    #: rows up to which the kernels are used (measured, benchmarks/qmatmul_ab.py: at 32 rows they still beat MKL on
    #: SmolLM2's products, one thread, by 0.75x; at 48 the dense product is ahead)
    DEFAULT_MAX_ROWS = 32

    def __init__(self, weight: torch.Tensor, blocks: QuantBlocks | list[QuantBlocks], *,
                 max_rows: int | None = None) -> None:
        parts = [blocks] if isinstance(blocks, QuantBlocks) else list(blocks)
        merged: list[QuantBlocks] = []
        for b in parts:  # adjacent parts of one kind: one call
            if merged and merged[-1].kind == b.kind:
                merged[-1] = QuantBlocks.concat([merged[-1], b])
            else:
                merged.append(b)
        ks = {b.shape[1] for b in merged}
        n = sum(b.shape[0] for b in merged)
        if len(ks) != 1 or (n, ks.pop()) != tuple(weight.shape):
            raise ValueError(f"weight {tuple(weight.shape)} and blocks {[b.shape for b in parts]} differ in shape")
        self.weight = weight
        self.kinds = tuple(b.kind for b in merged)
        self.max_rows = self.DEFAULT_MAX_ROWS if max_rows is None else max_rows
        self._n, self._k = tuple(weight.shape)
        dll = kernels() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None
        self._on = dll is not None
        t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        row = 0
        self._parts = []
        for b in merged:  # (kernel, qs, d, aux, first output row, rows)
            self._parts.append((None if dll is None else getattr(dll, _ENTRY[b.kind]), t(b.qs), t(b.d), t(b.aux),
                                row, b.shape[0]))
            row += b.shape[0]

    @property
    def kind(self) -> str:
        """The quantization type of the blocks (``"Q4_1+Q8_0"`` for parts of several)."""
        return "+".join(self.kinds)

    @property
    def uses_kernel(self) -> bool:
        """Whether few-row products go through the quantized kernels (built, CPU, float32)."""
        return self._on

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized copy."""
        return sum(a.numel() * a.element_size() for p in self._parts for a in p[1:4] if a is not None)

    def set_kernels(self, dll: ctypes.CDLL) -> None:
        """Use the kernels of ``dll`` (a :func:`build_kernels` variant; for tests)."""
        self._parts = [(getattr(dll, _ENTRY[k]), *p[1:]) for k, p in zip(self.kinds, self._parts)]
        self._on = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else -1
        if x.shape[-1] != self._k:
            raise ValueError(f"input has {x.shape[-1]} features, the weight {self._k}")
        if not self._on or not 0 < rows <= self.max_rows or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight)
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty((rows, self._n), dtype=torch.float32)
        xp, ldx, yp, nt = x.data_ptr(), x.stride(0), y.data_ptr(), torch.get_num_threads()
        for fn, qs, d, aux, row, n in self._parts:
            fn(xp, rows, ldx, self._k, qs.data_ptr(), d.data_ptr(), None if aux is None else aux.data_ptr(),
               0, n, yp + 4 * row, self._n, nt)
        return y


class DenseLinear:
    """``F.linear`` with a fixed weight: the product of a weight without quantized blocks."""

    __slots__ = ("weight",)
    uses_kernel = False

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def make_linear(weight: torch.Tensor, names: list[str], quantized: dict[str, QuantBlocks] | None) -> Any:
    """The product with ``weight`` (the matrices ``names`` of a GGUF file stacked along the rows): a
    :class:`QuantLinear` when every part has blocks a kernel reads and the weight is float32 on the CPU, else a
    :class:`DenseLinear`."""
    parts = [quantized.get(n) for n in names] if quantized else [None]
    if any(p is None for p in parts) or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return DenseLinear(weight)
    return QuantLinear(weight, parts)


def head_linear(weight: torch.Tensor, quantized: dict[str, QuantBlocks] | None, *, max_rows: int) -> Any:
    """The LM head's quantized product (``output.weight``'s blocks, or ``token_embd.weight``'s when the file ties
    the output to the embedding), or ``None`` (no blocks a kernel reads, no kernels)."""
    if not quantized:
        return None
    name = "output.weight" if "output.weight" in quantized else "token_embd.weight"
    lin = make_linear(weight, [name], quantized)
    if not lin.uses_kernel:
        return None
    lin.max_rows = max_rows
    return lin
