"""Every relative link in the README and the docs points at a file of the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(ROOT.glob("docs/**/*.md")),
             *sorted(ROOT.glob("benchmarks/**/README.md"))]  # fmt: skip
# [text](target) and [text]: target; the target ends at whitespace or the closing parenthesis
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)|^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


def relative_targets(document: Path) -> list[str]:
    targets = [inline or reference for inline, reference in MARKDOWN_LINK.findall(document.read_text())]
    return [t for t in targets if not re.match(r"[a-z]+:|#", t)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document):
    missing = [t for t in relative_targets(document) if not (document.parent / t.split("#")[0]).exists()]
    assert not missing, f"{document.relative_to(ROOT)} links to paths that are not in the repository: {missing}"


def test_docs_cite_no_path_outside_the_repository():
    # the paper a seed file held is cited by its arXiv number; the seed folder is not shipped
    for document in DOCUMENTS:
        assert "shared/seeds" not in document.read_text(), document
