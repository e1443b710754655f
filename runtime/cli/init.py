"""`thaw init PATH [--example blank|encoder|causal-lm]`: a new function project.

The project has this repository's shape (docs/projects.md): pyproject.toml
(depending on thaw-runtime, with the example's own dependencies, and the
`[tool.thaw]` table that marks a project), handlers/ with one example handler,
bundles/, tests/ (a test that invokes the handler in-process and passes as
created), template.yaml (SAM), a Dockerfile and a .gitignore. The files are
package data (runtime/templates/): `project/` for every example, then the
example's own directory over it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from runtime.errors import ConfigError

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
# Each example: its handler's dependencies (the project's [project].dependencies).
EXAMPLES: dict[str, tuple[str, ...]] = {
    "blank": (),
    "encoder": ("transformers>=4.46",),
    "causal-lm": ("transformers>=4.46",),
}
# Written under another name: a dot-file in package data is easily lost, and a
# .gitignore in runtime/templates/ would apply to the templates themselves.
RENAMED = {"gitignore": ".gitignore", "dockerignore": ".dockerignore"}
_SKIPPED = {"__pycache__"}


def project_name(path: Path) -> str:
    """A distribution (and image) name from the directory's: lower case, dashes."""
    name = re.sub(r"[^a-z0-9]+", "-", path.resolve().name.lower()).strip("-")
    return name or "thaw-function"


def create(path: Path, example: str = "blank") -> list[Path]:
    """Write the project into `path` (absent or empty); the files written, sorted."""
    if example not in EXAMPLES:
        raise ConfigError(f"no example {example!r}: choose one of {', '.join(EXAMPLES)}")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        raise ConfigError(
            f"{path} is not empty: thaw init writes a new project into an empty or new "
            "directory, and overwrites nothing"
        )
    name = project_name(path)
    dependencies = "".join(f'    "{d}",\n' for d in EXAMPLES[example])
    path.mkdir(parents=True, exist_ok=True)
    written = []
    for layer in (TEMPLATES / "project", TEMPLATES / example):
        for source in sorted(layer.rglob("*")):
            relative = source.relative_to(layer)
            if source.is_dir() or _SKIPPED & set(relative.parts):
                continue
            target = path / relative.parent / RENAMED.get(relative.name, relative.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            text = source.read_text(encoding="utf-8")
            text = text.replace("    # {{dependencies}}\n", dependencies)
            target.write_text(text.replace("{{project}}", name), encoding="utf-8")
            shutil.copymode(source, target)
            written.append(target)
    return sorted(written)


def next_steps(path: Path, example: str) -> str:
    """What to run next, for a person."""
    lines = [f"created a Thaw project ({example}) in {path}", "next:", f"  cd {path}"]
    lines.append("  pip install -e '.[torch,dev]'      # torch's CPU build first, if you want it")
    if example == "blank":
        lines.append('  thaw invoke hello --event \'{"name": "Ada"}\'')
    else:
        bundle = "encoder" if example == "encoder" else "lm"
        handler = "embed" if example == "encoder" else "generate"
        lines.append(f"  thaw bundle build path/to/save_pretrained-folder --name {bundle}")
        lines.append(f"  thaw invoke {handler} --event @event.json")
    lines += ["  pytest", "  thaw serve", "  thaw image build"]
    return "\n".join(lines)
