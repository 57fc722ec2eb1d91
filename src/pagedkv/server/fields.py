"""Field checks of a JSON request body in OpenAI's error style, the building blocks of
:mod:`pagedkv.server.validation`: each reads one field of a parsed body (or checks one value), returns it typed
and in range, or raises :class:`~pagedkv.server.api_error.APIError` (400) whose message and ``param`` name the
field as OpenAI names it (``messages.[0].content``). Standard library only. O(the value's size) each."""

from __future__ import annotations

import math
from typing import Any

from .api_error import APIError


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)



def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a decimal"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _show(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**30:
        return f"an integer of {len(str(abs(v)))} digits"
    return repr(v)


def _type_error(name: str, expected: str, v: Any) -> APIError:
    return _bad(f"Invalid type for '{name}': expected {expected}, but got {_kind(v)} instead.", name)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(d: dict, name: str, default: Any, lo: int, hi: int, *, nullable: bool = True,
         path: str | None = None) -> Any:
    v = d.get(name, default)
    if v is None and nullable:
        return default
    p = path or name
    if not _is_int(v):
        raise _type_error(p, "an integer", v)
    if v < lo:
        raise _bad(f"Invalid '{p}': integer below minimum value. Expected a value >= {lo}, but got {_show(v)} "
                   "instead.", p)
    if v > hi:
        raise _bad(f"Invalid '{p}': integer above maximum value. Expected a value <= {hi}, but got {_show(v)} "
                   "instead.", p)
    return v


def _num(d: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False,
         path: str | None = None) -> float:
    v = d.get(name, default)
    if v is None:
        return default
    name = path or name  # (the field as messages name it)
    if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
        raise _type_error(name, "a decimal", v)
    if isinstance(v, float) and not math.isfinite(v):
        raise _bad(f"Invalid '{name}': expected a finite number, but got {_show(v)} instead.", name)
    if v < lo or (lo_open and v == lo):
        rel = ">" if lo_open else ">="
        raise _bad(f"Invalid '{name}': decimal below minimum value. Expected a value {rel} {lo}, but got "
                   f"{_show(v)} instead.", name)
    if v > hi:
        raise _bad(f"Invalid '{name}': decimal above maximum value. Expected a value <= {hi}, but got {_show(v)} "
                   "instead.", name)
    return float(v)


def _bool(d: dict, name: str, default: bool = False) -> bool:
    v = d.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _text(v: Any, path: str, max_chars: int | None = None) -> str:
    """``v`` as a string of valid Unicode (no lone surrogates: they cannot be encoded as UTF-8)."""
    if not isinstance(v, str):
        raise _type_error(path, "a string", v)
    if max_chars is not None and len(v) > max_chars:
        raise _bad(f"Invalid '{path}': string too long. Expected a string with maximum length {max_chars}, but got "
                   f"a string with length {len(v)} instead.", path, "string_above_max_length")
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise _bad(f"Invalid '{path}': the string is not valid Unicode (it contains a lone surrogate).",
                       path) from None
    return v


def _opt_text(d: dict, name: str, max_chars: int | None = 4096) -> str | None:
    v = d.get(name)
    return None if v is None else _text(v, name, max_chars)


def _unsupported(name: str, what: str | None = None) -> APIError:
    return _bad(f"'{name}' is not supported by this server{': ' + what if what else ''}.", name,
                "unsupported_parameter")


def _check_keys(d: dict, known: frozenset, prefix: str = "") -> None:
    for k in d:
        if k not in known:
            name = f"{prefix}{k}"[:200]
            raise _bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")

