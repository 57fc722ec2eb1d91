"""Command-line options shared by every command that builds an engine (``generate``, ``chat``,
``bench throughput``, ``serve``), and the constructors that turn them into an ``LLM`` and ``SamplingParams``.

Torch-free at import time (the engine is imported inside the constructors), so the ``pagedkv`` command imports it
without loading torch until an engine command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

__all__ = ["add_engine_args", "add_sampling_args", "make_llm", "make_params"]


def _cli_type(f: dataclasses.Field) -> type:
    """The argparse type of a config field, from its annotation (``"int | None"`` -> int)."""
    ann = str(f.type)
    return int if ann.startswith("int") else float if ann.startswith("float") else str


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--model`` and one option per field of the engine configs (:mod:`pagedkv.engine.config`: name, default,
    help, choices and metavar come from the field), ``--flag-name`` for ``flag_name``; a bool field is
    ``--flag / --no-flag``. Fields marked ``cli=False`` have none; two are spelled here: the prefix cache (vLLM's
    ``--no-enable-prefix-caching``) and the tiers' write policy (``--kv-store-policy``, ``--[no-]kv-store``)."""
    p.add_argument("--model", default=None,
                   help="model name (smollm2-135m, the default, or gemma-3-270m) or the path of a GGUF file")
    for f in _cli_fields():
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        kw = {"default": f.default, "help": meta["help"], "dest": f.name}
        if meta.get("cli") == "negated":  # (the prefix cache: on unless turned off)
            p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="no_prefix_caching",
                           action="store_true", help="turn the prefix cache off (on by default; the second name "
                                                     "is vLLM's)")
            p.add_argument("--enable-prefix-caching", dest="no_prefix_caching", action="store_false",
                           help="the prefix cache on (the default; vLLM's name)")
            continue
        if meta.get("cli") == "policy":  # (the tiers' write policy: a policy name, or on / off)
            p.add_argument("--kv-store-policy", type=_store_policy_arg, default=None, metavar=meta["metavar"],
                           help=meta["help"])
            p.add_argument("--kv-store", action=argparse.BooleanOptionalAction, default=True,
                           help="--no-kv-store: the same as --kv-store-policy off")
            continue
        if isinstance(f.default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _threads_arg if f.name == "threads" else _cli_type(f)
            for k in ("metavar", "choices"):
                if k in meta:
                    kw[k] = meta[k]
        p.add_argument(flag, **kw)


def _cli_fields() -> list:
    """The config fields that have a command-line option, in declaration order."""
    from .config import CONFIG_CLASSES

    return [f for cls in CONFIG_CLASSES.values() for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


_STORE_POLICY = re.compile(r"^(through|write_through|(selective|write_through_selective)(:[1-9][0-9]*)?|back|write_back"
                           r"|off)$")


def _store_policy_arg(text: str) -> str:
    t = text.strip().lower()
    if not _STORE_POLICY.match(t):
        raise argparse.ArgumentTypeError(f"must be through, selective[:N] (N >= 1), back or off, got {text!r}")
    return t


def _threads_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens generated per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the most likely tokens up to this total probability")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 keeps all")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, a fresh one)")


def _store_policy(args: argparse.Namespace) -> str:
    """``--kv-store-policy``, or ``--[no-]kv-store`` without it."""
    pol = getattr(args, "kv_store_policy", None)
    if pol is not None:
        return pol
    return "through" if getattr(args, "kv_store", True) else "off"


def make_llm(args: argparse.Namespace, **over):
    """An ``LLM`` from the options of :func:`add_engine_args` (an option missing from ``args``: the field's
    default); keywords in ``over`` (engine option names, see :func:`pagedkv.engine.config.engine_configs`) take
    precedence."""
    from .config import engine_configs
    from .llm import LLM

    kw = {f.name: getattr(args, f.name) for f in _cli_fields() if hasattr(args, f.name)}
    kw["enable_prefix_caching"] = not getattr(args, "no_prefix_caching", False)
    kw["kv_store"] = _store_policy(args)
    if "kv_load_max_ms_per_block" in kw and not kw["kv_load_max_ms_per_block"]:
        kw["kv_load_max_ms_per_block"] = None  # (0: always load)
    kw.update(over)
    return LLM(getattr(args, "model", None), **engine_configs(**kw))


def make_params(args: argparse.Namespace, **over):
    """``SamplingParams`` from the options of :func:`add_sampling_args`."""
    from .sampling import SamplingParams

    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              seed=args.seed)
    kw.update(over)
    return SamplingParams(**kw)
