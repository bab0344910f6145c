"""The documentation the tests hold to the code: README.md and docs/*.md, read as one.

Tests take commands from every file (`shell_lines`, `blocks`) and a section from whichever file
holds its heading (`section`), so a section can move between files without a test losing it,
and a command added to any of them is checked like the rest."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
HEADING = re.compile(r"^(#{1,6}) (.+)$", re.M)


def doc_paths() -> list[Path]:
    """README.md first, then docs/*.md by name."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc_texts() -> dict[str, str]:
    """Each doc's text by its path from the repository root ("README.md", "docs/api.md", ...)."""
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in doc_paths()}


def fenced() -> list[tuple[str, str, str]]:
    """(doc, language tag, body) of every fenced block, in the order of doc_paths()."""
    return [(name, tag, body) for name, text in doc_texts().items() for tag, body in FENCE.findall(text)]


def blocks(lang: str | None = None) -> list[str]:
    """Bodies of the fenced blocks tagged `lang` (every block for None)."""
    return [body for _, tag, body in fenced() if lang is None or tag == lang]


def shell_lines() -> list[str]:
    """Commands of the untagged and `sh` blocks of every doc, continuation lines joined (JSON
    examples, which start with "{", are not commands)."""
    text = "\n".join(body for _, tag, body in fenced() if tag in ("", "sh"))
    return [line for line in text.replace("\\\n", " ").splitlines() if line and not line.startswith("{")]


def _headings(text: str) -> list[tuple[int, int, str]]:
    """(level, offset, title) of a doc's headings; lines of code blocks are not headings."""
    masked = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # same offsets
    return [(len(m.group(1)), m.start(), m.group(2).strip()) for m in HEADING.finditer(masked)]


def section(title: str) -> tuple[str, str]:
    """(doc, text) of the one section headed `title` (at any level), up to the next heading of its
    level or above."""
    found = []
    for name, text in doc_texts().items():
        heads = _headings(text)
        for i, (level, start, heading) in enumerate(heads):
            if heading == title:
                end = next((s for lv, s, _ in heads[i + 1:] if lv <= level), len(text))
                found.append((name, text[start:end]))
    assert len(found) == 1, f"section {title!r}: {len(found)} headings of that name in {list(doc_texts())}"
    return found[0]


def between_markers(name: str) -> str:
    """The text between `<!-- NAME:begin -->` and `<!-- NAME:end -->`, which appear once in all the docs."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    texts = [text for text in doc_texts().values() if begin in text]
    assert len(texts) == 1 and texts[0].count(begin) == 1, f"{begin} is not in exactly one place"
    return texts[0].split(begin, 1)[1].split(end, 1)[0]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a doc's headings (a repeated one gets -1, -2, ... as on GitHub)."""
    out: set[str] = set()
    for _, _, heading in _headings(text):
        base, n = slug(heading), 0
        while (name := base if n == 0 else f"{base}-{n}") in out:
            n += 1
        out.add(name)
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def relative_links() -> list[tuple[str, str]]:
    """(doc, target) of every link and image of the docs that is not a web address, code excluded."""
    out = []
    for name, text in doc_texts().items():
        prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
        out += [(name, target) for target in LINK.findall(prose) if not re.match(r"[a-z]+:", target)]
    return out
