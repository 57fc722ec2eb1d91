"""Rewrite uses of BlockManager's old surface to the new spelling (the named parts: ``bm.config``, ``bm.external``,
``bm.retention``, ``bm.events``, and ``bm.stats`` for the pool readings).

The table is :data:`pagedkv.manager.parts.DEPRECATED` (old name -> new spelling), the same the deprecation fallback
answers with. A use is ``RECEIVER.old_name`` where the receiver's last name looks like a block manager (``bm``,
``hm``, ``mgr``, ``manager``, ``block_manager``, ``*_bm``, ``bms[...]``; add your own with ``--receiver``), so
``spec.sliding_window`` or ``cfg.num_gpu_blocks`` are left alone. ``BlockManager(..., grouped_results=True)`` becomes
``BlockManager(..., grouped_results=True)`` (the same manager) and ``x.config.grouped_results``
``x.config.grouped_results`` (``--no-constructors``: left alone). ``atomic_append`` and ``take_copies`` have no
new spelling: they are listed, never rewritten. Idempotent: ``bm.config.num_gpu_blocks`` is not matched again.

Usage::

    python scripts/migrate_surface.py src/ tests/            # rewrite in place, print what changed
    python scripts/migrate_surface.py --check src/ tests/    # list the remaining old uses; exit 1 if any
    python scripts/migrate_surface.py --receiver 'm|self\\.m' tests/test_x.py   # more receiver names

Files: ``.py`` and ``.md`` under the given paths (a file path is taken as it is).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

try:
    from pagedkv.manager.parts import DEPRECATED
except ImportError:  # (run from a checkout without the package installed)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from pagedkv.manager.parts import DEPRECATED

#: the receiver's last name: what a block manager is usually called
RECEIVERS = r"bm|hm|mgr|manager|block_manager|[A-Za-z_]\w*_bm|bms\[[^\]\n]*\]"


def table() -> dict[str, str | None]:
    """Old name -> new spelling (None: no new spelling, only reported)."""
    return dict(DEPRECATED)


def pattern(receivers: str) -> re.Pattern:
    """``(prefix)(receiver).(old)`` with the receiver's last name one of ``receivers``, not part of a longer
    name, and not itself an attribute of a named part (``bm.config.x`` is not a use)."""
    names = "|".join(sorted(map(re.escape, table()), key=len, reverse=True))
    return re.compile(rf"(?<![\w.])((?:[A-Za-z_]\w*(?:\[[^\]\n]*\])?\.)*?(?:{receivers}))\.({names})\b")


def rewrite(text: str, pat: re.Pattern) -> tuple[str, int]:
    """The text with every rewritable use replaced, and how many were."""
    new_of = table()
    n = 0

    def sub(m: re.Match) -> str:
        nonlocal n
        new = new_of[m.group(2)]
        if new is None:
            return m.group(0)
        n += 1
        return f"{m.group(1)}.{new}"

    return pat.sub(sub, text), n


_CTOR = re.compile(r"(?<![\w.])(?<!class )(?:pagedkv\.)?HybridBlockManager\(")
_ISINST = re.compile(r"isinstance\(([A-Za-z_][\w.]*(?:\[[^\]\n]*\])?), (?:pagedkv\.)?HybridBlockManager\)")


def rewrite_constructors(text: str) -> tuple[str, int]:
    """``HybridBlockManager(args)`` -> ``BlockManager(args, grouped_results=True)`` (the exact equivalent: the
    many-group manager for one group too) and ``isinstance(x, HybridBlockManager)`` ->
    ``x.config.grouped_results``; how many were rewritten. A ``class HybridBlockManager(`` line is left alone, and
    so are imports (the alias still exists)."""
    out, n, pos = [], 0, 0
    for m in _CTOR.finditer(text):
        if m.start() < pos:
            continue
        depth, i = 1, m.end()
        while i < len(text) and depth:  # the matching parenthesis (strings with parentheses are rare here)
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        if depth:
            continue
        args = text[m.end(): i - 1]
        if "grouped_results" not in args:
            stripped = args.rstrip()
            tail = args[len(stripped):]
            args = f"{stripped}{'' if stripped.endswith(',') else ','} grouped_results=True{tail}" if stripped \
                else "grouped_results=True"
        name = "pagedkv.BlockManager(" if m.group(0).startswith("pagedkv.") else "BlockManager("
        out += [text[pos: m.start()], name, args, ")"]
        pos, n = i, n + 1
    out.append(text[pos:])
    text = "".join(out)
    text, k = _ISINST.subn(r"\1.config.grouped_results", text)
    return text, n + k


def uses(text: str, pat: re.Pattern) -> list[tuple[int, str]]:
    """(line number, use) of every old name left."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in pat.finditer(text)]


def files(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.suffix in (".py", ".md") and ".venv" not in f.parts
                          and f.resolve() != Path(__file__).resolve())
        else:
            out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="files or folders (.py and .md files under them)")
    ap.add_argument("--check", action="store_true", help="change nothing; list the old uses left, exit 1 if any")
    ap.add_argument("--receiver", default="", help="extra receiver names, a regex alternation (e.g. 'm|self\\.m')")
    ap.add_argument("--no-constructors", dest="constructors", action="store_false",
                    help="leave BlockManager(..., grouped_results=True) calls and isinstance checks alone")
    args = ap.parse_args(argv)
    pat = pattern(RECEIVERS + (f"|{args.receiver}" if args.receiver else ""))
    left = changed = 0
    for f in files(args.paths):
        text = f.read_text()
        if args.check:
            for m in _CTOR.finditer(text):
                print(f"{f}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}...) -> BlockManager(..., "
                      "grouped_results=True)")
                left += 1
            for line, use in uses(text, pat):
                new = table()[use.rsplit(".", 1)[1]]
                print(f"{f}:{line}: {use} -> {'.' + new if new else '(no new spelling: see its deprecation)'}")
                left += 1
            continue
        out, n = rewrite(text, pat)
        if args.constructors:
            out, k = rewrite_constructors(out)
            n += k
        if n:
            f.write_text(out)
            print(f"{f}: {n} rewritten")
            changed += n
        left += len(uses(out, pat))
    if args.check:
        print(f"{left} old uses left")
        return 1 if left else 0
    print(f"{changed} rewritten; {left} left (no new spelling: atomic_append, take_copies)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
