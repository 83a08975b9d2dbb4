"""Every relative link in the README and the manual (docs/, benchmarks/README.md) leads somewhere.

A link is `[text](target)` or `![alt](target)` outside code; the target must be a file or directory of
the repository, and a `#fragment` must name a heading of the linked Markdown file (GitHub's anchors).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "benchmarks" / "README.md", *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")


def _prose_lines(text: str, keep_code: bool = False) -> list[str]:
    """The lines outside fenced code blocks; inline code removed, or only its backticks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line.replace("`", "") if keep_code else INLINE_CODE.sub("", line))
    return lines


def _anchors(page: Path) -> set[str]:
    """GitHub's anchor for each heading: lowercase, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in _prose_lines(page.read_text(encoding="utf-8"), keep_code=True):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _relative_links(page: Path) -> list[str]:
    links = [m for line in _prose_lines(page.read_text(encoding="utf-8")) for m in LINK.findall(line)]
    return [link for link in links if not re.match(r"^[a-z][a-z0-9+.-]*:", link)]


def _dead(page: Path, link: str) -> str | None:
    path, _, fragment = link.partition("#")
    target = (page.parent / path).resolve() if path else page
    if not target.exists():
        return f"{link}: no such file"
    if fragment and target.suffix == ".md" and fragment not in _anchors(target):
        return f"{link}: no heading #{fragment} in {target.name}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    dead = [why for link in _relative_links(page) if (why := _dead(page, link))]
    assert not dead, f"{page.relative_to(REPO)} has dead links:\n" + "\n".join(dead)


def test_the_checker_sees_links_and_finds_dead_ones(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A `title`, here\n")
    page.write_text(
        "[ok](there.md#a-title-here) ![img](there.md) [web](https://example.com)\n"
        "[gone](missing.md) [bad anchor](there.md#nope)\n"
        "```\n[in code](also-missing.md)\n```\n"
    )
    links = _relative_links(page)
    assert links == ["there.md#a-title-here", "there.md", "missing.md", "there.md#nope"]
    assert [link for link in links if _dead(page, link)] == ["missing.md", "there.md#nope"]
