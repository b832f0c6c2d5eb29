"""The documentation's links hold: every relative link in README.md, docs/*.md and bench/README.md
names a file of the repository, and every `#anchor` a heading of that file (GitHub's slugs), so
pages can be added and split without leaving dead links. README stays short (issue 42: the rest
lives in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())  # headings only outside code blocks
    return {_slug(m.group(1)) for m in re.finditer(r"(?m)^#{1,6} (.+)$", text)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert page.is_file(), page
    dead = []
    for link in _links(page):
        if re.match(r"^[a-z]+:", link):  # http:, mailto: ...
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            dead.append(f"{link} (no file {path.relative_to(ROOT) if ROOT in path.parents else path})")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            dead.append(f"{link} (no heading #{anchor} in {path.relative_to(ROOT)})")
    assert not dead, f"dead links in {page.relative_to(ROOT)}: {dead}"


def test_readme_is_short_and_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    linked = set(_links(ROOT / "README.md"))
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{doc.name}" in linked, f"README.md does not link docs/{doc.name}"
