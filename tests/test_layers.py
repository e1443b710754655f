"""The folder tree is the architecture: imports go one way, down these layers.

Every module under runtime/ is parsed with `ast`, and every import it makes
is collected: at module level, inside functions, and under `TYPE_CHECKING`
(a type-only import that climbs a layer is the same design fault, only hidden).
A module may import its own layer or any layer below; never one above; and no
set of modules may import each other in a cycle, however lazily.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"

# Top to bottom. A module belongs to the first layer one of whose prefixes names
# it (a package prefix covers everything under it). Layers on one line are
# siblings: neither may import the other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("runtime", "runtime.__main__", "runtime.cli"),  # the public API and the entry points
    ("runtime.preload",),  # what a server process starts before its imports
    ("runtime.emulator",),  # `thaw emulate`: drives Lambda-mode processes
    ("runtime.aws",),  # the Lambda Runtime API loop and Function URL events
    ("runtime.http",),  # the HTTP contract (Starlette app, uvicorn server)
    ("runtime.instance",),  # the composition root
    ("runtime.dispatch",),  # the deadline rule and calling user code
    ("runtime.jobs", "runtime.models"),  # the job store; the model cache and lifecycle
    ("runtime.bundles",),  # manifests, sources, conversions
    ("runtime.registry", "runtime.context"),  # the handler API
    ("runtime.wire.outputs", "runtime.telemetry.health", "runtime.process"),
    ("runtime.settings", "runtime.telemetry.metrics", "runtime.telemetry.logs"),
    ("runtime.wire.render",),  # an error as every surface shows it
    ("runtime.errors", "runtime.version", "runtime.clock", "runtime.telemetry", "runtime.wire"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(RUNTIME.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    # runtime/templates/ is package data: `thaw init`'s project files, a user's code.
    templates = RUNTIME / "templates"
    return {module_name(p): p for p in sorted(RUNTIME.rglob("*.py")) if templates not in p.parents}


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The runtime modules `name` imports, wherever the import statement sits."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            # `from runtime.models import weights` imports the module runtime.models.weights.
            targets = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def layer_of(name: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), index)
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best[1]


def sibling_of(name: str) -> str:
    """The LAYERS prefix that owns `name` (its package, for a sibling check)."""
    owners = [p for layer in LAYERS for p in layer if name == p or name.startswith(p + ".")]
    return max(owners, key=len)


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    known = set(modules)
    return {name: set(imports_of(name, path, known)) for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    for name in all_modules():
        layer_of(name)


def test_imports_never_climb_a_layer() -> None:
    climbing = []
    for name, targets in graph().items():
        for target in targets:
            if layer_of(target) < layer_of(name):
                climbing.append(f"{name} -> {target}")
            elif layer_of(target) == layer_of(name) and sibling_of(target) != sibling_of(name):
                climbing.append(f"{name} -> {target} (siblings in one layer)")
    assert not climbing, "imports that climb a layer:\n" + "\n".join(sorted(climbing))


def test_no_import_cycle() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The walk finds imports inside functions and under TYPE_CHECKING, and resolves
    `from package import module`; otherwise the tests above could pass vacuously."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from runtime.instance import Instance\n"
        "def f():\n    from runtime.models import weights\n    import runtime.errors\n"
        "from .context import Context\n"
    )
    known = set(all_modules())
    found = set(imports_of("runtime.registry", source, known))
    assert found == {
        "runtime.instance",
        "runtime.models.weights",
        "runtime.errors",
        "runtime.context",
    }
    # And the shipped tree has edges in every direction the rule allows.
    assert "runtime.models.weights" in graph()["runtime.dispatch.executor"]


# A module past this many lines owns more than one thing (issue 25): split it by
# what its parts own, as http/app.py was split into edge, intake, problems and routes.
MAX_MODULE_LINES = 450
# Top-level modules of runtime/ (packages not counted): the small bottom-floor
# ones are grouped (telemetry/, wire/) rather than left side by side.
MAX_TOP_LEVEL_MODULES = 10


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in all_modules().items()}
    over = sorted(
        f"{name}: {lines} lines" for name, lines in sizes.items() if lines > MAX_MODULE_LINES
    )
    assert not over, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(over)


def test_runtime_has_few_top_level_modules() -> None:
    top = sorted(p.name for p in RUNTIME.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} top-level modules: {top}"
