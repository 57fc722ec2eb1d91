"""BlockManager is a composition of parts with explicit state (docs/design.md, "The manager in parts"): the
facade has no mixin bases, each part holds the objects it works on, and no part reads another part's private
(underscore) state. Checked statically on the part modules (ast, no imports) and on live managers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagedkv import BlockManager, FullAttentionSpec, HybridBlockManager, SlidingWindowSpec

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedkv"
PART_MODULES = ["_rows", "_blocks", "_window", "_registry", "_step", "_small", "_alloc", "_swap", "_invariants",
                "_retention"]
# attributes under which a part holds another part (and the locals the hot functions bind them to)
PART_ATTRS = {"t", "tb", "blocks", "win", "reg", "step", "small", "alloc", "swap"}


def _private_reads(path: Path) -> list[str]:
    """``self.<part>._x`` and ``<part local>._x`` reads in a module (x private, not a dunder)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        v = node.value
        if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self" \
                and v.attr in PART_ATTRS:
            out.append(f"{path.name}:{node.lineno} self.{v.attr}.{node.attr}")
        elif isinstance(v, ast.Name) and v.id in PART_ATTRS:
            out.append(f"{path.name}:{node.lineno} {v.id}.{node.attr}")
    return out


@pytest.mark.parametrize("module", PART_MODULES)
def test_no_part_reads_another_parts_private_state(module):
    assert _private_reads(SRC / f"{module}.py") == []


def test_the_checker_finds_a_private_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class P:\n    def f(self):\n        t = self.t\n        return self.t._ntok, t._nblk, self.t.ntok\n")
    assert _private_reads(bad) == ["bad.py:4 self.t._ntok", "bad.py:4 t._nblk"]


def test_the_facade_has_no_mixins_and_wires_its_own_parts():
    assert BlockManager.__bases__ == (object,)
    a = BlockManager(64, 4, enable_prefix_caching=True, sliding_window=8)
    b = BlockManager(64, 4, enable_prefix_caching=True)
    for part in (a._step, a._small, a._alloc, a._swap, a._reg, a._win):
        assert part.t is a._t and part.blocks is a._blocks  # every part works on this manager's tables and blocks
    assert a._step.win is a._win and a._step.reg is a._reg and a._alloc.reg is a._reg
    assert a._win.window == 8 and b._win.window is None
    assert a._t is not b._t and a._blocks is not b._blocks


def test_kv_cache_groups_share_blocks_and_cache_but_not_tables():
    m = HybridBlockManager(64, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(8)],
                           enable_prefix_caching=True)
    g0, g1 = m._g
    assert g0._blocks is g1._blocks and g0._cache is g1._cache and g0._copies is g1._copies
    assert g0._t is not g1._t and g0._win is not g1._win
    assert type(g1._win).__name__ == "RetainingWindow" and g1._win.retention is not None and g1._win.k == 2
    m.allocate("a", list(range(10)))
    m.decode_step(["a"], [1])
    assert g0._t.row_of == g1._t.row_of and int(g0._t.ntok[g0._t.row_of["a"]]) == 11
    m.check_invariants()
