"""A handler module that fails to import takes only its own handlers down.

A new user's project, as `thaw` finds it: a `handlers/` package (default
discovery, no THAW_HANDLERS) with a good module, one with a syntax error, one
that raises at import, and one whose handler uses a bundle whose builder is in
the broken module. Real `thaw invoke` and `thaw serve` processes, since their
exit codes and the lines they print are the point: the good handler is
served; a handler of a broken module is a clear error naming the file and
line; /readyz stays ready and, with /models, names what is broken.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.errors import BrokenHandler, ConfigError, UnknownHandler
from runtime.registry import discover
from tests.support import ServerProcess

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
from runtime import handler

@handler("greet")
def greet(event, ctx):
    return {"hello": event.get("name", "world")}
"""
# Line 7 is the syntax error; the module declares a handler and a builder.
SYNTAX = """from runtime import bundle, handler

@bundle("lost")
def build(weights, config):
    return None
@handler("oops")
def oops(event, ctx) -> dict
    return {"missing": "colon"}
"""
SYNTAX_LINE = 7
RAISES = """from runtime import handler

CONFIG = {"a": 1}
VALUE = CONFIG["b"]  # KeyError at import, line 4


@handler("boom")
def boom(event, ctx):
    return VALUE
"""
RAISES_LINE = 4
ORPHAN = """
from runtime import handler

@handler("orphan", uses=["lost"])
def orphan(event, model, ctx):
    return {}
"""


def project(root: Path, modules: dict[str, str]) -> dict[str, str]:
    """`root/handlers/<name>.py` for each module; the environment that finds them."""
    package = root / "handlers"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, text in modules.items():
        (package / f"{name}.py").write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(root), str(ROOT)]),
        PYTHONUNBUFFERED="1",
        THAW_BUNDLE_SOURCE=str(root / "bundles"),
        THAW_CACHE_DIR=str(root / "cache"),
        THAW_STATE_DIR=str(root / "state"),
        THAW_JOB_STORE=f"sqlite:///{root / 'jobs.sqlite3'}",
    )
    return env


MIXED = {"good": GOOD, "broken_syntax": SYNTAX, "broken_raises": RAISES, "orphan": ORPHAN}


def thaw(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("thaw: error:")]


def test_the_good_handler_is_invoked_and_the_broken_modules_are_one_warning_each(
    tmp_path: Path,
) -> None:
    env = project(tmp_path, MIXED)
    result = thaw(env, tmp_path, "invoke", "greet", "--event", '{"name": "thaw"}')
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"hello": "thaw"}
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("thaw: warning:")]
    assert len(warnings) == 2, result.stderr
    assert any(f"handlers/broken_syntax.py:{SYNTAX_LINE}): SyntaxError" in w for w in warnings)
    assert any(f"handlers/broken_raises.py:{RAISES_LINE}): KeyError: 'b'" in w for w in warnings)


@pytest.mark.parametrize(
    ("handler", "where"),
    [
        ("oops", f"handlers/broken_syntax.py:{SYNTAX_LINE}): SyntaxError"),
        ("boom", f"handlers/broken_raises.py:{RAISES_LINE}): KeyError"),
        # Its own module imports; the builder of its bundle is in the broken one.
        ("orphan", f"handlers/broken_syntax.py:{SYNTAX_LINE}): SyntaxError"),
    ],
)
def test_a_handler_of_a_broken_module_is_one_line_naming_file_and_line(
    tmp_path: Path, handler: str, where: str
) -> None:
    env = project(tmp_path, MIXED)
    result = thaw(env, tmp_path, "invoke", handler)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    [line] = error_lines(result.stderr)
    assert line.startswith(f"thaw: error: broken-handler: handler {handler!r} is not served")
    assert where in line
    assert result.stdout == ""


def test_an_unknown_name_is_a_usage_error_that_names_the_broken_modules(tmp_path: Path) -> None:
    env = project(tmp_path, MIXED)
    result = thaw(env, tmp_path, "invoke", "nonesuch")
    assert result.returncode == 2
    [line] = error_lines(result.stderr)
    assert "unknown-handler: no handler named 'nonesuch'" in line
    assert "handlers.broken_syntax" in line and "handlers.broken_raises" in line


def test_nothing_that_imports_is_one_line_and_exit_1(tmp_path: Path) -> None:
    env = project(tmp_path, {"broken_syntax": SYNTAX})
    for args in (("invoke", "oops"), ("serve", "--port", "0")):
        result = thaw(env, tmp_path, *args)
        assert result.returncode == 1, (args, result.stderr)
        assert "Traceback" not in result.stderr
        [line] = error_lines(result.stderr)
        assert f"handlers/broken_syntax.py:{SYNTAX_LINE}): SyntaxError" in line, line


def test_a_broken_handlers_package_is_one_line_naming_its_init(tmp_path: Path) -> None:
    env = project(tmp_path, {"good": GOOD})
    (tmp_path / "handlers" / "__init__.py").write_text("x = (\n")
    result = thaw(env, tmp_path, "invoke", "greet")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    [line] = error_lines(result.stderr)
    assert "cannot import handlers (handlers/__init__.py:1): SyntaxError" in line, line


def test_serve_serves_the_rest_stays_ready_and_shows_what_is_broken(tmp_path: Path) -> None:
    env = project(tmp_path, MIXED)
    server = ServerProcess(env, cwd=tmp_path)
    try:
        server.start()
        with server.client() as client:
            assert client.post("/invoke/greet", json={}).json() == {"hello": "world"}
            broken = client.post("/invoke/oops", json={})
            assert broken.status_code == 500
            problem = broken.json()
            assert problem["type"].endswith("/broken-handler")
            assert f"broken_syntax.py:{SYNTAX_LINE}" in problem["detail"]
            assert client.post("/invoke/nonesuch", json={}).status_code == 404
            # Ready: the other handlers serve. (No keys: every caller is the operator,
            # who is told where each module broke.)
            ready = client.get("/readyz")
            assert ready.status_code == 200 and ready.json()["status"] == "ready"
            said = {b["module"]: b["line"] for b in ready.json()["broken_modules"]}
            assert said == {"handlers.broken_raises": RAISES_LINE, "handlers.broken_syntax": 7}
            listed = {b["module"]: b for b in client.get("/models").json()["broken_modules"]}
        assert set(listed) == {"handlers.broken_raises", "handlers.broken_syntax"}
        syntax = listed["handlers.broken_syntax"]
        assert syntax["file"].endswith("handlers/broken_syntax.py")
        assert syntax["line"] == SYNTAX_LINE and syntax["error"].startswith("SyntaxError")
        assert sorted(syntax["handlers"]) == ["oops", "orphan"]
        assert listed["handlers.broken_raises"]["line"] == RAISES_LINE
    finally:
        assert server.terminate() == 0
    log = server.log()
    assert "Traceback" not in log
    warnings = [json.loads(line) for line in log.splitlines() if '"level":"warning"' in line]
    assert {w["msg"].split()[2] for w in warnings} >= {
        "handlers.broken_syntax",
        "handlers.broken_raises",
    }


def test_discovery_records_each_failure_and_keeps_the_rest(tmp_path: Path) -> None:
    """In-process, the same rule: the registry of a partly broken tree."""
    package = tmp_path / "brokenpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fine.py").write_text(GOOD)
    (package / "bad.py").write_text(SYNTAX)
    sys.path.insert(0, str(tmp_path))
    try:
        inner = tmp_path / "brokeninit"  # a package whose own __init__ fails
        inner.mkdir()
        (inner / "__init__.py").write_text("raise ImportError('no')\n")
        (inner / "mod.py").write_text(GOOD)
        registry = discover(
            ["brokenpkg.fine", "brokenpkg.bad", "brokenpkg.missing", "brokeninit.mod"]
        )
        assert set(registry.handlers) == {"greet"}
        [bad, missing, under] = registry.broken
        assert under.module == "brokeninit.mod" and under.error == "ImportError: no"
        assert (bad.module, bad.line, bad.handlers) == ("brokenpkg.bad", SYNTAX_LINE, ("oops",))
        assert missing.file is None and "ModuleNotFoundError" in missing.error
        with pytest.raises(BrokenHandler, match=r"brokenpkg/bad\.py:7"):
            registry.handler("oops")
        with pytest.raises(UnknownHandler, match=r"brokenpkg\.missing"):
            registry.handler("nonesuch")
        with pytest.raises(ConfigError, match=r"cannot import handler module brokenpkg\.bad"):
            discover(["brokenpkg.bad"])
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith(("brokenpkg", "brokeninit"))]:
            del sys.modules[name]
