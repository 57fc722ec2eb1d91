"""BlockManager and HybridBlockManager are compositions of parts with explicit state (docs/design.md, "The manager
in parts"): the one facade's only bases are stateless (``manager/parts.py``'s ``Surface``: properties, the named parts and
the deprecated old names; ``manager/_offstep.py``'s ``OffStep``: the calls off a plain request's path), the many-group manager is its subclass, each part holds the objects it works on, and no part reads another
part's private (underscore) state. Checked statically on the part modules (ast, no imports) and on live
managers. A stricter rule holds for every core module (the parts, the coordinator's parts ``_hybrid_*.py`` and the
leaf structures: BlockPool, PrefixCache, CpuTier, the evictors): it reads no underscore attribute of any object
but ``self`` (the leaves' shared fields are documented public attributes), except a class of the same module; the
hybrid facade reads its group managers' internals only where it wires its parts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagedkv import BlockManager, FullAttentionSpec, HybridBlockManager, SlidingWindowSpec
from pagedkv.manager.parts import Surface
from pagedkv.manager._offstep import OffStep
from pagedkv.manager._rows import Views
from pagedkv.manager._small import LifeCalls
from pagedkv.manager._step import AppendCalls
from pagedkv.hybrid import GroupedManager

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedkv"
PART_MODULES = ["manager/_rows", "blocks/pool", "manager/_window", "manager/_registry", "manager/_step",
                "manager/_small", "manager/_alloc", "manager/_swap", "manager/_invariants", "manager/_external",
                "manager/_stores",
                "hybrid/_retention"]
# attributes under which a part holds another part (and the locals the hot functions bind them to)
PART_ATTRS = {"t", "tb", "blocks", "win", "reg", "step", "small", "alloc", "swap"}


# the coordinator's parts (HybridBlockManager)
HYBRID_MODULES = ["hybrid/_types", "hybrid/_step", "hybrid/_swap", "hybrid/_seqs", "hybrid/_allocator", "hybrid/_hit"]
# every core module (not the engine, server, router, scheduler, bench or replay packages): the root's modules and
# the core's folders (the manager, the hybrid coordinator, the per-block leaves, retention, the CPU tier)
CORE_DIRS = ("manager", "hybrid", "blocks", "retention")
CORE_MODULES = sorted([p.stem for p in SRC.glob("*.py") if p.stem not in ("__init__", "__main__", "cli")]
                      + [f"{d}/{p.stem}" for d in CORE_DIRS for p in (SRC / d).glob("*.py") if p.stem != "__init__"]
                      + ["tiers/cpu"])
# private attributes a module reads on objects of another class of the same module
SAME_MODULE = {"blocks/prefix_cache": {"_data"}}  # (_GroupNS's encoding, read by _encode_namespace and __eq__)
# functions that wire parts and so read the parts' objects' internals
WIRING = {"hybrid/core": ("__init__", "_wire")}
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # (public methods of NamedTuple results)


def _foreign_private_reads(path: Path, allowed: frozenset | set = frozenset(), skip: tuple = ()) -> list[str]:
    """``<x>._y`` reads in a module where ``<x>`` is anything but the bare name ``self`` (y private, not a
    dunder, not in ``allowed``), outside the functions named in ``skip``."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in skip:
            skipped.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if id(node) in skipped or node.attr in allowed or node.attr in NAMEDTUPLE_API:
            continue
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            continue
        out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return out


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


@pytest.mark.parametrize("module", CORE_MODULES)
def test_no_core_module_reads_another_objects_private_state(module):
    assert _foreign_private_reads(SRC / f"{module}.py", SAME_MODULE.get(module, set()), WIRING.get(module, ())) == []


def test_the_strict_check_covers_the_parts_and_the_leaves():
    assert set(PART_MODULES) | set(HYBRID_MODULES) | {"blocks/pool", "blocks/prefix_cache", "tiers/cpu",
                                                      "blocks/evictor", "hybrid/core", "manager/core"} <= set(CORE_MODULES)
    # the hybrid facade does read its group managers' internals, but only in its wiring
    assert _foreign_private_reads(SRC / "hybrid/core.py") and not _foreign_private_reads(
        SRC / "hybrid/core.py", skip=WIRING["hybrid/core"])


def test_the_strict_checker_finds_foreign_reads(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class P:\n    def _wire(self):\n        self.t = self.m._t\n"
                   "    def f(self, m):\n        return self._own, m._t, self.t._x, self.gpu._ref, self.t.ok\n")
    assert _foreign_private_reads(bad, {"_ref"}, skip=("_wire",)) == ["bad.py:5 m._t", "bad.py:5 self.t._x"]
    assert _foreign_private_reads(bad) == ["bad.py:3 self.m._t", "bad.py:5 m._t", "bad.py:5 self.t._x",
                                           "bad.py:5 self.gpu._ref"]


def test_the_checker_finds_a_private_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class P:\n    def f(self):\n        t = self.t\n        return self.t._ntok, t._nblk, self.t.ntok\n")
    assert _private_reads(bad) == ["bad.py:4 self.t._ntok", "bad.py:4 t._nblk"]


def test_the_facades_only_bases_are_the_stateless_shared_surface_and_it_wires_its_own_parts():
    # the only bases: the calls and views written beside their parts, and the surface, all stateless (empty
    # __slots__, no __init__, no class data); the many-group manager is the one class's subclass
    bases = (Views, AppendCalls, LifeCalls, Surface, OffStep)
    assert BlockManager.__bases__ == bases and GroupedManager.__bases__ == (BlockManager,)
    for base in bases:
        assert base.__bases__ == (object,) and base.__slots__ == () and "__init__" not in vars(base)
        assert all(callable(v) or isinstance(v, property) for k, v in vars(base).items() if not k.startswith("__"))
    a = BlockManager(64, 4, enable_prefix_caching=True, sliding_window=8)
    b = BlockManager(64, 4, enable_prefix_caching=True)
    for part in (a._step, a._small, a._alloc, a._swap, a._reg, a._win):
        assert part.t is a._t and part.blocks is a._blocks  # every part works on this manager's tables and blocks
    assert a._step.win is a._win and a._step.reg is a._reg and a._alloc.reg is a._reg
    assert a._win.window == 8 and b._win.window is None
    assert a._t is not b._t and a._blocks is not b._blocks


def test_kv_cache_groups_share_blocks_and_cache_but_not_tables():
    m = BlockManager(64, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(8)],
                           enable_prefix_caching=True, grouped_results=True)
    g0, g1 = m._g
    assert g0._blocks is g1._blocks and g0._cache is g1._cache and g0._copies is g1._copies
    assert g0._t is not g1._t and g0._win is not g1._win
    assert type(g1._win).__name__ == "RetainingWindow" and g1._win.retention is not None and g1._win.k == 2
    m.allocate("a", list(range(10)))
    m.decode_step(["a"], [1])
    assert g0._t.row_of == g1._t.row_of and int(g0._t.ntok[g0._t.row_of["a"]]) == 11
    m.check_invariants()


def test_the_coordinator_parts_work_on_the_group_managers_parts():
    m = BlockManager(64, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(8), FullAttentionSpec()],
                           enable_prefix_caching=True, num_cpu_blocks=16, grouped_results=True)
    assert GroupedManager.__bases__ == (BlockManager,)  # (the one class's many-group case)
    tables = [g._t for g in m._g]
    for part in (m._alloc, m._step, m._swap, m._seqs):
        assert all(a is b for a, b in zip(part.tables, tables)) and len(part.tables) == 3
        assert part.blocks is m._g[0]._blocks and part.blocks is m._g[2]._blocks
    assert [s is g._step for s, g in zip(m._step.steps, m._g)] == [True] * 3
    assert [s is g._swap for s, g in zip(m._swap.swaps, m._g)] == [True] * 3
    assert [a is g._alloc for a, g in zip(m._alloc.allocs, m._g)] == [True] * 3
    assert m._step.wins[0] is None and m._step.wins[1] is m._g[1]._win and m._step.wins[2] is None
    assert m._alloc.full == [0, 2] and m._alloc.sliding == [1] and m._alloc.sib is not None
    assert m._seqs.retention is m._alloc.retention is m._g[1]._win.retention is not None
    m.allocate("a", list(range(18)))
    m.decode_step(["a"], [1])
    m.swap_out(["a"])
    m.swap_in(["a"])
    m.fork("a", "b")
    m.free("a")
    assert [int(t.ntok[t.row_of["b"]]) for t in tables] == [19, 19, 19]
    m.check_invariants()


def _views_reads(path: Path) -> list[str]:
    """Reads of a SeqTables' memoryviews (``X.views()``, ``X.mvs``, ``X.mvs or X.views()``) that are not by name:
    an index, a slice or an unpacking (RowViews is a slotted object: each would fail when it runs)."""

    def is_views(node) -> bool:
        if isinstance(node, ast.BoolOp):
            return all(is_views(v) for v in node.values)
        if isinstance(node, ast.Call):
            node = node.func
            return isinstance(node, ast.Attribute) and node.attr == "views"
        return isinstance(node, ast.Attribute) and node.attr == "mvs"

    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Subscript) and is_views(node.value):
            out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.Assign) and is_views(node.value) and isinstance(node.targets[0], ast.Tuple):
            out.append(f"{path.name}:{node.lineno} unpacks {ast.unparse(node.targets[0])}")
    return out


@pytest.mark.parametrize("module", CORE_MODULES)
def test_row_views_are_read_by_name(module):
    """SeqTables.views() is a RowViews, read by field name (``v.table``), never by position."""
    assert _views_reads(SRC / f"{module}.py") == []


def test_the_views_check_catches_positional_reads(tmp_path):
    from pagedkv.manager._rows import RowViews

    assert not isinstance(RowViews.__new__(RowViews), tuple) and not hasattr(RowViews, "__iter__")
    bad = tmp_path / "bad.py"
    bad.write_text("a = t.views()[2]\nb, c = (t.mvs or t.views())[:2]\nntok, table, *_ = t.mvs\n"
                   "v = t.mvs or t.views()\nntok, table = v.ntok, v.table\n")
    assert sorted(r.split()[0] for r in _views_reads(bad)) == ["bad.py:1", "bad.py:2", "bad.py:3"]
