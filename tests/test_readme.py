"""The README gets a newcomer running, and the manual shows real code.

- the README's first lines are this repository's two commands, `make demo` and
  `make test` (.ci/run runs the README's test command), and it stays short;
- it links every page of the manual;
- docs/handlers.md quotes the handler it calls complete and runnable verbatim.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250


def test_the_readme_opens_with_the_two_commands_and_stays_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    head = [line.split("#", 1)[0].strip() for line in lines[:6]]
    assert "make demo" in head and "make test" in head, lines[:6]
    assert len(lines) <= README_MAX_LINES


def test_the_readme_links_every_page_of_the_manual() -> None:
    readme = (ROOT / "README.md").read_text()
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "internals" / "index.md"]
    unlinked = [p.name for p in pages if f"]({p.relative_to(ROOT)})" not in readme]
    assert unlinked == []


def test_the_handlers_page_quotes_handlers_tempconv_verbatim() -> None:
    page = (ROOT / "docs" / "handlers.md").read_text()
    marker = "This is `handlers/tempconv.py`,\ncomplete and runnable"
    assert marker in page
    block = page.split(marker, 1)[1].split("```python\n", 1)[1].split("```\n", 1)[0]
    assert block == (ROOT / "handlers" / "tempconv.py").read_text()
