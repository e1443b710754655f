"""`thaw emulate`: the emulator's app, its server and how a sandbox is configured.

One Starlette app on uvicorn, 127.0.0.1 by default:

    POST /2015-03-31/functions/{name}/invocations    the Invoke API (invoke_api)
    POST /2021-11-15/functions/{name}/response-streaming-invocations
                                                     InvokeWithResponseStream (eventstream)
    every other path                                 the HTTP contract via a Function URL event

and one Runtime API listener per sandbox on 127.0.0.1 (runtime_api), whose
plain `127.0.0.1:PORT` is the sandbox's AWS_LAMBDA_RUNTIME_API, as on Lambda.

Sandboxes of an Image function are `python -m runtime` processes (sandboxes), or
with `--image` containers of that image (containers); those of a Zip Python
function are `python -m awslambdaric module.function` processes in its CodeUri
(ric), with or without `--image`. All are scheduled by the pool (pool),
configured from template.yaml (template), reporting REPORT lines (report) on
stdout; their own output goes to stderr, prefixed.

A sandbox's environment, later entries winning:

1. the emulator's environment (AWS_LAMBDA_* removed),
2. the function's Environment.Variables from the template (unresolvable ones left out),
3. local wiring: THAW_JOB_STORE, THAW_BUNDLE_SOURCE, THAW_CACHE_DIR and
   THAW_STATE_DIR always take the emulator's local values (its environment,
   else the laptop defaults: ./bundles, SQLite in .thaw/, made absolute), so
   AWS wiring in the template (dynamodb://, s3://) never reaches a local
   sandbox, and every sandbox shares one job store,
4. any other THAW_* set in the emulator's environment (so `THAW_WAIT_S=1 thaw emulate` works),
5. Lambda's platform variables (AWS_LAMBDA_RUNTIME_API, AWS_LAMBDA_FUNCTION_NAME, ...).

A container sandbox gets 2, 4 and 5 only, on top of its image's own
environment, and a job store shared by every container (see containers). A Zip
function's sandbox gets all five, then what Lambda's managed runtimes set
(LAMBDA_TASK_ROOT, _HANDLER, AWS_EXECUTION_ENV; see ric).

May import runtime.aws (Function URL events) and below; it never loads a model
itself: sandboxes are separate processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import uvicorn
from starlette.applications import Starlette

from runtime.emulator import eventstream, function_url, invoke_api
from runtime.emulator.containers import ContainerLauncher, check_image, find_engine
from runtime.emulator.invoke_api import EventQueue
from runtime.emulator.pool import Pool
from runtime.emulator.ric import RicLauncher, banner_lines, check_installed
from runtime.emulator.sandboxes import Launcher, ProcessLauncher
from runtime.emulator.template import Template, load_template
from runtime.errors import ConfigError
from runtime.settings import Settings

DEFAULT_MAX_SANDBOXES = 4
_PLATFORM_ONLY = ("AWS_LAMBDA_", "_HANDLER", "_X_AMZN_TRACE_ID")


def _absolute_sqlite(url: str) -> str:
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/"):
        return prefix + str(Path(url[len(prefix) :]).resolve())
    return url


def local_environment(environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(base, local): the inherited environment, and what overrides the template."""
    base = {k: v for k, v in environ.items() if not k.startswith(_PLATFORM_ONLY)}
    settings = Settings.from_env(environ)
    local = {k: v for k, v in environ.items() if k.startswith("THAW_")}
    local.update(
        {
            "THAW_JOB_STORE": _absolute_sqlite(settings.job_store),
            "THAW_BUNDLE_SOURCE": (
                settings.bundle_source
                if "://" in settings.bundle_source
                else str(Path(settings.bundle_source).resolve())
            ),
            "THAW_CACHE_DIR": str(Path(settings.cache_dir).resolve()),
            "THAW_STATE_DIR": str(Path(settings.state_dir).resolve()),
        }
    )
    return base, local


@dataclass(frozen=True)
class EmulatorConfig:
    template: Template
    max_sandboxes: int = DEFAULT_MAX_SANDBOXES
    idle_timeout_s: float = 300.0
    # A container image to run sandboxes from, and the engine's CLI (podman or docker).
    image: str | None = None
    engine: str | None = None


def make_launchers(config: EmulatorConfig, environ: Mapping[str, str]) -> dict[str, Launcher]:
    """A launcher per PackageType: Zip functions always run under awslambdaric; Image
    functions as `python -m runtime` processes, or as containers with `--image`."""
    base, local = local_environment(environ)
    image: Launcher
    if config.image is None:
        image = ProcessLauncher(base, local)
    else:
        engine = config.engine or find_engine()
        jobs_dir = Path(Settings.from_env(environ).state_dir).resolve() / "emulate-image-jobs"
        image = ContainerLauncher(engine, config.image, local, jobs_dir)
    return {"Image": image, "Zip": RicLauncher(base, local)}


@asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    config: EmulatorConfig = app.state.config
    pool = Pool(
        config.template,
        max_sandboxes=config.max_sandboxes,
        idle_timeout_s=config.idle_timeout_s,
        launchers=make_launchers(config, os.environ),
        out=app.state.out,
        echo=app.state.echo,
    )
    events = EventQueue(pool)
    app.state.pool, app.state.template, app.state.events = pool, config.template, events
    reaper = asyncio.create_task(pool.reap_idle())
    try:
        yield
    finally:
        reaper.cancel()
        await events.aclose()
        await pool.shutdown()


def create_emulator_app(
    config: EmulatorConfig, *, out: IO[str] = sys.stdout, echo: IO[str] = sys.stderr
) -> Starlette:
    routes = [*eventstream.routes, *invoke_api.routes, *function_url.routes]
    app = Starlette(routes=routes, lifespan=_lifespan)
    app.state.config, app.state.out, app.state.echo = config, out, echo
    return app


# The environment lines the banner prints: boto3 and the AWS CLI need credentials
# to sign with (and a region) before they send anything, local endpoint or not.
CREDENTIALS = (
    "export AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_DEFAULT_REGION=us-east-1"
)


def first_steps(url: str, function: str = "NAME", *, thaw: bool = True) -> str:
    """What a first boto3 or AWS CLI call needs to be told, said at startup.

    `thaw`: the example function runs Thaw (an Image function), whose events name a
    handler and may be answered with a job; a Zip function's example event is `{}`.
    """
    payload = '{"handler": "echo", "input": {}}' if thaw else "{}"
    said = (
        "thaw emulate: boto3 and the AWS CLI sign every request, even to a local endpoint,\n"
        "  and fail without credentials; the emulator checks none, so any will do:\n"
        f"    {CREDENTIALS}\n"
        f"  then: aws lambda invoke --endpoint-url {url} --function-name {function} \\\n"
        f"      --payload '{payload}' "
        "--cli-binary-format raw-in-base64-out out.json\n"
        "  (or, in code, botocore.config.Config(signature_version=botocore.UNSIGNED))"
    )
    if not thaw:
        return said
    return said + (
        "\nthaw emulate: a RequestResponse invoke waits for the handler up to the event's\n"
        f"  wait_s, else THAW_WAIT_S (default {Settings.wait_s:g} s), never past the "
        "function's Timeout;\n"
        '  past that it answers a job object, {"thaw": "job", ..., "poll": {"job": ID}}:\n'
        "  invoke again with that poll event, or set THAW_WAIT_S near the Timeout to wait"
    )


def run_emulator(
    port: int,
    template: Path,
    max_sandboxes: int | None,
    idle_timeout_s: float,
    host: str = "127.0.0.1",
    image: str | None = None,
    engine: str | None = None,
    insecure: bool = False,
) -> int:
    """Serve until SIGINT/SIGTERM; every sandbox is stopped on the way out.

    The emulator checks no credential: a Function URL's `AuthType: AWS_IAM` is
    not enforced (no SigV4 signature is verified) and the Invoke API takes any
    caller. So it refuses a non-loopback `host` unless `insecure` says the
    network in front is trusted, as `thaw serve` refuses one without keys.
    """
    # The rule `thaw serve` binds by, its socket and its way of running uvicorn.
    from runtime.http.server import is_loopback, listen, run_server

    if not is_loopback(host) and not insecure:
        raise ConfigError(
            f"refusing to listen on {host}: thaw emulate checks no AWS_IAM signature or key, "
            "so anyone who reaches it may invoke every function; bind 127.0.0.1, or pass "
            "--insecure to expose it anyway"
        )
    loaded = load_template(template)
    check_installed(loaded)
    if image is not None:
        engine = find_engine(engine)
        check_image(engine, image)
    sock = listen(host, port)
    bound = sock.getsockname()[1]
    config = EmulatorConfig(
        loaded,
        max_sandboxes=max_sandboxes or DEFAULT_MAX_SANDBOXES,
        idle_timeout_s=idle_timeout_s,
        image=image,
        engine=engine,
    )
    app = create_emulator_app(config)
    functions = ", ".join(f.logical_id for f in loaded.functions.values())
    runs = f"image {image}" if image else "processes"
    zipped = "".join(line + "\n" for line in banner_lines(loaded))
    # The example names an Image function (Thaw's runtime) where there is one.
    images = [f for f in loaded.functions.values() if f.package_type == "Image"]
    example = (images or list(loaded.functions.values()))[0]
    print(
        f"thaw emulate: listening on http://{host}:{bound} ({functions}; {runs}; "
        f"max {config.max_sandboxes} sandboxes, idle timeout {idle_timeout_s:g} s)\n"
        + zipped
        + first_steps(f"http://{host}:{bound}", example.logical_id, thaw=bool(images)),
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    )
    interrupted = False

    def on_signal(sig: int) -> None:
        # The sandboxes stop first: their long-polls would hold the shutdown up. A
        # SIGTERM is a requested stop (exit 0), a SIGINT an interrupted command (exit
        # 130); a second SIGINT forces the exit.
        nonlocal interrupted
        pool: Pool | None = getattr(app.state, "pool", None)
        if pool is not None:
            pool.begin_shutdown()
        if sig == signal.SIGINT:
            server.force_exit = interrupted
            interrupted = True
        server.should_exit = True

    started = asyncio.run(run_server(server, sock, lambda: None, on_signal))
    sock.close()
    if not started:
        return 1
    return 130 if interrupted else 0
