"""`thaw emulate`: run the function locally as Lambda would (runtime/emulator/server.py).

The modules, one part each: server (the app, its server, a sandbox's
environment), invoke_api and eventstream (the Lambda Invoke API), function_url
(every other path), pool (sandboxes scheduled, throttled, reaped), sandboxes,
containers and ric (how a sandbox runs), runtime_api and http11 (each
sandbox's Runtime API listener), streaming (streamed responses), template
(template.yaml), report (REPORT lines).
"""

from runtime.emulator.server import (
    CREDENTIALS,
    DEFAULT_MAX_SANDBOXES,
    EmulatorConfig,
    create_emulator_app,
    first_steps,
    local_environment,
    make_launchers,
    run_emulator,
)

__all__ = [
    "CREDENTIALS",
    "DEFAULT_MAX_SANDBOXES",
    "EmulatorConfig",
    "create_emulator_app",
    "first_steps",
    "local_environment",
    "make_launchers",
    "run_emulator",
]
