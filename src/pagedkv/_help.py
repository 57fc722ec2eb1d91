"""Plain-text ``--help`` for every ``pagedkv`` command: one formatter that shows each option's default, and
:func:`plain`, which turns a module docstring (reStructuredText) into the plain text a terminal shows.

Every command's parser is built with ``formatter_class=HelpFormatter`` and ``description=plain(__doc__)``;
``tests/test_help.py`` runs every command's ``--help`` and checks both.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["HelpFormatter", "plain"]

_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj|ref|doc):`([^`]*)`")
_LITERAL = re.compile(r"``(.+?)``", re.S)
_LITERAL_IN_COLUMN = re.compile(r"``([^`\n]+?)``(?=  )")


def _role_text(m: re.Match) -> str:
    text = m.group(1)
    if "<" in text and text.endswith(">"):  # :ref:`words <target>`
        return text[: text.index("<")].strip()
    if text.startswith("~"):  # :class:`~a.b.C` shows C
        return text[1:].rsplit(".", 1)[-1]
    return text.lstrip(".")


def plain(text: str | None) -> str:
    """``text`` without reStructuredText markup: roles (``:mod:`x```) become their target's name, double
    backquotes are dropped (padded where they end an aligned column), a line that is only ``::`` goes and a trailing ``::`` becomes ``:``. Line breaks
    and indentation are kept (the formatter prints the description as it is). O(len(text))."""
    if not text:
        return ""
    text = _ROLE.sub(_role_text, text)
    text = _LITERAL_IN_COLUMN.sub(r"\1    ", text)  # keeps the column of an aligned list
    text = _LITERAL.sub(r"\1", text)
    out = []
    for line in text.splitlines():
        if line.strip() == "::":
            continue
        if line.rstrip().endswith("::"):
            line = line.rstrip()[:-1]
        out.append(line)
    return "\n".join(out).strip("\n") + "\n"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (see :func:`plain`); each option's help followed by ``(default: X)``.

    The default is left out where it says nothing (None, False of a flag, an empty list) and where the help
    already names it (it contains "default"); a help that ends with the default in parentheses, ``(0.2)``, gets
    ``(default: 0.2)`` instead.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or default == [] or default == ()
                or "default" in help_text.lower() or "%(default)" in help_text):
            return help_text
        if isinstance(default, (list, tuple)):
            shown = " ".join(str(d) for d in default)
        elif isinstance(default, float):
            shown = format(default, "g")  # 50000.0 -> 50000
        else:
            shown = str(default)
        tail = f"({shown})"
        if help_text.rstrip().endswith(tail):
            return help_text.rstrip()[: -len(tail)] + f"(default: {shown})".replace("%", "%%")
        return (help_text + " " if help_text else "") + f"(default: {shown})".replace("%", "%%")
