"""Every command's ``--help`` is plain text a terminal can show: no reStructuredText markup, a help text for every
option and argument, and the default of every option that has one. Runs each command's real ``--help`` in this
process (no model, no server: argparse exits before anything loads)."""

from __future__ import annotations

import argparse
import re

import pytest

from pagedkv._help import HelpFormatter, plain
from pagedkv.cli import main as cli_main

COMMANDS = [
    [], ["generate"], ["chat"], ["bench"], ["bench", "ablation"], ["bench", "sweep"], ["bench", "sweep", "report"],
    ["bench", "single"], ["bench", "throughput"], ["bench", "serve"], ["replay"], ["serve"], ["router"],
]
_RST = re.compile(r"``|::|:(?:mod|class|func|meth|attr|data|exc|obj|ref|doc):`")


def _problems(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """What is wrong with one parser's help (``text`` is what ``--help`` printed)."""
    out = []
    for m in _RST.finditer(text):
        line = text[: m.start()].count("\n")
        out.append(f"reStructuredText {m.group(0)!r} in line {line + 1}: {text.splitlines()[line].strip()!r}")
    fmt = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        name = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._SubParsersAction):
            out += [f"subcommand {a.dest} has no help" for a in action._choices_actions if not a.help]
            continue
        if not (action.help or "").strip():
            out.append(f"{name} has no help")
            continue
        for opt in action.option_strings:
            if opt not in text:
                out.append(f"{opt} not in the printed help")
        default = action.default
        if default in (None, False, argparse.SUPPRESS, [], ()):
            continue
        if "default" not in fmt._expand_help(action).lower():
            out.append(f"{name} does not show its default {default!r}")
    return out


@pytest.fixture
def printed(monkeypatch):
    """Records each parser whose help is printed."""
    seen: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.print_help

    def record(self, file=None):
        seen.append(self)
        return original(self, file)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", record)
    return seen


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "pagedkv")
def test_help_is_plain_text_with_help_and_defaults_for_every_option(cmd, printed, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main([*cmd, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert len(printed) == 1 and text.startswith("usage: ")
    parser = printed[0]
    assert issubclass(parser.formatter_class, HelpFormatter), f"pagedkv {' '.join(cmd)} uses {parser.formatter_class}"
    assert parser.description and parser.description.strip(), "no description"
    assert _problems(parser, text) == []


@pytest.mark.parametrize("module", ["pagedkv.replay.report", "pagedkv.bench.report"])
def test_module_commands_too(module, printed, capsys):
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    assert _problems(printed[0], capsys.readouterr().out) == []


def test_the_checks_catch_what_they_look_for(capsys):
    bad = argparse.ArgumentParser(prog="bad", description=":mod:`x`", formatter_class=argparse.HelpFormatter)
    bad.add_argument("--silent", type=int, default=3)
    bad.add_argument("--hidden-default", type=int, default=7, help="a number")
    bad.add_argument("pos")
    bad.print_help()
    found = _problems(bad, capsys.readouterr().out)
    assert any("reStructuredText" in p for p in found)
    assert "--silent has no help" in found and "pos has no help" in found
    assert any(p.startswith("--hidden-default does not show its default") for p in found)
    good = argparse.ArgumentParser(prog="good", description="x", formatter_class=HelpFormatter)
    good.add_argument("--n", type=int, default=7, help="a number")
    good.add_argument("--slack", type=float, default=0.2, help="how much (0.2)")
    good.print_help()
    text = capsys.readouterr().out
    assert "a number (default: 7)" in text and "how much (default: 0.2)" in text and "(0.2)" not in text
    assert _problems(good, text) == []


def test_plain_strips_markup_and_keeps_columns():
    doc = ("The ``pagedkv`` command (see :mod:`pagedkv.cli`, :class:`~pagedkv.manager.BlockManager`).\n\n"
           "Example::\n\n    pagedkv serve\n\n::\n\n    x\n\n``a``    one\n``bbb``  two\n")
    text = plain(doc)
    assert "The pagedkv command (see pagedkv.cli, BlockManager)." in text
    assert "Example:\n" in text and "::" not in text and "``" not in text
    rows = [line for line in text.splitlines() if line.endswith(("one", "two"))]
    assert rows == ["a        one", "bbb      two"]  # the second column stays aligned
