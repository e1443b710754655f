"""Zip-packaged Python functions: each sandbox runs AWS's Runtime Interface Client.

A template function with PackageType Zip (the default), `Runtime: python3.X` and
`Handler: module.function` (template.py checks those at load) runs as

    python -m awslambdaric module.function

from the emulator's own interpreter (awslambdaric is in `thaw-runtime[emulator]`), in its
code directory (CodeUri) with that directory first on PYTHONPATH, so the module
imports from there as it does from /var/task on Lambda. Its environment is the
one Thaw's own sandboxes get (`sandboxes.sandbox_env`: the template's
Environment, the local wiring, Lambda's platform variables) plus what Lambda's
managed runtimes set: LAMBDA_TASK_ROOT (the code directory), _HANDLER, and
AWS_EXECUTION_ENV=AWS_Lambda_python3.X. awslambdaric speaks the Runtime API
(an init error posted, then next -> response/error) with the sandbox's own
listener as any runtime does, so the Invoke API, REPORT lines with Init
Duration, timeouts, tail logs and throttling are the pool's, unchanged.

Where it differs from Lambda: the interpreter is this one, whatever minor
version the Runtime names (the startup banner says so when they differ), and
the code directory is used in place, not copied into a package: the handler
imports what this interpreter has installed, as well as what CodeUri holds.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.emulator.sandboxes import ProcessLauncher, Sandbox, sandbox_env
from runtime.errors import ConfigError

if TYPE_CHECKING:
    from runtime.emulator.template import FunctionConfig, Template

PACKAGE = "awslambdaric"


class RicLauncher(ProcessLauncher):
    """`python -m awslambdaric HANDLER` from this interpreter, in the function's CodeUri."""

    def command(self, sandbox: Sandbox, api_address: str) -> tuple[list[str], dict[str, str]]:
        function = sandbox.function
        assert function.handler is not None and function.runtime is not None
        env = sandbox_env(function, self.base_env, self.local_env, api_address, sandbox.version)
        code_dir = str(_code_dir(function))
        inherited = env.get("PYTHONPATH")
        env.update(
            {
                "LAMBDA_TASK_ROOT": code_dir,
                "_HANDLER": function.handler,
                "AWS_EXECUTION_ENV": f"AWS_Lambda_{function.runtime}",
                "PYTHONPATH": os.pathsep.join(p for p in (code_dir, inherited) if p),
            }
        )
        return [sys.executable, "-m", PACKAGE, function.handler], env

    def workdir(self, sandbox: Sandbox) -> str | None:
        return str(_code_dir(sandbox.function))


def _code_dir(function: FunctionConfig) -> Path:
    assert function.code_dir is not None, f"{function.logical_id} is not a Zip function"
    return function.code_dir


def zip_functions(template: Template) -> list[FunctionConfig]:
    return [f for f in template.functions.values() if f.package_type == "Zip"]


def check_installed(template: Template) -> None:
    """ConfigError if the template has a Zip function and awslambdaric is not installed."""
    zipped = zip_functions(template)
    if zipped and importlib.util.find_spec(PACKAGE) is None:
        names = ", ".join(f.logical_id for f in zipped)
        raise ConfigError(
            f"{names}: a Zip function runs under awslambdaric (AWS's Runtime Interface "
            f"Client), which {sys.executable} does not have: pip install 'thaw-runtime[emulator]'"
        )


def banner_lines(template: Template) -> list[str]:
    """One line per Zip function for the startup banner: what runs it, and where."""
    here = f"python{sys.version_info.major}.{sys.version_info.minor}"
    lines = []
    for function in zip_functions(template):
        line = (
            f"  {function.logical_id}: Zip, {function.runtime}, handler {function.handler} "
            f"in {function.code_dir}, under awslambdaric"
        )
        if function.runtime != here:
            line += f" on this interpreter ({here}, not {function.runtime})"
        lines.append(line)
    return lines
