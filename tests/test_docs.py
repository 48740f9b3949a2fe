"""The README stays a five-minute read, and no result drops out of the documentation site
(issue 36). `mkdocs build --strict` itself runs in scripts/test.sh: links, anchors, the nav."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_plot_in_docs_results_is_on_a_docs_page():
    shown = {
        Path(target).name
        for page in DOCS.rglob("*.md")
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text())
    }
    missing = sorted(plot.name for plot in (DOCS / "results").glob("*.png") if plot.name not in shown)
    assert not missing, f"plots on no docs page: {missing}"


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    pages = {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}
    assert pages == set(re.findall(r":\s+(\S+\.md)$", nav, flags=re.MULTILINE))
