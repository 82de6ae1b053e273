"""Every relative link and #anchor in README.md and docs/*.md resolves: the file exists in the
clone, and an anchor matches a heading of its page by GitHub's slug rule."""
import re
import unicodedata
from pathlib import Path

import pytest

from vlp_testing import REPO

# Pages that other branches add. A link to one of them passes while the page is absent here;
# once the page exists its anchors are checked like any other. Empty this set when they are merged.
PENDING: set[str] = set()

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation and symbols dropped
    (letters, marks, digits, '_', '-' and spaces stay), spaces become '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    kept = "".join(c for c in text if c in "_- " or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page.read_text()):
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    """Link targets outside code blocks and inline code spans."""
    lines = (re.sub(r"(`+)(?:(?!\1).)+?\1", "", line) for line in prose_lines(page.read_text()))
    return [m.group(1) for line in lines for m in LINK.finditer(line)]


def broken(page: Path, target: str) -> str | None:
    """Why a link from page does not resolve, or None. External links are not followed."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
        return None
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    rel = dest.relative_to(REPO).as_posix() if dest.is_relative_to(REPO) else str(dest)
    if not dest.exists():
        return None if rel in PENDING else f"{rel} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{rel} has no heading with anchor #{anchor}"
    return None


def test_the_slug_rule():
    assert slug("Shards: `vlp shards`") == "shards-vlp-shards"
    assert slug("Same memory: batch 8, or 128 by accumulation?") == "same-memory-batch-8-or-128-by-accumulation"
    assert slug("Caching the locked towers' features") == "caching-the-locked-towers-features"
    assert slug("Gather and gradient scale (vlp/distributed.py)") == "gather-and-gradient-scale-vlpdistributedpy"
    assert slug("Accumulation (vlp/train/step.py, `contrastive_backward`)") == \
        "accumulation-vlptrainsteppy-contrastive_backward"
    assert slug("FSDP: sharded weights, gradients and optimizer state") == \
        "fsdp-sharded-weights-gradients-and-optimizer-state"


def test_the_checker_finds_broken_links(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "REPO", tmp_path.resolve())
    (tmp_path / "docs").mkdir()
    page = tmp_path.resolve() / "docs" / "a.md"
    page.write_text("# A page\n\n## Two words\n\n## Two words\n\n```\n# not a heading\n[x](gone.md)\n```\n"
                    "[ok](#two-words-1) [bad](#not-a-heading) `[code](gone.md)` [no](gone.md)\n")
    assert links(page) == ["#two-words-1", "#not-a-heading", "gone.md"]
    assert [broken(page, t) for t in links(page)] == [
        None, "docs/a.md has no heading with anchor #not-a-heading", "docs/gone.md does not exist"]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_link_resolves(page):
    problems = [f"{target}: {why}" for target in links(page) if (why := broken(page, target))]
    assert not problems, f"{page.relative_to(REPO)}: " + "; ".join(problems)


def test_pending_pages_are_docs_pages():
    assert all(re.fullmatch(r"docs/[a-z0-9-]+\.md", p) for p in PENDING)
