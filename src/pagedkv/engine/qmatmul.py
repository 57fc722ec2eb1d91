"""Products with the file's quantized weights for the few-row steps (decode), exact to the float32 model.

Why: at batch 1 a decode step reads every weight once, and the float32 weights of SmolLM2-135M are 428 MB per
token (31.7 ms of a 45.7 ms step on one thread, measured); the file's Q4_1 blocks are 0.625 bytes per weight
instead of 4. llama.cpp reads them as they are, but rounds the activations to 8 bits first, so its products are
not those of the float32 model. Here the activations stay float32 and each weight is rebuilt in float32 on the
fly, bit for bit as ``gguf.quants.dequantize`` rebuilds it (Q4_1: ``d * q + m``, Q8_0: ``d * q``; ``d * q`` of a
float16 scale is exact in float32): the result is the product with the dequantized float32 matrix, up to the
float32 summation order (which any GEMM already chooses freely). Greedy tokens stay those of the reference.

The kernels (``_qkernels.c``, AVX-512 / AVX2 / plain C by what the CPU has) are compiled once per machine with
the system's C compiler (``cc -O3 -march=native -ffp-contract=off -fopenmp``) into ``~/.cache/pagedkv/kernels``
(``PAGEDKV_KERNEL_CACHE`` overrides) and loaded with ctypes. No compiler, a failed build or
``PAGEDKV_QKERNELS=0``: :func:`kernels` returns ``None`` and every product is the dense float32 one.

:class:`QuantLinear` keeps both forms of one weight: the quantized blocks for steps of up to ``max_rows`` rows
(decode of a few sequences, where reading the weights dominates) and the dense float32 matrix for the rest
(prefill, large batches: compute-bound, where the BLAS kernel wins). Cost: the quantized copy, 1/6.4 (Q4_1) or
1/3.8 (Q8_0) of the float32 one.
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

__all__ = ["QUANT_KINDS", "QuantBlocks", "QuantLinear", "build_kernels", "kernel_status", "kernels", "load_blocks", "split_blocks"]

log = logging.getLogger(__name__)

#: GGUF quantization types the kernels read (names of ``gguf.GGMLQuantizationType``)
QUANT_KINDS = ("Q4_1", "Q8_0")
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
_NATIVE = ("-march=native",)


class QuantBlocks(NamedTuple):
    """One weight matrix ``(N, K)`` in a kernel's layout (module ``_qkernels.c``): ``qs`` uint8 ``(N, K // 2)``
    (Q4_1) or int8 ``(N, K)`` (Q8_0), ``d`` and ``m`` float32 ``(N, K // 32)`` (``m`` is ``None`` for Q8_0)."""

    kind: str
    qs: np.ndarray
    d: np.ndarray
    m: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        n = self.qs.shape[0]
        return n, self.d.shape[1] * 32

    def take_rows(self, convert: Any) -> QuantBlocks:
        """The same blocks with ``convert`` (a row permutation such as ``unpermute_qk``) applied to every part."""
        return QuantBlocks(self.kind, convert(self.qs), convert(self.d),
                           None if self.m is None else convert(self.m))

    @staticmethod
    def concat(parts: list[QuantBlocks]) -> QuantBlocks:
        """The blocks of several matrices of one kind stacked along the output rows (a fused projection)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack blocks of different kinds {sorted(kinds)}")
        cat = lambda xs: np.ascontiguousarray(np.concatenate(xs, axis=0))  # noqa: E731
        m = None if parts[0].m is None else cat([p.m for p in parts])
        return QuantBlocks(parts[0].kind, cat([p.qs for p in parts]), cat([p.d for p in parts]), m)


def split_blocks(kind: str, raw: np.ndarray) -> QuantBlocks:
    """A GGUF tensor's raw blocks (``uint8 (N, K / 32 * block bytes)``, as ``gguf.ReaderTensor.data`` holds them)
    split into the kernel's layout. ``ValueError`` for another kind."""
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"no kernel for {kind}; supported: {', '.join(QUANT_KINDS)}")
    raw = np.asarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, _BLOCK_BYTES[kind])
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
        qs = np.ascontiguousarray(blocks[:, :, 4:20]).reshape(n, -1)
        return QuantBlocks(kind, qs, d, m)
    qs = np.ascontiguousarray(blocks[:, :, 2:34]).view(np.int8).reshape(n, -1)
    return QuantBlocks(kind, qs, d, None)


def load_blocks(path: Any, convert: Any = None) -> dict[str, QuantBlocks]:
    """The tensors of a GGUF file whose type a kernel reads (:data:`QUANT_KINDS`), in the kernel's layout, keyed by
    name; ``convert(name, array)`` (a row permutation, e.g. ``gguf_loader.llama_row_convert(config)``) applied to
    each part. Reads the memory-mapped blocks only: O(quantized bytes)."""
    from .gguf_loader import open_gguf

    out: dict[str, QuantBlocks] = {}
    for t in open_gguf(path).tensors:
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
    cache = Path(os.environ.get("PAGEDKV_KERNEL_CACHE") or Path.home() / ".cache" / "pagedkv" / "kernels")
    lib = cache / f"qkernels-{key}.so"
    if not lib.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            c_file = Path(tmp) / "_qkernels.c"
            c_file.write_bytes(src)
            out = Path(tmp) / lib.name
            r = subprocess.run([cc, *flags, str(c_file), "-o", str(out)], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
            os.replace(out, lib)  # atomic: concurrent builders each install a complete file
    dll = ctypes.CDLL(str(lib))
    vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.pkv_q4_1_mm.argtypes = [vp, i64, i64, i64, vp, vp, vp, i64, i64, vp, i64, ci]
    dll.pkv_q4_1_mm.restype = None
    dll.pkv_q8_0_mm.argtypes = [vp, i64, i64, i64, vp, vp, i64, i64, vp, i64, ci]
    dll.pkv_q8_0_mm.restype = None
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
    """``y = x @ W.T`` for a weight held both dense (float32 ``(N, K)``) and quantized (:class:`QuantBlocks`).

    ``x`` of up to ``max_rows`` rows (float32, on the CPU) goes through the quantized kernel on
    ``torch.get_num_threads()`` threads; anything else through ``F.linear`` on the dense weight. Both give the
    product with the same float32 matrix (summation order aside). O(rows x N x K)."""

    __slots__ = ("weight", "kind", "max_rows", "_qs", "_d", "_m", "_fn", "_n", "_k")

    #: rows up to which the kernel is used (measured, benchmarks/qmatmul_ab.py: at 32 rows it still beats MKL on
    #: SmolLM2's shapes, one thread; beyond, the dense product catches up)
    DEFAULT_MAX_ROWS = 32

    def __init__(self, weight: torch.Tensor, blocks: QuantBlocks, *, max_rows: int | None = None) -> None:
        if tuple(weight.shape) != blocks.shape:
            raise ValueError(f"weight {tuple(weight.shape)} and blocks {blocks.shape} differ in shape")
        self.weight = weight
        self.kind = blocks.kind
        self.max_rows = self.DEFAULT_MAX_ROWS if max_rows is None else max_rows
        self._qs = torch.from_numpy(np.ascontiguousarray(blocks.qs))
        self._d = torch.from_numpy(np.ascontiguousarray(blocks.d))
        self._m = None if blocks.m is None else torch.from_numpy(np.ascontiguousarray(blocks.m))
        self._n, self._k = blocks.shape
        dll = kernels() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None
        self._fn = None if dll is None else (dll.pkv_q4_1_mm if self.kind == "Q4_1" else dll.pkv_q8_0_mm)

    @property
    def uses_kernel(self) -> bool:
        """Whether few-row products go through the quantized kernel (built, CPU, float32)."""
        return self._fn is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized copy."""
        return sum(t.numel() * t.element_size() for t in (self._qs, self._d, self._m) if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else -1
        if x.shape[-1] != self._k:
            raise ValueError(f"input has {x.shape[-1]} features, the weight {self._k}")
        if self._fn is None or not 0 < rows <= self.max_rows or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight)
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty((rows, self._n), dtype=torch.float32)
        if self._m is not None:
            self._fn(x.data_ptr(), rows, x.stride(0), self._k, self._qs.data_ptr(), self._d.data_ptr(),
                     self._m.data_ptr(), 0, self._n, y.data_ptr(), self._n, torch.get_num_threads())
        else:
            self._fn(x.data_ptr(), rows, x.stride(0), self._k, self._qs.data_ptr(), self._d.data_ptr(),
                     0, self._n, y.data_ptr(), self._n, torch.get_num_threads())
        return y
