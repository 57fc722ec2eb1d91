"""Command-line options declared once, as the fields of frozen config dataclasses, and the argparse options derived
from them; and :class:`ServiceConfig`, the options ``pagedkv serve`` and ``pagedkv router`` share.

A field made by :func:`option` declares an option: its default, its help and its argparse details (``metavar``,
``choices``, ``many=True``: repeatable); ``--flag-name`` for ``flag_name``, the type from the annotation. A field
made by :func:`same_as` declares nothing: it names where its option is declared (another config's field, or a
callable that returns the argparse keywords of an option declared elsewhere) and may change only the default and
add a note to the help. :func:`add_config_args` adds one option per field; :func:`config_from_args` builds the
config (its ``__post_init__`` checks the values) from the parsed options. Standard library only; torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable

from .errors import InvalidArgumentError

__all__ = ["option", "same_as", "add_config_args", "option_keywords", "config_from_args", "flag", "ServiceConfig"]


def option(default: Any, help: str, *, many: bool = False, **argparse_kw: Any) -> Any:
    """A field that declares a command-line option (``argparse_kw``: ``metavar``, ``choices``). ``many``: the
    option may be repeated, the field holds a tuple of the values (default ``()``)."""
    return field(default=default, metadata={"help": help, "many": many, **argparse_kw})


def same_as(source: type | Callable[[str], dict], name: str, *, default: Any = MISSING, note: str = "") -> Any:
    """A field whose option is declared by ``source``: a config dataclass (its field ``name``; the default is that
    field's unless given), or a callable ``source(name)`` returning the option's argparse keywords (``help``,
    ``type``, ``metavar``, ``choices``; the default must then be given). ``note`` is added to the help."""
    if default is MISSING:
        if not dataclasses.is_dataclass(source):
            raise TypeError(f"same_as({source!r}, {name!r}) needs a default")
        default = _field(source, name).default
    return field(default=default, metadata={"same_as": (source, name), "note": note})


def flag(name: str) -> str:
    """The option of field ``name``: ``--flag-name`` for ``flag_name``."""
    return "--" + name.replace("_", "-")


def _field(cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def _type(f: dataclasses.Field) -> type:
    ann = str(f.type)  # (a string under `from __future__ import annotations`: "int | None", "tuple[str, ...]")
    return int if ann.startswith("int") else float if ann.startswith("float") else str


def option_keywords(cls: type, name: str) -> dict:
    """The argparse keywords of field ``name`` of ``cls`` (``help``, ``type``, ``default``...), the declaration a
    :func:`same_as` field points to resolved. O(fields)."""
    f = _field(cls, name)
    meta = f.metadata
    if "same_as" in meta:
        source, other = meta["same_as"]
        kw = option_keywords(source, other) if dataclasses.is_dataclass(source) else dict(source(other))
        if meta["note"]:
            kw["help"] = f"{kw['help']}; {meta['note']}"
        kw["default"] = f.default
        return kw
    kw = {"help": meta["help"], "default": f.default}
    if meta.get("many"):
        kw.update(action="append", default=[])  # (argparse appends to a copy of the default)
    elif isinstance(f.default, bool):
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = _type(f)
    kw.update({k: v for k, v in meta.items() if k in ("metavar", "choices")})
    return kw


def add_config_args(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One option per field of ``cls`` (fields named in ``skip`` left out), in declaration order."""
    for f in dataclasses.fields(cls):
        if f.name not in skip:
            kw = {k: v for k, v in option_keywords(cls, f.name).items() if v is not None or k == "default"}
            parser.add_argument(flag(f.name), dest=f.name, **kw)


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """``cls`` from the options :func:`add_config_args` parsed (a repeated option's list becomes a tuple; a field
    missing from ``args`` keeps its default). Raises what ``cls`` raises for a bad value
    (:class:`~pagedkv.errors.InvalidArgumentError`, a ValueError)."""
    kw = {}
    for f in dataclasses.fields(cls):
        if hasattr(args, f.name):
            v = getattr(args, f.name)
            kw[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kw)


@dataclass(frozen=True)
class ServiceConfig:
    """The options of the client-facing side that ``pagedkv serve`` and ``pagedkv router`` share (the router's
    port default is its own, 8080). The HTTP deadlines and the connection cap are declared with them, in
    :mod:`pagedkv.server.http_options`."""

    host: str = option("127.0.0.1", "address to bind (default: loopback only)")
    port: int = option(8000, "TCP port to listen on")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1 routes (/health and /metrics "
                                       "stay open)")
    max_body_bytes: int = option(2 * 2**20, "largest request body accepted; larger ones get 413 (default: 2097152, "
                                            "2 MiB)")
    kv_events_topic: str = option("kv-events", "ZMQ topic of the KV-event messages")

    def __post_init__(self) -> None:
        if not isinstance(self.host, str):
            raise InvalidArgumentError(f"--host must be an address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"--port must lie in [0, 65535], got {self.port}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise InvalidArgumentError("--api-key must not be empty")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise InvalidArgumentError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if not isinstance(self.kv_events_topic, str):
            raise InvalidArgumentError(f"--kv-events-topic must be a string, got {self.kv_events_topic!r}")
