"""Load a few modules of an installed engine package without running its package ``__init__``.

The anchors' block managers live inside large engine packages (vLLM, nano-vllm) whose top-level
``__init__`` imports the whole engine: model code, CUDA kernels, tokenizers, an HTTP server.  Only
the block-manager modules and the request objects they read are wanted here.  Two tools do that:

* :func:`bare_package` registers a package in ``sys.modules`` with the right ``__path__`` but without
  executing its ``__init__.py``; its submodules still load from the installed files, unchanged.
* :func:`stub_module` registers a module whose source file is never read, holding only the names the
  loaded code imports from it.  It is used where a module's imports reach into GPU, model or server
  code and the names it provides are only type annotations or code paths the anchors never take
  (multimodal inputs, for instance).  Every stub lists its names explicitly, so a new engine release
  that starts to need another name fails at import time with a plain ``ImportError`` instead of
  silently running against a placeholder.

Nothing here copies engine code: stubs hold inert classes or functions that raise.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["package_dir", "bare_package", "stub_module", "inert_class", "unsupported"]


def package_dir(name: str) -> str | None:
    """Directory of the installed top-level package ``name``, without importing it (None if absent)."""
    mod = sys.modules.get(name)
    if mod is not None:
        paths = list(getattr(mod, "__path__", []) or [])
        return paths[0] if paths else None
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def bare_package(name: str, root: str, names: Mapping[str, Any] | None = None) -> types.ModuleType:
    """Register package ``name`` (dotted; its directory is derived from ``root``) without its __init__.

    ``root`` is the directory of the top-level package.  If the package is already imported (the real
    one, or an earlier bare one) it is left as it is and returned.  ``names`` are set as attributes,
    for the few names other modules import from the package itself.
    """
    mod = sys.modules.get(name)
    if mod is None:
        parts = name.split(".")
        path = os.path.join(root, *parts[1:])
        if not os.path.isdir(path):
            raise ImportError(f"{name}: no directory {path}")
        mod = types.ModuleType(name, f"{name} loaded bare by pagedkv.bench.anchors (its __init__ was skipped)")
        mod.__path__ = [path]
        mod.__file__ = os.path.join(path, "__init__.py")
        mod.__package__ = name
        mod.__pagedkv_bare__ = True
        sys.modules[name] = mod
        _link_to_parent(name, mod)
    for key, value in (names or {}).items():
        if not hasattr(mod, key):
            setattr(mod, key, value)
    return mod


def stub_module(name: str, names: Mapping[str, Any] | Iterable[str]) -> types.ModuleType:
    """Register module ``name`` holding only ``names`` (a mapping, or names that become inert classes).

    An already imported module of that name is left alone and returned.
    """
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    mod = types.ModuleType(name, f"stub of {name} made by pagedkv.bench.anchors")
    mod.__pagedkv_stub__ = True
    if not isinstance(names, Mapping):
        names = {n: inert_class(n, name) for n in names}
    for key, value in names.items():
        setattr(mod, key, value)
    sys.modules[name] = mod
    _link_to_parent(name, mod)
    return mod


def inert_class(name: str, module: str) -> type:
    """A class with no behaviour, standing in for a type that is only used in annotations."""
    return type(name, (), {"__module__": module, "__doc__": f"stand-in for {module}.{name} (never instantiated)"})


def unsupported(qualname: str, why: str) -> Callable[..., Any]:
    """A function standing in for ``qualname`` that raises if the anchor ever reaches it."""

    def _unsupported(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{qualname} is stubbed out by pagedkv.bench.anchors: {why}")

    _unsupported.__name__ = qualname.rpartition(".")[2]
    _unsupported.__qualname__ = qualname
    return _unsupported


def _link_to_parent(name: str, mod: types.ModuleType) -> None:
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
