"""The README shows real code: the handler it calls complete and runnable is the file."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_handler_is_handlers_tempconv_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    marker = "This is `handlers/tempconv.py`,\ncomplete and runnable"
    assert marker in readme
    block = readme.split(marker, 1)[1].split("```python\n", 1)[1].split("```\n", 1)[0]
    assert block == (ROOT / "handlers" / "tempconv.py").read_text()
