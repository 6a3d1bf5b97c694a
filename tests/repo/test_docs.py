"""The documents the code cites exist in the repository, and the files they name exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(30)

# Documents that walk a newcomer through real files: every path they name must exist.
GUIDES = ("CONTRIBUTING.md", "docs/ARCHITECTURE.md", "docs/SIGNALS.md", "docs/SECURITY.md")
# Every Markdown document of ours, for the links test.
DOCUMENTS = (
    "README.md",
    "CONTRIBUTING.md",
    "BENCHMARKS.md",
    *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
)
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")  # a Markdown link's target, without its anchor
_ANCHOR = re.compile(r"\]\(#([^)\s]+)\)")  # a link to a heading of the same document
# A repository path in backticks: a folder of ours, then a file or folder name.
_PATH = re.compile(
    r"`((?:agent|coordinator|clusterwatch|tui|tests|bench|scripts|deploy|docs|proto|dashboards)/[\w./-]*[\w/])`"
)
_CITED = re.compile(r"(?<![\w/])((?:docs/)?[A-Z][A-Z_]+\.md)\b")  # not another repository's doc/X.md


def tracked_sources() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.py", "*.toml", "*.sh"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in listed if not name.startswith("clusterwatch/v1/")]


@pytest.mark.parametrize("guide", GUIDES)
def test_every_path_a_guide_names_exists(guide: str) -> None:
    named = set(_PATH.findall((ROOT / guide).read_text()))
    assert named, f"{guide} names no file (the pattern is wrong?)"
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert missing == [], f"{guide} names files that do not exist: {missing}"


def test_every_document_the_code_cites_is_in_the_repository() -> None:
    cited: dict[str, set[str]] = {}
    for source in tracked_sources():
        for name in _CITED.findall(source.read_text(errors="replace")):
            cited.setdefault(name, set()).add(str(source.relative_to(ROOT)))
    missing = {
        name: sorted(where)
        for name, where in cited.items()
        if not (ROOT / name).exists() and not (ROOT / "docs" / name).exists()
    }
    assert missing == {}, f"cited but not in the repository: {missing}"
    assert "CONTRIBUTING.md" in cited  # the search finds citations at all


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_relative_link_in_a_document_resolves(document: str) -> None:
    path = ROOT / document
    targets = {t for t in _LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", t)}
    missing = sorted(t for t in targets if not (path.parent / t).exists())
    assert missing == [], f"{document} links to files that do not exist: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_link_to_a_heading_of_the_same_document_finds_it(document: str) -> None:
    text = (ROOT / document).read_text()
    headings = {_slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}
    missing = sorted(set(_ANCHOR.findall(text)) - headings)
    assert missing == [], f"{document} links to headings it does not have: {missing}"
