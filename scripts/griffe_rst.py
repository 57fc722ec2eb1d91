"""A griffe extension for the API reference (mkdocs.yml): the docstrings are written in reStructuredText's inline
style (``code``, :class:`Name`, "text::" before an indented block) and mkdocstrings renders Markdown, so each
docstring is rewritten on load: a role becomes inline code of its target, a double-backquoted literal becomes
inline code, and a trailing "::" becomes ":" (the indented block after it is a code block in Markdown too).
The source files are not touched."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj|ref|doc):`~?\.?([^`]*)`")
_LITERAL = re.compile(r"``([^`]+?)``")
_BLOCK = re.compile(r"::\n", re.M)


def rst_to_markdown(text: str) -> str:
    """The Markdown form of a docstring's inline reStructuredText."""
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = _LITERAL.sub(lambda m: f"`{m.group(1)}`", text)
    return _BLOCK.sub(":\n", text)


class RstInline(griffe.Extension):
    """Rewrites every loaded docstring with :func:`rst_to_markdown`."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
