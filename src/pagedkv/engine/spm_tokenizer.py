"""SentencePiece tokenizer built from GGUF metadata (``tokenizer.ggml.model == "llama"``), e.g. Gemma 3's.

llama.cpp stores a SentencePiece model in GGUF as three parallel arrays (``tokenizer.ggml.tokens``, ``scores``,
``token_type``) plus a few flags. They are exactly the fields of a SentencePiece ``ModelProto``'s pieces, so this
module rebuilds the ``ModelProto`` (with the ``sentencepiece`` package's own protobuf schema) and loads it into a
``sentencepiece.SentencePieceProcessor``: encoding and decoding are the maintained library's, nothing is
re-implemented here. The rebuilt model is a BPE model with byte fallback, no text normalisation
(``identity``), spaces escaped as ``"▁"`` and a dummy prefix only when ``tokenizer.ggml.add_space_prefix`` says so.

Token types map one to one (llama.cpp's token types are SentencePiece's piece types): NORMAL 1, UNKNOWN 2, CONTROL
3, USER_DEFINED 4, UNUSED 5, BYTE 6. SentencePiece matches USER_DEFINED pieces (Gemma's ``<start_of_turn>``,
runs of newlines, ...) atomically in the input; CONTROL pieces (``<bos>``, ``<eos>``, ``<unusedN>``) it never
matches in text, so :meth:`SentencePieceTokenizer.encode` first splits the text at the CONTROL pieces' strings
(as Hugging Face tokenizers treat special tokens) and maps each to its id.

Torch-free (the router imports the engine's tokenizers); needs ``sentencepiece`` and ``protobuf``.
Building the model for Gemma 3's 262,144 pieces takes about a second.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .tokenizer import CHATML_TEMPLATE, TokenizerBase

if TYPE_CHECKING:  # pragma: no cover - typing only (gguf_loader imports torch)
    from .gguf_loader import TokenizerMetadata

__all__ = ["SentencePieceTokenizer", "GEMMA_CHAT_TEMPLATE", "build_model_proto"]

# llama.cpp token types == SentencePiece ModelProto.SentencePiece.Type values
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

#: Used when a GGUF file whose vocabulary has ``<start_of_turn>`` carries no chat template (Gemma's turn format;
#: a system message is folded into the first user turn, as Gemma has no system role).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system = message['content'] + '\n\n' %}{% endif %}{% endfor %}"
    "{% set first = namespace(done=false) %}"
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if not first.done %}{{ ns.system }}{% set first.done = true %}{% endif %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def build_model_proto(meta: "TokenizerMetadata") -> Any:
    """A ``sentencepiece_model_pb2.ModelProto`` (BPE) equivalent to the GGUF tokenizer metadata ``meta``.

    The piece marked ``unknown_token_id`` becomes the one UNKNOWN piece SentencePiece requires (llama.cpp may
    type it CONTROL). Raises ``ValueError`` when the arrays are missing or differ in length. O(vocab).
    """
    pb = _import_spm("sentencepiece.sentencepiece_model_pb2")

    tokens = list(meta.tokens or ())
    if not tokens:
        raise ValueError("GGUF tokenizer metadata lacks tokenizer.ggml.tokens")
    n = len(tokens)
    scores = list(meta.scores) if meta.scores is not None else [0.0] * n
    types = [int(t) for t in meta.token_types] if meta.token_types is not None else [_NORMAL] * n
    if len(scores) != n or len(types) != n:
        raise ValueError(f"GGUF tokenizer arrays differ in length: {n} tokens, {len(scores)} scores, "
                         f"{len(types)} types")
    unk = meta.unk_token_id
    if unk is None:
        unk = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    if unk is None or not 0 <= unk < n:
        raise ValueError("a SentencePiece vocabulary needs an unknown token (tokenizer.ggml.unknown_token_id)")
    m = pb.ModelProto()
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = n
    ts.byte_fallback = _BYTE in types
    ts.unk_id = unk
    ts.bos_id = meta.bos_token_id if meta.bos_token_id is not None else -1
    ts.eos_id = meta.eos_token_id if meta.eos_token_id is not None else -1
    ts.pad_id = meta.pad_token_id if meta.pad_token_id is not None else -1
    for field, tid in (("unk_piece", unk), ("bos_piece", meta.bos_token_id), ("eos_piece", meta.eos_token_id),
                       ("pad_piece", meta.pad_token_id)):
        if tid is not None and 0 <= tid < n:
            setattr(ts, field, tokens[tid])
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = bool(meta.add_space_prefix)
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    ns.precompiled_charsmap = b""
    # SentencePiece escapes the input's spaces to "▁" before it matches pieces; llama.cpp keeps some USER_DEFINED
    # pieces (Gemma's runs of spaces) with literal spaces, which would then never match: escape them the same way
    # (unless the escaped form is another piece already).
    known = set(tokens)
    for i, (tok, score, typ) in enumerate(zip(tokens, scores, types)):
        p = m.pieces.add()
        if " " in tok and tok.replace(" ", "\u2581") not in known:
            tok = tok.replace(" ", "\u2581")
        p.piece = tok
        p.score = float(score)
        if i == unk:
            p.type = _UNKNOWN
        elif typ == _UNKNOWN:  # a second unknown piece: SentencePiece allows one only
            p.type = _CONTROL
        else:
            p.type = typ if typ in (_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE) else _NORMAL
    return m


def _import_spm(name: str) -> Any:
    """Import ``name`` (sentencepiece, or its protobuf schema); :class:`~pagedkv.errors.MissingExtraError` naming
    the ``gemma`` extra when sentencepiece or protobuf is not installed."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        from ..errors import MissingExtraError

        raise MissingExtraError(
            f"this model's SentencePiece tokenizer (Gemma 3) needs the {e.name or 'sentencepiece'} package, which is "
            "not installed; install the gemma extra: pip install 'pagedkv[gemma]'") from None


class SentencePieceTokenizer(TokenizerBase):
    """A SentencePiece (BPE, byte fallback) tokenizer plus chat template, from :class:`TokenizerMetadata`.

    The same interface as :class:`pagedkv.engine.tokenizer.GGUFTokenizer` (``encode``, ``decode``,
    ``apply_chat_template``, the special ids), so the engine, the server and the router use either.
    """

    def __init__(self, meta: "TokenizerMetadata") -> None:
        spm = _import_spm("sentencepiece")

        if meta.model != "llama":
            raise NotImplementedError(
                f"tokenizer model {meta.model!r} is not a SentencePiece model (tokenizer.ggml.model == 'llama')"
            )
        self.meta = meta
        proto = build_model_proto(meta)
        self._sp = spm.SentencePieceProcessor()
        self._sp.LoadFromSerializedProto(proto.SerializeToString())
        tokens = meta.tokens
        types = meta.token_types or [_NORMAL] * len(tokens)
        special = {i for i, t in enumerate(types) if t == _CONTROL}
        for tid in (meta.bos_token_id, meta.eos_token_id, meta.pad_token_id, meta.unk_token_id):
            if tid is not None and 0 <= tid < len(tokens):
                special.add(tid)
        self.special_token_ids = frozenset(special)
        self._special_by_text = {tokens[i]: i for i in sorted(special)}
        # longest first, so that a special token never matches as the prefix of a longer one
        alternatives = sorted(self._special_by_text, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        if meta.chat_template:
            self.chat_template = meta.chat_template
        elif "<start_of_turn>" in tokens:
            self.chat_template = GEMMA_CHAT_TEMPLATE
        else:
            self.chat_template = CHATML_TEMPLATE
        self._compiled_template: Any = None

    def token_to_id(self, token: str) -> int | None:
        tid = self._sp.PieceToId(token)
        return tid if self._sp.IdToPiece(tid) == token else None

    def id_to_token(self, token_id: int) -> str | None:
        return self.meta.tokens[token_id] if 0 <= token_id < len(self.meta.tokens) else None

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; the text of a special (CONTROL) token, e.g. ``<eos>``, maps to its one id.

        With ``add_special_tokens`` the BOS/EOS ids are added where the GGUF asks for them
        (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``). O(len(text)).
        """
        ids: list[int] = []
        pos = 0
        if self._special_re is not None:
            for m in self._special_re.finditer(text):
                if m.start() > pos:
                    ids += self._sp.EncodeAsIds(text[pos:m.start()])
                ids.append(self._special_by_text[m.group()])
                pos = m.end()
        if pos < len(text):
            ids += self._sp.EncodeAsIds(text[pos:])
        return self._with_special(ids) if add_special_tokens else ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept as their text unless ``skip_special_tokens``."""
        out: list[str] = []
        run: list[int] = []
        special = self.special_token_ids
        for i in ids:
            i = int(i)
            if i in special:
                if run:
                    out.append(self._sp.DecodeIds(run))
                    run = []
                if not skip_special_tokens:
                    out.append(self.meta.tokens[i])
            else:
                run.append(i)
        if run:
            out.append(self._sp.DecodeIds(run))
        return "".join(out)
