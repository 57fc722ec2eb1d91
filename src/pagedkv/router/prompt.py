"""The prompt of a request exactly as a ``pagedkv serve`` replica builds it, and its block hashes.

Parsing and validation are the server's own (:func:`pagedkv.server.validation.parse_completion` and
``parse_chat``), so the router answers a bad request with the same 400 a replica would. Token ids come from the
engine's tokenizer (:class:`pagedkv.engine.tokenizer.GGUFTokenizer`) built from the GGUF file's metadata only:
the weights are never read, and torch is never imported (the ``gguf`` package reads the metadata;
tests/test_router_torch_free.py checks it). A completion's string prompt is encoded with the special tokens (as
``LLM.generate``), token ids are taken as given, and a chat's messages go through the model's chat template (as
the server's chat route). The prefix-cache namespace is the request's ``cache_salt`` (as the server passes it).
The hashes are a :class:`pagedkv.blocks.prefix_cache.PromptKeys`: the prompt's group-0 keys, which also give its keys in
the other KV cache groups when the index scores a replica of a hybrid model. In front of vLLM replicas
(``--hash-scheme vllm``) they are vLLM's block hashes instead (:class:`pagedkv.cluster.vllm_hash.VLLMHasher`, the
request's ``cache_salt`` as vLLM's extra key), the keys vLLM's KV events name its blocks by.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..blocks.prefix_cache import PromptKeys

__all__ = ["PromptBuilder", "RoutedPrompt", "load_tokenizer"]


def load_tokenizer(model: str | Path | None = None):
    """The engine's tokenizer of model ``model`` (a model name such as ``gemma-3-270m``, a GGUF path, or None for
    the default model), from its GGUF metadata only."""
    from gguf import GGUFReader

    from ..engine.gguf_loader import read_tokenizer_metadata
    from ..engine.registry import make_tokenizer, resolve_model_path

    path = resolve_model_path(model)
    reader = GGUFReader(str(path), "r")
    meta = read_tokenizer_metadata(reader)
    del reader
    return make_tokenizer(meta)


@dataclass
class RoutedPrompt:
    """What the router knows of a request: its prompt ids, namespace, block hashes and whether it streams."""

    token_ids: list[int]
    namespace: str | None
    hashes: list[int]
    stream: bool
    model: str | None


class PromptBuilder:
    """Builds :class:`RoutedPrompt` from a request body. ``tokenizer`` as :func:`load_tokenizer` returns it.
    ``hasher``: a :class:`pagedkv.cluster.vllm_hash.VLLMHasher` for vLLM replicas (its block size is used), or
    None for pagedkv's keys."""

    def __init__(self, tokenizer, block_size: int = 16, hasher=None) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size if hasher is None else hasher.block_size
        self.hasher = hasher

    def keys(self, ids: list[int], namespace: str | None) -> list:
        """The prompt's block keys in the replicas' scheme (pagedkv's PromptKeys, or vLLM's hashes)."""
        if self.hasher is not None:
            return self.hasher.keys(ids, cache_salt=namespace)
        return PromptKeys(ids, self.block_size, namespace)

    def build(self, kind: str, body: bytes) -> RoutedPrompt:
        """``kind``: ``"completions"`` or ``"chat"``. Raises the server's ``APIError`` (400) on a bad body."""
        from ..server.validation import APIError, parse_chat, parse_completion

        if kind == "chat":
            req = parse_chat(body)
            try:
                ids = self.tokenizer.apply_chat_template(req.conversation())
            except Exception as e:  # the template rejected the conversation, as on the server
                raise APIError(400, f"the chat template rejected the messages: {e}", "invalid_request_error",
                               None, "messages") from None
        else:
            req = parse_completion(body)
            p = req.prompt_input()
            ids = self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p["prompt_token_ids"]
        ids = [int(t) for t in ids]
        ns = req.cache_salt
        try:
            # group 0's keys, and every other KV cache group's on demand (a hybrid replica's hit needs them)
            hashes = self.keys(ids, ns) if ids else []
        except Exception as e:  # token ids out of range: the replica will say so; route without a prefix
            del e
            hashes = []
        return RoutedPrompt(ids, ns, hashes, bool(req.stream), req.model)
