"""``pagedkv router``'s options are declared once: each is a field of :class:`pagedkv.router.config.RouterConfig`
(or one of the HTTP deadlines of :mod:`pagedkv.server.http_options`), and an option it shares with ``pagedkv serve``
or the engine commands points to their declaration (``same_as``) instead of repeating it. Parsers only, no server."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedkv._cli_config import (ServiceConfig, add_config_args, config_from_args, flag, option, option_keywords,
                                 same_as)
from pagedkv.errors import InvalidArgumentError
from pagedkv.router.cli import build_parser as router_parser
from pagedkv.router.config import RouterConfig
from pagedkv.server.cli import build_parser as serve_parser


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def _http_flags() -> set[str]:
    from pagedkv.server.http_options import add_http_args

    p = argparse.ArgumentParser(add_help=False)
    add_http_args(p)
    return set(_flags(p))


def _engine_parser() -> argparse.ArgumentParser:
    from pagedkv.engine.options import add_engine_args, add_sampling_args

    p = argparse.ArgumentParser(add_help=False)  # (the options of generate, chat, bench throughput)
    add_engine_args(p)
    add_sampling_args(p)
    return p


def redeclared(cls: type, others: list[argparse.ArgumentParser]) -> list[str]:
    """The options that ``cls`` declares itself (``option``, not ``same_as``) though another command already has
    one of that name: a second declaration."""
    taken = set().union(*(_flags(p) for p in others))
    return sorted(flag(f.name) for f in dataclasses.fields(cls)
                  if "same_as" not in f.metadata and flag(f.name) in taken)


def test_the_router_parser_is_its_config_and_the_http_options():
    fields = {flag(f.name) for f in dataclasses.fields(RouterConfig)}
    assert set(_flags(router_parser())) == fields | _http_flags()
    assert not fields & _http_flags()
    assert len(fields) == 31  # (the 24 the router declares, the 7 it shares)


def test_no_router_option_repeats_one_of_serve_or_the_engine():
    assert redeclared(RouterConfig, [serve_parser(), _engine_parser()]) == []
    shared = {flag(f.name) for f in dataclasses.fields(RouterConfig) if "same_as" in f.metadata}
    assert shared == {"--host", "--port", "--api-key", "--max-body-bytes", "--kv-events-topic", "--model",
                      "--block-size"}
    assert shared <= set(_flags(serve_parser()))


def test_the_check_finds_a_second_declaration():
    # a config that spells serve's --max-waiting and --host itself, and --port through ServiceConfig
    @dataclasses.dataclass(frozen=True)
    class Repeats:
        max_waiting: int = option(256, "requests allowed to wait")
        host: str = option("127.0.0.1", "address to bind")
        port: int = same_as(ServiceConfig, "port")
        backend: tuple = option((), "a replica", many=True)

    assert redeclared(Repeats, [serve_parser()]) == ["--host", "--max-waiting"]
    with pytest.raises(argparse.ArgumentError):  # (and within one parser argparse refuses a second --host)
        add_config_args(serve_parser(), Repeats)


def test_a_shared_option_shows_its_declaration():
    router, serve = _flags(router_parser()), _flags(serve_parser())
    for f in dataclasses.fields(RouterConfig):
        if "same_as" not in f.metadata:
            continue
        mine, theirs = router[flag(f.name)], serve[flag(f.name)]
        assert mine.help.startswith(theirs.help), f.name  # (the router may add a note after it)
        assert (mine.type, mine.choices, mine.metavar) == (theirs.type, theirs.choices, theirs.metavar), f.name
        if f.name != "port":  # (the router's own port default)
            assert mine.default == theirs.default, f.name
    assert router["--port"].default == 8080 and serve["--port"].default == 8000
    for f in dataclasses.fields(ServiceConfig):  # serve derives these five from the same declaration
        assert serve[flag(f.name)].help == option_keywords(ServiceConfig, f.name)["help"]


def test_defaults_parse_to_the_config_defaults():
    cfg = config_from_args(RouterConfig, router_parser().parse_args([]))
    assert cfg == RouterConfig()
    a = router_parser().parse_args(["--backend", "http://a", "--backend", "http://b", "--port", "0", "--min-match",
                                    "0.5", "--model", "gemma-3-270m", "--block-size", "32"])
    cfg = config_from_args(RouterConfig, a)
    assert cfg.backend == ("http://a", "http://b") and cfg.port == 0 and cfg.min_match == 0.5
    assert cfg.model == "gemma-3-270m" and cfg.block_size == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1


@pytest.mark.parametrize("kw, message", [
    ({"port": 70000}, "--port must lie in [0, 65535]"),
    ({"api_key": " "}, "--api-key must not be empty"),
    ({"max_body_bytes": 10}, "--max-body-bytes must be >= 1024"),
    ({"max_body_bytes": 0}, "--max-body-bytes must be >= 1"),
    ({"block_size": 0}, "block_size must be an int >= 1"),
    ({"min_match": 1.5}, "--min-match must lie in [0, 1]"),
    ({"disk_weight": -0.1}, "--disk-weight must lie in [0, 1]"),
    ({"health_fails": 0}, "--health-fails >= 1"),
    ({"vllm_hash_seed": "3"}, "need --hash-scheme vllm"),
    ({"route": "random"}, "--route must be one of"),
])
def test_a_bad_value_names_its_option(kw, message):
    with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RouterConfig(**kw)
