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


# ---------------------------------------------------------------------------------------------------------------
# The server and the router drive the engine through its public API only (pagedkv.engine.core.EngineCore and
# LLM's public attributes): no call or read of an engine object's ``_private`` attribute, no import of an engine
# module's private name. The server's own privates (``self._lock``, ``stream._push``) are its business.

def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_privates(folder: Path) -> set[str]:
    """The private names a package (or one module) defines: methods and functions, class attributes and
    ``self._x = ...``."""
    out: set[str] = set()
    for path in (folder.rglob("*.py") if folder.is_dir() else [folder]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                out.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                out.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _private(node.target.id):
                out.add(node.target.id)
    return out


ENGINE_NAMES = ("llm", "core", "engine_core")  # what the server calls its engine objects (``self.llm``, ``core``)


def _engine_receiver(node: ast.expr) -> bool:
    """Whether an expression names an engine object: ``llm``, ``self.llm``, ``engine.core``, ``self.core``..."""
    if isinstance(node, ast.Name):
        return node.id in ENGINE_NAMES
    return isinstance(node, ast.Attribute) and node.attr in ENGINE_NAMES


def _own(node: ast.expr) -> bool:
    """``self`` / ``cls`` / ``super()``: the class's own attribute."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def private_engine_uses(source: str, engine_privates: set[str], own_privates: set[str],
                        module: str = "pagedkv.server.x") -> list[str]:
    """``line: what`` for every use of an engine object's private attribute in ``source`` (a server or router
    module): ``X._name`` or ``getattr(X, "_name")`` where X names an engine object (see :func:`_engine_receiver`),
    or whose name is private to the engine and not defined by the server or the router themselves, and
    ``from <engine module> import _name``."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        target = attr = None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            target, attr = node.value, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "hasattr", "setattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            target, attr = node.args[0], node.args[1].value
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "pagedkv.engine" or mod.startswith("pagedkv.engine."):
                bad += [(node.lineno, f"from {mod} import {a.name}") for a in node.names if _private(a.name)]
            continue
        if target is None or _own(target):
            continue
        if _engine_receiver(target) or (attr in engine_privates and attr not in own_privates):
            bad.append((node.lineno, f"{ast.unparse(target)}.{attr}"))
    return [f"{line}: {what}" for line, what in sorted(bad)]


def test_the_private_use_finder_finds_them_and_only_them():
    engine_privates, own = {"_execute", "_add", "_lock", "_request_pins"}, {"_lock", "_push"}
    src = ("self.llm._execute(plan)\nllm._add(r)\nengine.core._tables\nx = getattr(self.llm, '_wait_for_loads', None)\n"
           "stream._request_pins.admit()\nfrom ..engine.llm import _Request\n"
           # not flagged: the server's own privates, a public call, another object's private of the server's
           "self._lock\nengine._lock\nlive.stream._push(item)\nself.core.step()\nsuper()._run(send)\nos._exit(1)\n")
    got = private_engine_uses(src, engine_privates, own, "pagedkv.server.async_engine")
    assert got == ["1: self.llm._execute", "2: llm._add", "3: engine.core._tables",
                   "4: self.llm._wait_for_loads", "5: stream._request_pins",
                   "6: from pagedkv.engine.llm import _Request"], got


def test_server_and_router_use_only_the_engine_public_api():
    engine_privates = _defined_privates(SRC / "pagedkv" / "engine")
    own = _defined_privates(SRC / "pagedkv" / "server") | _defined_privates(SRC / "pagedkv" / "router")
    assert {"_execute", "_thread_policy", "_sample_faults"} <= engine_privates  # (the finder reads the engine)
    bad = []
    for pkg in ("server", "router"):
        for path in sorted((SRC / "pagedkv" / pkg).rglob("*.py")):
            module = ".".join(path.relative_to(SRC).with_suffix("").parts)
            bad += [f"{path.relative_to(ROOT)}:{b}" for b in private_engine_uses(path.read_text(), engine_privates,
                                                                                  own, module)]
    assert not bad, "the server or router uses an engine object's private attribute:\n" + "\n".join(bad)


def test_llm_drives_the_engine_core_through_its_public_api():
    # the LLM facade is a client of the core like the server: no ``self.core._x``, no core private by name
    llm = SRC / "pagedkv" / "engine" / "llm.py"
    core = _defined_privates(SRC / "pagedkv" / "engine" / "core.py")
    assert {"_execute", "_requests", "_sample_faults"} <= core
    bad = private_engine_uses(llm.read_text(), core, _defined_privates(llm), "pagedkv.engine.llm")
    assert not bad, "LLM uses the engine core's private attributes:\n" + "\n".join(bad)
