"""Every relative link in README.md and docs/*.md points at a file that exists, and every
``#anchor`` at a heading of that file, as GitHub and the MkDocs site both name it.

``nox -s docs`` checks the site's links too (``mkdocs build --strict``), but it never reads
README.md, which GitHub and PyPI show as the front page; this test needs no JVM and runs in
``nox -s quick``.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) and ![alt](target); the text may hold code and one level of brackets
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (links and headings inside them are examples)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def heading_text(raw: str) -> str:
    """A heading as rendered: code spans keep their text, link syntax keeps its label."""
    text = re.sub(r"`([^`]*)`", r"\1", raw)
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)


def slug_mkdocs(text: str) -> str:
    """Python-Markdown's toc slug (MkDocs' default): ASCII, word characters, one '-' per gap."""
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def slug_github(text: str) -> str:
    """GitHub's heading anchor: lower case, punctuation but '-' dropped, each space a '-'."""
    value = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return value.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors both renderers give the headings of ``path`` (a link must work on both)."""
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            text = heading_text(match.group(2))
            if slug_mkdocs(text) == slug_github(text):
                found.add(slug_mkdocs(text))
    return found


def relative_links(path: Path) -> list[str]:
    targets = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if not EXTERNAL.match(target):
                targets.append(target)
    return targets


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    """Each link of ``path`` whose file or anchor does not exist, with the reason."""
    problems = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{target}: no file {shown(linked)}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{target}: no heading #{anchor} in {shown(linked)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == [], f"{page.relative_to(ROOT)} has broken links"


def test_the_check_finds_a_broken_file_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A page\n\n## Some `code` here\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md) [ok](a.md#some-code-here) [ok](#b) [web](https://x.org/y)\n"
        "[gone](c.md) [bad](a.md#nope) `[code](d.md)`\n\n```\n[fenced](e.md)\n```\n\n# B\n",
        encoding="utf-8",
    )
    assert broken_links(page) == [
        f"c.md: no file {shown(tmp_path / 'c.md')}",
        f"a.md#nope: no heading #nope in {shown(tmp_path / 'a.md')}",
    ]
