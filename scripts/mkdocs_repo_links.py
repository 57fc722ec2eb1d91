"""mkdocs hook: links from the docs to repository files outside docs/ (README.md, the benchmark charts under
benchmarks/results/, tests/data/README.md) resolve in the built site, so the pages show their charts.

The pages are written for readers of the repository, so their links are relative to the files' places in it
(``../benchmarks/results/engine_speed.png`` from docs/engine-speed.md). mkdocs knows only the files under docs/
and drops such links (its "not found among documentation files"). This hook

* ``on_files``: follows every relative link of the docs' pages, and of the repository's markdown files they link
  to (README.md links to benchmarks/results/engine_speed.md, and so on), and adds each linked repository file
  outside docs/ to the site under ``_repo/<its path>``: images and other files are copied as they are,
  markdown files become pages (left out of the nav on purpose, so ``validation.nav.omitted_files`` stays quiet);
* ``on_page_markdown``: rewrites each such link to the file's place in the site, and the links of the
  ``_repo/`` pages that point into docs/ to those pages.

Nothing is duplicated in the repository (the site copies the files it builds from). A link to a file that does
not exist is left as written, for mkdocs' validation (``links.not_found: warn``; the strict build fails on it).
Cost: one read of each linked markdown file, O(total link count).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

MOUNT = "_repo"  # where repository files outside docs/ live in the site

_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_FENCE = re.compile(r"(```.*?```)", re.S)


def _root(config) -> Path:
    """The repository: the folder of mkdocs.yml."""
    return Path(config["config_file_path"]).resolve().parent


def _docs_dir(config) -> str:
    return Path(config["docs_dir"]).resolve().relative_to(_root(config)).as_posix()


def _repo_path(src_uri: str, docs: str) -> str:
    """The repository path of a site file: docs pages under ``docs/``, mounted files at their own path."""
    if src_uri.startswith(MOUNT + "/"):
        return src_uri[len(MOUNT) + 1:]
    return f"{docs}/{src_uri}"


def _target(link: str, page_repo_path: str) -> tuple[str, str] | None:
    """``(repository path, #fragment)`` of a relative link, or None for URLs, anchors and absolute paths."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.I) or link.startswith(("#", "/")):
        return None
    path, _, frag = link.partition("#")
    if not path:
        return None
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo_path), path))
    if resolved.startswith("../"):
        return None
    return resolved, ("#" + frag if frag else "")


def _links(text: str):
    for part in _FENCE.split(text):
        if not part.startswith("```"):
            for m in _LINK.finditer(part):
                yield m.group(2)


def on_files(files, config):
    docs, root = _docs_dir(config), _root(config)
    todo = [(f.src_uri, Path(f.abs_src_path)) for f in files.documentation_pages()]
    seen = {f.src_uri for f in files}
    while todo:
        src_uri, abs_path = todo.pop()
        here = _repo_path(src_uri, docs)
        for link in _links(abs_path.read_text(encoding="utf-8")):
            t = _target(link, here)
            if t is None or t[0].startswith(docs + "/"):
                continue
            path = root / t[0]
            uri = f"{MOUNT}/{t[0]}"
            if uri in seen or not path.is_file():
                continue
            seen.add(uri)
            f = File.generated(config, uri, abs_src_path=str(path))
            if uri.endswith(".md"):
                f.inclusion = InclusionLevel.NOT_IN_NAV
                todo.append((uri, path))
            files.append(f)
    return files


def on_page_markdown(markdown, page, config, files):
    docs = _docs_dir(config)
    here_uri = page.file.src_uri
    here = _repo_path(here_uri, docs)

    def fix(m: re.Match) -> str:
        t = _target(m.group(2), here)
        if t is None:
            return m.group(0)
        path, frag = t
        uri = path[len(docs) + 1:] if path.startswith(docs + "/") else f"{MOUNT}/{path}"
        if files.get_file_from_path(uri) is None:
            return m.group(0)  # (mkdocs' validation reports it)
        rel = posixpath.relpath(uri, posixpath.dirname(here_uri) or ".")
        return f"{m.group(1)}{rel}{frag}{m.group(3)}"

    return "".join(part if part.startswith("```") else _LINK.sub(fix, part) for part in _FENCE.split(markdown))
