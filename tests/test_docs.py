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


async def test_the_python_client_pages_example_runs_as_written(tiny_stack, capsys):
    """docs/client.md's example, against a live orchestrator (the tiny pair) instead of port 50051:
    it streams a completion, then prints the acceptance rate and the seed."""
    code = re.search(r"```python\n(.*?)```", (DOCS / "client.md").read_text(), re.DOTALL).group(1)
    assert "127.0.0.1:50051" in code and code.rstrip().endswith("asyncio.run(main())")
    code = code.replace("127.0.0.1:50051", f"127.0.0.1:{tiny_stack.orchestrator.port}")
    namespace = {}
    exec(compile(code.replace("asyncio.run(main())", ""), "docs/client.md", "exec"), namespace)
    await namespace["main"]()
    printed = capsys.readouterr().out
    alpha, seed = printed.splitlines()[-1].split()
    assert 0.0 <= float(alpha) <= 1.0 and int(seed) >= 0
    assert len(printed) > len(printed.splitlines()[-1]) + 2  # the streamed text came first
