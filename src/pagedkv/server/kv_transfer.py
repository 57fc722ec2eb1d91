"""``kv_transfer_params``: the fields of a prefill/decode split on the wire, in vLLM's shape, validated.

A plain module (standard library only, as :mod:`.validation`), shared by ``pagedkv serve`` and ``pagedkv router``.
The flow (docs/pd-split.md) has three messages, all ordinary ``/v1/completions`` or ``/v1/chat/completions``
bodies and answers:

1. router -> prefill replica: the client's body with ``max_tokens`` 1, ``stream`` false and
   ``"kv_transfer_params": {"do_remote_decode": true}`` (:func:`prefill_body`; vLLM's proxy also sends the
   ``remote_*`` fields as null, accepted here);
2. prefill replica -> router: its answer, with a top-level ``kv_transfer_params`` naming the held blocks and where
   to read them (:func:`answer_params`; ``remote_kv_store`` when a shared store holds them too), or null when the
   prompt has no whole block to hand over;
3. router -> decode replica: the client's body with those ``kv_transfer_params``
   (``do_remote_prefill: true``), answered (streamed) to the client.

:func:`parse_kv_transfer_params` validates the field of a request body and returns a :class:`KVTransferParams`
(or None when absent, null, or asking for no transfer); a bad field raises :class:`~.validation.APIError` (400,
``param`` naming it, e.g. ``kv_transfer_params.remote_port``). What depends on the replica (its role, its block
size, the prompt's length) is checked by :func:`check_request` once the prompt is tokenized. O(len of the
field); nothing is allocated beyond the block-id tuple.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .api_error import APIError

__all__ = ["KV_ROLES", "KVTransferParams", "parse_kv_transfer_params", "check_request", "answer_params",
           "prefill_body", "max_prefill_tokens", "MAX_HOLD_ID_CHARS"]

#: ``pagedkv serve --kv-role``: ``prefill`` computes prompts and holds their blocks for a decode replica,
#: ``decode`` generates after reading them, ``both`` (the default) does either, and plain requests.
KV_ROLES = ("prefill", "decode", "both")

MAX_HOLD_ID_CHARS = 128
_KNOWN = frozenset({"do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_request_id",
                    "remote_block_ids", "remote_host", "remote_port", "remote_num_tokens", "tp_size", "pp_size",
                    "remote_kv_store"})
_REMOTE = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port",
           "remote_num_tokens", "remote_kv_store")
_ID = re.compile(r"^[A-Za-z0-9._:-]+$")
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+|[0-9A-Fa-f:]+)$")
_MAX_BLOCKS = 1 << 20  # a request naming more blocks than this is refused before its list is walked


def _bad(message: str, field: str, code: str = "invalid_kv_transfer_params") -> APIError:
    return APIError(400, message, "invalid_request_error", code, f"kv_transfer_params.{field}" if field else
                    "kv_transfer_params")


@dataclass(frozen=True)
class KVTransferParams:
    """A validated ``kv_transfer_params``. Exactly one of ``do_remote_decode`` (this replica computes the prompt
    and holds its blocks for a decode replica) and ``do_remote_prefill`` (this replica reads the prompt's first
    ``remote_num_tokens`` tokens' KV from ``remote_host:remote_port`` instead of computing them) is true; the
    ``remote_*`` fields are set only with ``do_remote_prefill``."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None  #: the hold's id on the prefill replica
    remote_block_ids: tuple[int, ...] = ()
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int = 0
    #: the shared store (``--kv-shared``) that holds the blocks too, by its name (``EngineKVPort.shared_store``:
    #: ``kvs-`` and 16 hex digits); None: only the hold has them (docs/pd-split.md#through-the-shared-store)
    remote_kv_store: str | None = None

    @property
    def base_url(self) -> str:
        """The prefill replica's HTTP base URL (``do_remote_prefill`` only)."""
        host = self.remote_host or ""
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.remote_port}"

    def to_json(self) -> dict:
        """The field as a body carries it (vLLM's names)."""
        if self.do_remote_decode:
            return {"do_remote_decode": True, "do_remote_prefill": False}
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.remote_engine_id,
                "remote_request_id": self.remote_request_id, "remote_block_ids": list(self.remote_block_ids),
                "remote_host": self.remote_host, "remote_port": self.remote_port,
                "remote_num_tokens": self.remote_num_tokens, "tp_size": 1,
                **({} if self.remote_kv_store is None else {"remote_kv_store": self.remote_kv_store})}


def _flag(d: dict, name: str) -> bool:
    v = d.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"Invalid 'kv_transfer_params.{name}': expected a boolean, got {type(v).__name__}.", name)
    return v


def _str(d: dict, name: str, limit: int, pattern: re.Pattern) -> str:
    v = d.get(name)
    if not isinstance(v, str) or not v:
        raise _bad(f"'kv_transfer_params.{name}' must be a non-empty string with do_remote_prefill.", name)
    if len(v) > limit or not pattern.match(v):
        raise _bad(f"Invalid 'kv_transfer_params.{name}': expected at most {limit} characters of "
                   f"{'a host name or IP address' if pattern is _HOST else 'letters, digits and . _ : -'}.", name)
    return v


def _int(d: dict, name: str, lo: int, hi: int) -> int:
    v = d.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(f"'kv_transfer_params.{name}' must be an integer in [{lo}, {hi}].", name)
    return v


def parse_kv_transfer_params(v: Any, *, max_blocks: int = _MAX_BLOCKS) -> KVTransferParams | None:
    """Validate a request's ``kv_transfer_params`` (the parsed JSON value). None when absent or null or when
    neither flag is set (vLLM's neutral value). Raises :class:`APIError` 400 on: a value that is not an object, an
    unknown key, a flag that is not a boolean, both flags set, ``remote_*`` fields with ``do_remote_decode``, a
    missing or malformed ``remote_*`` field with ``do_remote_prefill`` (host: a name or an IP address; port in [1,
    65535]; ids: up to 128 of ``[A-Za-z0-9._:-]``; block ids: at most ``max_blocks`` distinct ints in [0, 2**31);
    ``remote_num_tokens`` >= 0), ``tp_size`` / ``pp_size`` other than 1. O(len(remote_block_ids))."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad(f"Invalid 'kv_transfer_params': expected an object, got {type(v).__name__}.", "")
    for k in v:
        if k not in _KNOWN:
            name = str(k)[:100]
            raise APIError(400, f"Unrecognized request argument supplied: kv_transfer_params.{name}",
                           "invalid_request_error", "unknown_parameter", f"kv_transfer_params.{name}")
    for name in ("tp_size", "pp_size"):
        if v.get(name) is not None and v.get(name) != 1:
            raise _bad(f"'kv_transfer_params.{name}' must be 1: this server runs one process per replica, "
                       "without tensor or pipeline parallelism.", name)
    decode, prefill = _flag(v, "do_remote_decode"), _flag(v, "do_remote_prefill")
    if decode and prefill:
        raise _bad("'kv_transfer_params' sets both do_remote_decode and do_remote_prefill; a request is either "
                   "computed here for a remote decode or decoded here after a remote prefill.", "do_remote_prefill")
    if not prefill:
        stray = [k for k in _REMOTE if v.get(k) is not None]
        if stray:
            raise _bad(f"'kv_transfer_params.{stray[0]}' is only allowed with do_remote_prefill.", stray[0])
        return KVTransferParams(do_remote_decode=True) if decode else None
    ids = v.get("remote_block_ids")
    if not isinstance(ids, list):
        raise _bad("'kv_transfer_params.remote_block_ids' must be an array of block ids with do_remote_prefill.",
                   "remote_block_ids")
    if len(ids) > max_blocks:
        raise _bad(f"'kv_transfer_params.remote_block_ids' names {len(ids)} blocks; at most {max_blocks} fit a "
                   "prompt here.", "remote_block_ids")
    for i, b in enumerate(ids):
        if type(b) is not int or not 0 <= b < 2**31:
            raise _bad(f"Invalid 'kv_transfer_params.remote_block_ids.[{i}]': expected a block id in [0, 2**31).",
                       f"remote_block_ids.[{i}]")
    if len(set(ids)) != len(ids):
        raise _bad("'kv_transfer_params.remote_block_ids' names a block twice.", "remote_block_ids")
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=_str(v, "remote_engine_id", MAX_HOLD_ID_CHARS, _ID),
        remote_request_id=_str(v, "remote_request_id", MAX_HOLD_ID_CHARS, _ID),
        remote_block_ids=tuple(ids),
        remote_host=_str(v, "remote_host", 255, _HOST),
        remote_port=_int(v, "remote_port", 1, 65535),
        remote_num_tokens=_int(v, "remote_num_tokens", 0, 2**31 - 1),
        remote_kv_store=None if v.get("remote_kv_store") is None else _str(v, "remote_kv_store", 64, _ID),
    )


def check_request(kvt: KVTransferParams | None, *, role: str, available: bool, block_size: int,
                  num_prompt_tokens: int, n: int, stream: bool) -> None:
    """The checks that need the replica and the tokenized prompt; :class:`APIError` 400 when one fails.

    - the replica's role must take the direction (``prefill``: do_remote_decode only; ``decode``:
      do_remote_prefill only; plain requests go anywhere): code ``kv_role_mismatch``;
    - the replica must be able to hand KV over (``available``): code ``kv_transfer_unavailable``;
    - ``n`` must be 1, and a prefill for a remote decode is not streamed (its answer carries the params);
    - with do_remote_prefill: ``remote_num_tokens`` is a whole number of blocks, one per ``remote_block_ids``,
      and leaves at least the prompt's last token to compute (its logits give the first output token).
    O(1)."""
    if kvt is None:
        return
    if kvt.do_remote_decode and role == "decode":
        raise APIError(400, "this replica runs with --kv-role decode: it does not compute prompts for a remote "
                       "decode (send do_remote_decode to a prefill replica)", "invalid_request_error",
                       "kv_role_mismatch", "kv_transfer_params.do_remote_decode")
    if kvt.do_remote_prefill and role == "prefill":
        raise APIError(400, "this replica runs with --kv-role prefill: it does not decode after a remote prefill "
                       "(send do_remote_prefill to a decode replica)", "invalid_request_error", "kv_role_mismatch",
                       "kv_transfer_params.do_remote_prefill")
    if not available:
        raise APIError(400, "this replica cannot hand KV blocks over (its engine has no KV port); send the "
                       "request without kv_transfer_params", "invalid_request_error",
                       "kv_transfer_unavailable", "kv_transfer_params")
    if n != 1:
        raise APIError(400, "'n' must be 1 with kv_transfer_params", "invalid_request_error", None, "n")
    if kvt.do_remote_decode and stream:
        raise APIError(400, "a prefill for a remote decode is answered whole, with its kv_transfer_params: send "
                       "it with 'stream': false", "invalid_request_error", None, "stream")
    if kvt.do_remote_prefill:
        nb = len(kvt.remote_block_ids)
        if kvt.remote_num_tokens != nb * block_size:
            raise _bad(f"'kv_transfer_params.remote_num_tokens' ({kvt.remote_num_tokens}) must be the "
                       f"{nb} blocks of remote_block_ids times this replica's block size {block_size}.",
                       "remote_num_tokens")
        if kvt.remote_num_tokens >= num_prompt_tokens:
            raise _bad(f"'kv_transfer_params.remote_num_tokens' ({kvt.remote_num_tokens}) must be less than the "
                       f"prompt's {num_prompt_tokens} tokens (its last token is computed here).",
                       "remote_num_tokens")


def answer_params(*, hold_id: str, block_ids, num_tokens: int, engine_id: str, host: str, port: int,
                  kv_store: str | None = None) -> dict:
    """The ``kv_transfer_params`` a prefill replica answers for a hold (vLLM's names; ``remote_request_id`` is
    the hold's id, ``remote_num_tokens`` the tokens its blocks hold; ``remote_kv_store`` only when ``kv_store``,
    the shared store that holds them too, is given)."""
    return KVTransferParams(do_remote_prefill=True, remote_engine_id=engine_id, remote_request_id=hold_id,
                            remote_block_ids=tuple(int(b) for b in block_ids), remote_host=host,
                            remote_port=int(port), remote_num_tokens=int(num_tokens),
                            remote_kv_store=kv_store).to_json()


def prefill_body(body: dict) -> dict:
    """The body a router sends to a prefill replica for a client's body (a new dict): ``max_tokens`` (and
    ``max_completion_tokens``) 1, not streamed, no ``stream_options``, ``kv_transfer_params`` asking for a
    remote decode. O(number of fields)."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


def max_prefill_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """Tokens a prefill replica hands over for a prompt: its whole blocks before its last token."""
    return (max(0, num_prompt_tokens - 1) // block_size) * block_size
