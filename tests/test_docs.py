"""The documentation: the site builds with ``mkdocs build --strict`` (API reference from the docstrings, every page
in the nav, warnings are errors), every relative link in README.md and docs/ resolves to a file of the
repository, the core-only examples run as written, and README's test command stays in the form .ci/run parses."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_mkdocs_builds_strictly(tmp_path):
    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python") if importlib.util.find_spec(
        m.split(".")[0]) is None or (m == "mkdocstrings_handlers.python" and _no_python_handler())]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the docs extra is not installed ({', '.join(missing)}): pip install -e '.[docs]'")
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)})")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "WARNING" not in log, log[-4000:]
    # the API reference was generated from the docstrings, not left empty
    manager = (site / "api" / "manager.html").read_text()
    assert "decode_step" in manager and "OutOfBlocksError" in manager
    assert "swap_in" in manager and "finish_external" in manager and "events.take" in manager  # (the named parts too)
    # every link and image of the built site resolves (the charts render): checked in the HTML itself
    bad, seen = [], 0
    for html in site.rglob("*.html"):
        if html.name == "404.html":
            continue
        for m in re.finditer(r'(?:href|src)="([^"]+)"', html.read_text()):
            url = m.group(1).split("#")[0].split("?")[0]
            if not url or re.match(r"^[a-z][a-z0-9+.-]*:|^//", url):
                continue
            seen += 1
            if not (html.parent / url).exists():
                bad.append((str(html.relative_to(site)), m.group(1)))
    assert seen > 500 and not bad, bad[:20]
    charts = re.findall(r'<img[^>]*src="([^"]+\.png)"', (site / "engine-speed.html").read_text())
    assert charts and all((site / c).is_file() for c in charts), charts
    assert (site / "_repo" / "index.html").is_file()  # README, the start-here link of the home page


def _mini_site(tmp_path: Path, page: str) -> subprocess.CompletedProcess:
    """A strict build of a one-page site with this repository's validation settings and link hook."""
    cfg = (ROOT / "mkdocs.yml").read_text()
    validation = re.search(r"^validation:\n(?:  .*\n)+", cfg, flags=re.M).group(0)
    (tmp_path / "docs").mkdir(parents=True)
    (tmp_path / "docs" / "index.md").write_text(page)
    (tmp_path / "README.md").write_text("# Read me\n\nBack to [the docs](docs/index.md).\n")
    (tmp_path / "charts").mkdir()
    (tmp_path / "charts" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "mkdocs.yml").write_text(
        f"site_name: t\ndocs_dir: docs\nuse_directory_urls: false\n{validation}"
        f"hooks:\n  - {ROOT / 'scripts' / 'mkdocs_repo_links.py'}\nnav:\n  - Home: index.md\n")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_the_build_fails_on_a_link_to_nothing_and_brings_repository_files_in(tmp_path):
    pytest.importorskip("mkdocs")
    ok = _mini_site(tmp_path / "ok", "# Home\n\n[Read me](../README.md), ![a chart](../charts/a.png)\n")
    assert ok.returncode == 0, ok.stderr[-2000:]
    home = (tmp_path / "ok" / "site" / "index.html").read_text()
    assert 'src="_repo/charts/a.png"' in home and 'href="_repo/index.html"' in home
    assert (tmp_path / "ok" / "site" / "_repo" / "charts" / "a.png").is_file()
    readme = (tmp_path / "ok" / "site" / "_repo" / "index.html").read_text()
    assert 'href="../index.html"' in readme  # README's link into docs/ leads to the page
    for broken in ("[gone](../nope.md)", "![gone](../charts/b.png)", "[gone](nope.md)"):
        r = _mini_site(tmp_path / str(abs(hash(broken))), f"# Home\n\n{broken}\n")
        assert r.returncode != 0 and "not found" in r.stderr, (broken, r.stderr[-2000:])


def test_the_home_page_lists_every_page():
    """docs/index.md links every page of the site (the API pages through api/index.md, which links each)."""
    def linked(page: Path) -> set[Path]:
        return {(page.parent / t.partition("#")[0]).resolve() for t in _links(page)
                if not re.match(r"^[a-z]+:", t)}

    home, api = linked(DOCS / "index.md"), linked(DOCS / "api" / "index.md")
    missing = [str(p.relative_to(DOCS)) for p in sorted(DOCS.rglob("*.md")) if p.name != "index.md" or
               p.parent not in (DOCS, DOCS / "api")
               if p.resolve() not in (api if p.parent == DOCS / "api" else home)]
    assert not missing, f"pages not listed on docs/index.md (API pages: on docs/api/index.md): {missing}"


def _no_python_handler() -> bool:
    try:
        return importlib.util.find_spec("mkdocstrings_handlers.python") is None
    except ModuleNotFoundError:
        return True


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _links(page: Path):
    text = page.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # not inside code blocks
    text = re.sub(r"`[^`\n]*`", "", text)
    for m in _LINK.finditer(text):
        yield m.group(1)


def _anchors(page: Path) -> set[str]:
    """The heading anchors of a markdown page, as GitHub and mkdocs' toc make them."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    out = set()
    for m in re.finditer(r"^#+ (.+)$", text, flags=re.M):
        title = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
        out.add(title.replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    assert not bad, f"{page.relative_to(ROOT)}: links to nothing: {bad}"


def test_the_link_checker_sees_links(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("see [a](x.md#y) and ![b](img/c.png) but not `[c](d.md)` nor\n```\n[e](f.md)\n```\n")
    assert list(_links(page)) == ["x.md#y", "img/c.png"]
    page.write_text("# The CPU tier: what it buys\n\n## Side by side, rerun\n")
    assert _anchors(page) == {"the-cpu-tier-what-it-buys", "side-by-side-rerun"}


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


# pages whose examples need only the core (the engine's, the server's need the model or a running server)
CORE_EXAMPLES = ["README.md", "docs/guide/prefix-caching.md", "docs/guide/swap-and-preemption.md",
                 "docs/guide/kv-events.md", "docs/guide/sliding-window-and-lookahead.md", "docs/guide/kv-groups.md"]


@pytest.mark.parametrize("name", CORE_EXAMPLES)
def test_core_examples_run_as_written(name):
    blocks = _python_blocks(ROOT / name)
    assert blocks, f"{name} has no python example"
    ns: dict = {"np": np}
    for code in blocks:
        exec(compile(code, f"{name} example", "exec"), ns)  # noqa: S102 - the repository's own examples
    if name == "README.md":
        ns["bm"].check_invariants()


def test_readme_keeps_the_test_command_ci_runs():
    # the same extraction as .ci/run (sed between the markers, minus comment, fence and blank lines)
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- test-command -->\n(.*?)<!-- /test-command -->", text, flags=re.S)
    assert m, "README.md lost its <!-- test-command --> block"
    cmd = [ln for ln in m.group(1).splitlines() if ln and not ln.startswith(("<!--", "```"))]
    assert cmd == ["bash scripts/setup.sh && .venv/bin/python -m pytest"]
    assert "bash scripts/setup.sh && .venv/bin/pagedkv generate" in text  # the main job's command


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_result_files_named_in_the_docs_are_in_the_repository(page):
    # a table whose source files are gone cannot be checked or regenerated (`git show REV:path` names history)
    missing = []
    for m in re.finditer(r"(\S*?)(benchmarks/results/[\w./*-]*)", page.read_text()):
        if m.group(1).endswith(":"):  # git show REV:benchmarks/results/...
            continue
        pattern = m.group(2).rstrip(".")
        if not list(ROOT.glob(pattern)):
            missing.append(pattern)
    assert not missing, f"{page.relative_to(ROOT)} names result files that are not in benchmarks/results: {missing}"


def test_readme_stays_a_newcomers_page():
    """README is for a newcomer: at most 16 KB, no table cell over 300 characters, at most 8 headline figures
    (the full record of figures lives in docs/benchmarks/headline.md, the history in CHANGELOG.md)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 16 * 1024, len(text.encode())
    cells = [c.strip() for ln in text.splitlines() if ln.startswith("|") for c in ln.strip("|").split("|")]
    assert max(map(len, cells)) <= 300, max(cells, key=len)
    headline = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in headline.splitlines() if ln.startswith("|") and not ln.startswith(("| what", "|---"))]
    assert 0 < len(rows) <= 8, rows
    assert (ROOT / "CHANGELOG.md").is_file() and (DOCS / "benchmarks" / "headline.md").is_file()
