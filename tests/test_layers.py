"""The package's layering, checked statically (ast, no imports, well under a second): no import cycle between the
modules of src/pagedkv, and every import allowed by the layer table of docs/design.md (the table is read from the
document, so the picture there and the code cannot drift apart)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DESIGN = ROOT / "docs" / "design.md"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    mods = {}
    for path in sorted((SRC / "pagedkv").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _imports(name: str, path: Path, is_pkg: bool, mods) -> set[str]:
    """The pagedkv modules that ``name`` imports anywhere in its file (top level, functions, TYPE_CHECKING)."""

    def known(dotted: str) -> str | None:  # the module itself, or the nearest enclosing module
        while dotted not in mods and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        return dotted if dotted in mods else None

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule; `from pkg import name` imports pkg itself
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] == "pagedkv":
                m = known(t)
                if m is not None and m != name:
                    out.add(m)
    return out


MODS = _modules()
GRAPH = {name: _imports(name, path, is_pkg, MODS) for name, (path, is_pkg) in MODS.items()}


def _layer_table(tag: str = "layers") -> dict[str, list[str]]:
    text = DESIGN.read_text()
    m = re.search(rf"<!-- {tag} -->(.*?)<!-- /{tag} -->", text, re.S)
    assert m, f"docs/design.md has no <!-- {tag} --> table"
    table = {}
    for line in m.group(1).strip().splitlines()[2:]:
        layer, allowed = [c.strip() for c in line.strip().strip("|").split("|")]
        table[layer.strip("`")] = [a.strip().strip("`") for a in allowed.split(",")]
    return table


TABLE = _layer_table()
CORE_TABLE = _layer_table("core-layers")  # the core's folders; "vocabulary": the root's modules


def _layer_of(module: str) -> str:
    best = "core"
    for layer in TABLE:
        if layer != "core" and (module == layer or module.startswith(layer + ".")):
            if best == "core" or len(layer) > len(best):
                best = layer
    return best


def _allowed(src: str, dst: str) -> bool:
    layer, target = _layer_of(src), _layer_of(dst)
    if layer == target:
        return True
    for a in TABLE[layer]:
        if a == "anything":
            return True
        if a == "core" and target == "core":
            return True
        if a != "core" and (dst == a or dst.startswith(a + ".")):
            return True
    return False


def test_the_graph_is_read():
    # the reader finds what it must, or every other test here would pass vacuously
    assert len(MODS) > 60
    assert "pagedkv.manager" in GRAPH["pagedkv"]
    assert "pagedkv.engine.options" in GRAPH["pagedkv.cli"]
    assert {"pagedkv.cluster.index", "pagedkv.replay.trace"} <= GRAPH["pagedkv.replay.cluster"]
    assert "pagedkv.scheduler" in GRAPH["pagedkv.engine.core"]  # an import inside a function counts
    assert _layer_of("pagedkv.manager._step") == "core" and _layer_of("pagedkv.bench.anchors._base") == "pagedkv.bench"
    assert not _allowed("pagedkv.manager", "pagedkv.engine.llm")
    assert _allowed("pagedkv.replay.__main__", "pagedkv.bench.anchors")
    assert not _allowed("pagedkv.replay.__main__", "pagedkv.bench.harness")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_import_follows_the_layer_table_of_design_md():
    bad = sorted(f"{src} -> {dst}" for src, dsts in GRAPH.items() for dst in dsts if not _allowed(src, dst))
    assert not bad, "imports that docs/design.md's layer table does not allow:\n" + "\n".join(bad)


@pytest.mark.parametrize("lower, upper", [
    ("core", "pagedkv.scheduler"), ("core", "pagedkv.engine"), ("core", "pagedkv.server"),
    ("core", "pagedkv.router"), ("core", "pagedkv.bench"), ("core", "pagedkv.replay"), ("core", "pagedkv.cluster"),
    ("pagedkv.scheduler", "pagedkv.engine"), ("pagedkv.engine", "pagedkv.server"),
    ("pagedkv.engine", "pagedkv.router"), ("pagedkv.server", "pagedkv.router"), ("pagedkv.cluster", "pagedkv.replay"),
    ("pagedkv.bench", "pagedkv.replay"), ("pagedkv.replay", "pagedkv.engine"), ("pagedkv.cluster", "pagedkv.router"),
])
def test_the_table_keeps_the_stated_order(lower, upper):
    # the table itself may not be loosened to let a lower layer import a higher one
    allowed = TABLE[lower]
    assert "anything" not in allowed and upper not in allowed
    assert not any(upper.startswith(a + ".") for a in allowed if a != "core")


def test_every_layer_of_the_table_exists():
    for layer in TABLE:
        assert layer == "core" or layer in MODS, f"design.md names {layer}, which is not a module"


def _core_layer_of(module: str) -> str:
    best = "vocabulary"
    for layer in CORE_TABLE:
        if layer != "vocabulary" and (module == layer or module.startswith(layer + ".")):
            best = layer if best == "vocabulary" or len(layer) > len(best) else best
    return best


def _core_allowed(src: str, dst: str) -> bool:
    if src == "pagedkv":  # the package's __init__: re-exports the public names of every part
        return True
    layer, target = _core_layer_of(src), _core_layer_of(dst)
    return layer == target or target in CORE_TABLE[layer] or (target == "vocabulary" and "vocabulary" in CORE_TABLE[layer])


def test_the_core_folders_follow_the_core_table_of_design_md():
    core = [m for m in GRAPH if _layer_of(m) == "core"]
    assert {"pagedkv.manager.core", "pagedkv.hybrid.core", "pagedkv.blocks.pool", "pagedkv.tiers.cpu",
            "pagedkv.retention.eviction", "pagedkv.types"} <= set(core)
    bad = sorted(f"{s} -> {d}" for s in core for d in GRAPH[s] if _layer_of(d) == "core" and not _core_allowed(s, d))
    assert not bad, "imports that docs/design.md's core-layers table does not allow:\n" + "\n".join(bad)


def test_the_core_table_is_strict():
    # the leaves import nothing above them; the manager never imports the hybrid coordinator
    assert _core_layer_of("pagedkv.blocks.pool") == "pagedkv.blocks" and _core_layer_of("pagedkv.errors") == "vocabulary"
    assert not _core_allowed("pagedkv.blocks.pool", "pagedkv.manager.core")
    assert not _core_allowed("pagedkv.manager.core", "pagedkv.hybrid.core")
    assert not _core_allowed("pagedkv.types", "pagedkv.blocks.pool")
    assert _core_allowed("pagedkv.hybrid._seqs", "pagedkv.manager._invariants")
    for layer in CORE_TABLE:
        assert layer == "vocabulary" or layer in MODS, f"design.md names {layer}, which is not a module"
