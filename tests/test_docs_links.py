"""The manual stays honest: what README.md and docs/ point at exists.

- every relative link resolves to a file of the repository, and a `#fragment`
  to a heading of the page it names (as GitHub makes its anchors);
- every `runtime/…` path the manual cites exists, and in the manual's own pages
  (not projects.md, transformers.md and the decision records) so does every
  cited `tests/…`, `bench/…`, `deploy/…`, `scripts/…` and `handlers/…` file;
- docs/configuration.md names every `THAW_*` setting of runtime/settings.py, and
  no setting that is not one; docs/http-api.md names every problem type.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from runtime import errors
from runtime.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
# Pages written to other plans: their links and `runtime/` paths are checked, but not
# their other paths (a generated project's files; a decision's experiment, since removed).
OTHER_PLANS = {DOCS / "projects.md", DOCS / "transformers.md", *(DOCS / "decisions").glob("*.md")}

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
RUNTIME_PATH = re.compile(r"(?<![\w./-])(runtime/[\w./*-]*[\w*/])")
OTHER_PATH = re.compile(
    r"(?<![\w./-])((?:tests|bench|deploy|scripts|handlers)/[\w./*-]*\.(?:py|md|json|yaml|sh|txt))"
)
# Variables read by the tools that build an environment, not settings of the runtime.
BUILD_VARIABLES = {
    "THAW_TORCH_SPEC",
    "THAW_TORCH_INDEX_URL",
    "THAW_IMAGE_CACHE",
    "THAW_DEBIAN_MIRROR",
}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [a or b for a, b in LINK.findall(text)]


def exists(path: str) -> bool:
    path = path.rstrip("/").split("::")[0]
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {rel(file)}")
    assert not broken, f"{rel(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_cited_path_exists(page: Path) -> None:
    text = page.read_text()
    cited = set(RUNTIME_PATH.findall(text))
    if page not in OTHER_PLANS:
        cited |= set(OTHER_PATH.findall(text))
    missing = sorted(path for path in cited if not exists(path))
    assert not missing, f"{rel(page)} cites paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_cited_test_exists(page: Path) -> None:
    """`tests/x.py::test_name`: the file defines that test."""
    cited = re.findall(r"(tests/[\w/]+\.py)::(\w+)", page.read_text())
    missing = [
        f"{path}::{name}"
        for path, name in cited
        if not (ROOT / path).exists() or not re.search(rf"def {name}\b", (ROOT / path).read_text())
    ]
    assert not missing, f"{rel(page)} cites tests that do not exist: {missing}"


def test_the_configuration_page_names_every_setting_and_only_settings() -> None:
    text = (DOCS / "configuration.md").read_text()
    settings = {f"THAW_{f.name.upper()}" for f in fields(Settings)}
    named = set(re.findall(r"\bTHAW_[A-Z0-9_]+\b", text))
    assert settings - named == set(), "settings the page does not document"
    assert named - settings - BUILD_VARIABLES == set(), "names the page gives that are no setting"


def test_the_http_page_names_every_problem_type() -> None:
    """Every slug of runtime/errors.py's tree is in docs/http-api.md's table."""
    text = (DOCS / "http-api.md").read_text()
    slugs = {
        cls.slug
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.ThawError)
    }
    assert len(slugs) > 20
    assert {slug for slug in slugs if f"`{slug}`" not in text} == set()


def test_the_checks_see_what_they_check() -> None:
    """The patterns find links, anchors and paths (a check that matches nothing passes)."""
    page = DOCS / "configuration.md"
    assert "fleet.md" in links(page)
    assert "invoking" in anchors(DOCS / "http-api.md")
    assert slug("The cold-start breakdown: `thaw coldstart`") == (
        "the-cold-start-breakdown-thaw-coldstart"
    )
    assert RUNTIME_PATH.findall("see `runtime/settings.py`, and runtime/http/.") == [
        "runtime/settings.py",
        "runtime/http/",
    ]
