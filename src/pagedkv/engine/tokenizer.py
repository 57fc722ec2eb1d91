"""Tokenizer and chat template built from GGUF metadata.

Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE), the tokenizer of SmolLM2, Llama 3,
Qwen2 and most recent Llama-architecture models. The BPE model is built with the ``tokenizers``
package from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``; the pre-tokenizer (how text
is split into words before BPE) is chosen from ``tokenizer.ggml.pre`` the way llama.cpp chooses it.

Tokens of type CONTROL (3) become special added tokens and tokens of type USER_DEFINED (4) plain
added tokens, so text such as ``"<|im_start|>"`` in a rendered chat prompt is encoded as one id.

The chat template (``tokenizer.chat_template``, a Jinja2 template) is rendered in a sandboxed
Jinja2 environment with the same conventions as Hugging Face ``apply_chat_template``:
``trim_blocks`` and ``lstrip_blocks`` on, the variables ``messages``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``, and the helpers ``raise_exception`` and ``strftime_now``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from .gguf_loader import TokenizerMetadata

__all__ = ["GGUFTokenizer", "TokenizerBase", "TOKEN_TYPE_CONTROL", "TOKEN_TYPE_USER_DEFINED", "CHATML_TEMPLATE"]

# llama.cpp token types (gguf.TokenType)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Word-splitting regular expressions of the common byte-level BPE families (the pattern strings are
# the ones published with each model's tokenizer).
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre values grouped by pre-tokenizer family
_PRE_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_GPT2 = {None, "", "default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_PRE_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3", "pixtral"}
_PRE_QWEN2 = {"qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"}

#: Used when a GGUF file carries no chat template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _build_pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _PRE_DIGITS_THEN_GPT2:
        # every digit is its own word, then the GPT-2 word regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_regex])
    if pre in _PRE_LLAMA3:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False), byte_level_plain]
        )
    if pre in _PRE_QWEN2:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False), byte_level_plain]
        )
    # GPT-2 and anything unknown: the GPT-2 regex built into the ByteLevel pre-tokenizer
    return byte_level_regex


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class TokenizerBase:
    """What every GGUF tokenizer of the engine shares: the special ids and texts from :class:`TokenizerMetadata`
    (``self.meta``), BOS/EOS insertion, and the chat template (``self.chat_template``, rendered in a Jinja
    sandbox). A subclass sets ``meta``, ``chat_template`` and ``_compiled_template = None`` and gives
    ``encode``, ``decode``, ``token_to_id`` and ``id_to_token``."""

    meta: TokenizerMetadata
    chat_template: str
    _compiled_template: Any

    # ------------------------------------------------------------------ ids
    @property
    def vocab_size(self) -> int:
        return len(self.meta.tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self.meta.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.meta.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.meta.pad_token_id

    @property
    def bos_token(self) -> str:
        tid = self.meta.bos_token_id
        return self.meta.tokens[tid] if tid is not None else ""

    @property
    def eos_token(self) -> str:
        tid = self.meta.eos_token_id
        return self.meta.tokens[tid] if tid is not None else ""

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _with_special(self, ids: list[int]) -> list[int]:
        """``ids`` with the BOS/EOS ids where the GGUF asks for them (``tokenizer.ggml.add_bos_token`` /
        ``add_eos_token``)."""
        if self.meta.add_bos_token and self.meta.bos_token_id is not None:
            ids = [self.meta.bos_token_id, *ids]
        if self.meta.add_eos_token and self.meta.eos_token_id is not None:
            ids = [*ids, self.meta.eos_token_id]
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    # ------------------------------------------------------------------ chat
    @property
    def has_chat_template(self) -> bool:
        """Whether the GGUF file carries a chat template (``tokenizer.chat_template``). Without one (a base
        model) ``chat_template`` is a fallback that :meth:`apply_chat_template` still renders on request, but
        ``LLM.chat``, ``pagedkv generate``/``chat`` and the server's chat route refuse chat
        (:meth:`require_chat_template`)."""
        return bool(self.meta.chat_template)

    def require_chat_template(self, model: str = "this model") -> None:
        """Raise :class:`~pagedkv.errors.NoChatTemplateError` (one line naming the way out) unless
        :attr:`has_chat_template`. O(1)."""
        if not self.has_chat_template:
            from ..errors import NoChatTemplateError

            raise NoChatTemplateError(
                f"{model} has no chat template (its GGUF file carries none: a base model), so chat is refused; "
                "use plain completion (pagedkv generate --raw, LLM.generate, /v1/completions)")

    def _template(self) -> Any:
        if self._compiled_template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The chat prompt as text (the model's template, e.g. with its default system message)."""
        return self._template().render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat prompt (special tokens in the template become single ids)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs))


class GGUFTokenizer(TokenizerBase):
    """A byte-level BPE tokenizer plus chat template, built from :class:`TokenizerMetadata`.

    >>> config, weights, meta = load_gguf()          # doctest: +SKIP
    >>> tok = GGUFTokenizer(meta)                    # doctest: +SKIP
    >>> ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])   # doctest: +SKIP
    """

    def __init__(self, meta: TokenizerMetadata) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models

        if meta.model != "gpt2":
            raise NotImplementedError(
                f"tokenizer model {meta.model!r} is not supported (only byte-level BPE, tokenizer.ggml.model == 'gpt2')"
            )
        if not meta.tokens or meta.merges is None:
            raise ValueError("GGUF tokenizer metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        self.meta = meta
        tokens = meta.tokens
        vocab = {tok: i for i, tok in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.merges]
        bpe = models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=meta.pre in _PRE_LLAMA3,
        )
        tk = Tokenizer(bpe)
        tk.pre_tokenizer = _build_pre_tokenizer(meta.pre)
        tk.decoder = decoders.ByteLevel()

        types = meta.token_types or [TOKEN_TYPE_NORMAL] * len(tokens)
        special_ids = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL}
        for tid in (meta.bos_token_id, meta.eos_token_id, meta.pad_token_id, meta.unk_token_id):
            if tid is not None and 0 <= tid < len(tokens):
                special_ids.add(tid)
        user_ids = {i for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED} - special_ids
        # Added tokens are matched in the raw text before pre-tokenization, so "<|im_start|>" is one id.
        tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)])
        if user_ids:
            tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user_ids)])
        self._tk = tk
        self.special_token_ids = frozenset(special_ids)
        self.chat_template = meta.chat_template or CHATML_TEMPLATE
        self._compiled_template: Any = None

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token text (e.g. ``<|im_end|>``) maps to its single id.

        With ``add_special_tokens`` the BOS/EOS ids are added where the GGUF asks for them
        (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``).
        """
        ids = self._tk.encode(text, add_special_tokens=False).ids
        return self._with_special(ids) if add_special_tokens else ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept unless ``skip_special_tokens``."""
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
