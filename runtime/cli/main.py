"""The `thaw` command line.

    thaw bundle build SRC --name N [--version V] [--out DIR] [--config JSON|@file] [--json]
                      [--convert-pth] [--dtype D] [--per-request-bytes N]
    thaw bundle verify PATH [--json]
    thaw invoke HANDLER --event JSON|@file.json
    thaw serve [--host 127.0.0.1] [--port 8080] [--insecure]
    thaw emulate [--host 127.0.0.1 [--insecure]] [--port 9000] [--template template.yaml]
                 [--max-sandboxes N] [--idle-timeout S] [--image IMAGE [--engine podman|docker]]
    thaw coldstart HANDLER [--event JSON] [--runs N] [--json] [--bare [--repeat N]]
                   [--waterfall STEM]
    thaw init PATH [--example blank|encoder|causal-lm]
    thaw image build [--tag T] [--wheelhouse DIR] [--gpu] [--http] [--json]
    thaw keys hash < key            print a key-file line (THAW_API_KEYS_FILE or
                                    THAW_OPERATOR_KEYS_FILE) for the key on stdin
    thaw keys new                   print a new random key (256 bits), for a tenant or an operator
    thaw --version

Every command that fails prints one line, `thaw: error: ...`, on stderr and
exits 1; 2 when the command line is wrong (a flag, an argument, an --event or
--config that cannot be read or parsed, an unknown handler), as argparse's own
errors do; 3 when a handler refused its event (`invalid-input`). Heavy modules
are imported inside the command that needs them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

import orjson

from runtime.errors import ConfigError, ThawError
from runtime.version import __version__
from runtime.wire.render import (
    CLI_PREFIX,
    EXIT_FAILED,
    EXIT_USAGE,
    cli_exit_code,
    cli_line,
    job_error,
)


class UsageError(Exception):
    """The command line is wrong: exit 2, as argparse's own errors."""


class _Parser(argparse.ArgumentParser):
    """argparse with the one prefix, `thaw: error: `, in every subcommand's errors
    (its own would be `thaw bundle verify: error: `). Subparsers are made of the
    same class."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{CLI_PREFIX}{message}\n")


def _read_json_arg(text: str, what: str) -> Any:
    """JSON given inline or as @path."""
    raw: bytes | str = text
    if text.startswith("@"):
        try:
            raw = Path(text[1:]).read_bytes()
        except OSError as exc:
            raise UsageError(f"{what}: cannot read {text[1:]}: {exc.strerror}") from exc
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise UsageError(f"{what}: not valid JSON ({exc})") from exc


def _cmd_bundle_build(args: argparse.Namespace) -> int:
    from runtime.cli.bundle import build

    config = _read_json_arg(args.config, "--config") if args.config else {}
    if not isinstance(config, dict):
        raise UsageError("--config must be a JSON object")
    return build(args, config)


def _cmd_bundle_verify(args: argparse.Namespace) -> int:
    from runtime.bundles.verify import verify_bundle
    from runtime.cli.bundle import print_bundle

    manifest = verify_bundle(Path(args.path))
    print_bundle("ok", manifest, Path(args.path), args.json)
    return 0


def _cmd_invoke(args: argparse.Namespace) -> int:
    from runtime.cli.invoke import invoke_once

    event = _read_json_arg(args.event, "--event")
    return invoke_once(args.handler, event, stream=args.stream)


def _cmd_serve(args: argparse.Namespace) -> int:
    from runtime import preload

    preload.start()  # before the server's imports, beside which it runs
    from runtime.http.server import serve

    return serve(host=args.host, port=args.port, insecure=args.insecure)


def _cmd_emulate(args: argparse.Namespace) -> int:
    try:
        from runtime.emulator import run_emulator
    except ModuleNotFoundError as exc:
        if exc.name != "yaml":
            raise
        raise ConfigError(
            "thaw emulate reads template.yaml with PyYAML, which is not installed: "
            "pip install 'thaw-runtime[emulator]'"
        ) from exc

    code: int = run_emulator(
        port=args.port,
        template=_template(args.template),
        max_sandboxes=args.max_sandboxes,
        idle_timeout_s=args.idle_timeout,
        host=args.host,
        image=args.image,
        engine=args.engine,
        insecure=args.insecure,
    )
    return code


def _template(given: str | None) -> Path:
    """--template, else the project's template.yaml (docs/projects.md), else ./template.yaml."""
    if given is not None:
        return Path(given)
    from runtime.settings import find_project

    root = find_project(Path.cwd())
    return (root if root is not None else Path()) / "template.yaml"


def _cmd_coldstart(args: argparse.Namespace) -> int:
    from runtime.cli.coldstart import run_coldstart

    if args.event:
        event = _read_json_arg(args.event, "--event")
    else:  # the handler's first warm-up example: a request it is sure to accept
        from runtime.registry import discover
        from runtime.settings import Settings

        spec = discover(Settings.from_env().handlers).handler(args.handler)
        # An accelerator's, for a handler that warms nothing on a CPU.
        examples = list(spec.warmup) or list(spec.accelerator_warmup)
        event = dict(examples[0]) if examples else {}
    code: int = run_coldstart(
        args.handler,
        event=event,
        runs=args.runs,
        as_json=args.json,
        bare=args.bare,
        repeat=args.repeat,
        waterfall=Path(args.waterfall) if args.waterfall else None,
    )
    return code


def _cmd_init(args: argparse.Namespace) -> int:
    from runtime.cli.init import create, next_steps

    create(Path(args.path), args.example)
    print(next_steps(Path(args.path), args.example))
    return 0


def _cmd_image_build(args: argparse.Namespace) -> int:
    from runtime.cli.image import build_command

    return build_command(args)


def _cmd_keys_hash(args: argparse.Namespace) -> int:
    from runtime.http.auth import print_hash_line

    return print_hash_line()


def _cmd_keys_new(args: argparse.Namespace) -> int:
    import secrets

    # 32 bytes from the OS CSPRNG, URL-safe: a bearer token needs no quoting anywhere.
    print(secrets.token_urlsafe(32))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="thaw", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"thaw {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    bundle = sub.add_parser("bundle", help="build and verify model bundles")
    bsub = bundle.add_subparsers(dest="bundle_command", required=True)
    build = bsub.add_parser(
        "build", help="write a bundle from safetensors/JSON/text (or .gguf/.pth)"
    )
    build.add_argument(
        "src",
        help="a directory of safetensors/JSON/text files, a Hugging Face save_pretrained "
        "folder (its config.json becomes the config), or one .gguf/.pth/.pt file to convert",
    )
    build.add_argument(
        "--name", required=True, help="the bundle's name, as a builder's @bundle(NAME) names it"
    )
    build.add_argument(
        "--version", default="1", help="a label for this build (default: 1); the id is the hash"
    )
    build.add_argument(
        "--out",
        metavar="DIR",
        help="where the bundle is written (default: SRC itself for a plain directory, "
        "bundles/NAME for a Hugging Face folder or a conversion)",
    )
    build.add_argument(
        "--config",
        metavar="JSON|@FILE",
        help="the config handed to the builder, as JSON or @file.json (merged over a Hugging "
        "Face folder's config.json)",
    )
    build.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16", "fp16", "bf16"],
        help="convert floating weights to this dtype once when they load (kept in the "
        "manifest's 'thaw' settings, apart from the model's config; default: as stored)",
    )
    build.add_argument(
        "--per-request-bytes",
        type=int,
        default=None,
        metavar="N",
        help="memory one request needs beyond the weights; admission reserves it per "
        "concurrent request (default: estimated from a Hugging Face config.json or a "
        "conversion, else 0 with a warning)",
    )
    build.add_argument(
        "--convert-pth",
        action="store_true",
        help="convert the .pth/.pt files of a SRC directory to safetensors (tensors only)",
    )
    build.add_argument("--json", action="store_true", help="print the result as one JSON object")
    build.set_defaults(func=_cmd_bundle_build)
    verify = bsub.add_parser("verify", help="check manifest, file set, sizes and hashes")
    verify.add_argument("path", help="the bundle directory (holding bundle.json)")
    verify.add_argument("--json", action="store_true", help="print the result as one JSON object")
    verify.set_defaults(func=_cmd_bundle_verify)

    invoke = sub.add_parser("invoke", help="run one invocation in-process")
    invoke.add_argument("handler", help="the handler's name, as @handler(NAME) declares it")
    invoke.add_argument(
        "--event", default="{}", help="the event, as JSON or @file.json (default: {})"
    )
    invoke.add_argument(
        "--stream", action="store_true", help="print a generator handler's items as they come"
    )
    invoke.set_defaults(func=_cmd_invoke)

    serve = sub.add_parser("serve", help="serve the HTTP contract")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback)"
    )
    serve.add_argument("--port", type=int, default=8080, help="port to bind (default: 8080)")
    serve.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback bind without API keys"
    )
    serve.set_defaults(func=_cmd_serve)

    emulate = sub.add_parser("emulate", help="local Lambda invocation emulator")
    emulate.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback)"
    )
    emulate.add_argument(
        "--port", type=int, default=9000, help="port of the Lambda Invoke API (default: 9000)"
    )
    emulate.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback bind: the emulator authenticates nobody (no AWS_IAM check)",
    )
    emulate.add_argument(
        "--template",
        default=None,
        help="the SAM template whose function settings are emulated (default: template.yaml "
        "of the project, else of the working directory)",
    )
    emulate.add_argument(
        "--max-sandboxes", type=int, default=None, help="most execution environments at once"
    )
    emulate.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds an idle execution environment is kept before it is reaped (default: 300)",
    )
    emulate.add_argument(
        "--image", help="run each sandbox as a container of IMAGE (as sam local start-lambda)"
    )
    emulate.add_argument(
        "--engine", choices=["podman", "docker"], help="container CLI (default: podman, or docker)"
    )
    emulate.set_defaults(func=_cmd_emulate)

    cold = sub.add_parser("coldstart", help="cold-start breakdown of one handler")
    cold.add_argument("handler", help="the handler's name, as @handler(NAME) declares it")
    cold.add_argument(
        "--event",
        default=None,
        help="the event, as JSON or @file.json (default: the handler's first warm-up example)",
    )
    cold.add_argument("--runs", type=int, default=20, help="warm invocations after the first")
    cold.add_argument("--json", action="store_true", help="print the result as one JSON object")
    cold.add_argument(
        "--bare", action="store_true", help="also run the same work as a bare script; the ratio"
    )
    cold.add_argument(
        "--repeat", type=int, default=1, help="with --bare: N interleaved runs of each; medians"
    )
    cold.add_argument(
        "--waterfall",
        metavar="STEM",
        help="also draw the run as a waterfall: STEM.svg and STEM.html",
    )
    cold.set_defaults(func=_cmd_coldstart)

    init = sub.add_parser("init", help="create a function project (docs/projects.md)")
    init.add_argument("path", help="the new project's directory (absent or empty)")
    init.add_argument(
        "--example",
        choices=["blank", "encoder", "causal-lm"],
        default="blank",
        help="the starting handler: blank (no model), encoder (transformers embeddings), "
        "causal-lm (transformers generation, streamed); default blank",
    )
    init.set_defaults(func=_cmd_init)

    image = sub.add_parser("image", help="build the project's container images")
    isub = image.add_subparsers(dest="image_command", required=True)
    ibuild = isub.add_parser(
        "build",
        help="lock the project's dependencies (thaw.lock), build its Lambda image and check "
        "that every handler module imports in it",
    )
    ibuild.add_argument("--tag", help="image name (default: localhost/PROJECT:latest)")
    ibuild.add_argument(
        "--wheelhouse",
        metavar="DIR",
        help="install from the wheels in DIR only: the build reaches no network",
    )
    ibuild.add_argument(
        "--gpu", action="store_true", help="lock and install torch's CUDA build (default: CPU)"
    )
    ibuild.add_argument(
        "--http", action="store_true", help="also build the plain HTTP image (TAG with -http)"
    )
    ibuild.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ibuild.set_defaults(func=_cmd_image_build)

    keys = sub.add_parser("keys", help="API key helpers").add_subparsers(required=True)
    keys.add_parser("new", help="print a new random key").set_defaults(func=_cmd_keys_new)
    keys.add_parser("hash", help="read a key on stdin, print its key-file line").set_defaults(
        func=_cmd_keys_hash
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 on a bad flag, with argparse's line
    try:
        result: int = args.func(args)
        return result
    except UsageError as exc:
        print(CLI_PREFIX + str(exc), file=sys.stderr)
        return EXIT_USAGE
    except ThawError as exc:
        if getattr(args, "json", False) and getattr(args, "bundle_command", None):
            # A script reading stdout gets JSON either way.
            print(orjson.dumps({"error": job_error(exc)}).decode())
        print(cli_line(exc), file=sys.stderr)
        return cli_exit_code(exc)
    except OSError as exc:
        # The machine's answer (a full disk, a read-only or missing path): one line
        # that names the file, not a traceback.
        if getattr(args, "json", False) and getattr(args, "bundle_command", None):
            print(orjson.dumps({"error": job_error(exc)}).decode())
        print(f"{CLI_PREFIX}{exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
