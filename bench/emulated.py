"""A cold start as Lambda reports it: `thaw emulate`'s REPORT for a first invocation,
Thaw against the bare script run as a plain Python Lambda function.

    .venv/bin/python bench/emulated.py [--runs 3] [--handler embed,classify,generate]
        [--read-only]

For each handler, `--runs` rounds, interleaved (Thaw, bare; then bare, Thaw;
...). Each cold start is a fresh `thaw emulate` (one sandbox per function, a
fresh state directory) over a template written into a temporary directory with
two functions:

- `ThawFunction`: the repository's (template.yaml: its MemorySize, Timeout and
  Environment), run as `python -m runtime` (PackageType Image, no `--image`);
- `BareFunction`: a Zip python3.X function, CodeUri the repository, Handler
  `bench.bare_lambda.handler`: the bare script of runtime/cli/bare.py in
  Lambda's usual style (torch, the safetensors and the model built at import,
  the init phase; the handler called once per event), run under awslambdaric,
  with the same MemorySize, Timeout and Environment plus BARE_HANDLER.

Each is invoked once, cold, through the Lambda Invoke API (boto3, `LogType:
Tail`) with the same event as bench/firstanswer.py, and its REPORT read from
the tail log: `Init Duration` (process start to its first `next`) and
`Duration` (the event to the sandbox asking for the next one). For Thaw the
model's fetch, load, init and warm-up are in Duration (it loads on the first
event); for the bare function they are in Init Duration. Prints one markdown
table per handler: the medians of each (each column its own), and Thaw / bare,
whose Init + Duration is held to the issue's target (1.05x, issue 29). With
`--read-only` both functions read the bundle from a tmpfs sealed read-only (as
Lambda's image filesystem is; bench/firstanswer.py's `read_only_copy`, root
only), where Thaw maps the weights for the build. Every process it starts runs
on 127.0.0.1 and is stopped before it returns.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    fmt_x,
    lambda_client,
    median,
    runtime_env,
    start_emulator,
    stopping,
    verdict,
)
from bench.firstanswer import BUNDLES, TARGET_X, event_for, read_only_copy  # noqa: E402
from runtime.cli.coldstart import compile_bytecode  # noqa: E402
from runtime.emulator.template import load_template  # noqa: E402

THAW, BARE = "ThawFunction", "BareFunction"
COLUMNS = ("Init Duration", "Duration", "total_ms", "Max Memory Used", "wall_ms")
_FIELD = re.compile(r"(Init Duration|Billed Duration|Duration|Max Memory Used): ([\d.]+)")


def report_fields(log: str) -> dict[str, float]:
    """The numbers of the REPORT line in a tail log: {"Duration": ms, "Init Duration": ms, ...}."""
    line = next((ln for ln in log.splitlines() if ln.startswith("REPORT ")), "")
    return {name: float(value) for name, value in _FIELD.findall(line)}


def write_template(handler: str, path: Path, source: Path | None = None) -> Path:
    """Both functions, with the repository's ThawFunction settings (JSON is YAML too),
    reading bundles from `source` where given."""
    thaw = load_template(ROOT / "template.yaml").functions[THAW]
    settings = {"MemorySize": thaw.memory_mb, "Timeout": int(thaw.timeout_s)}
    environment = dict(thaw.environment)
    if source is not None:
        environment["THAW_BUNDLE_SOURCE"] = str(source)
    runtime = f"python{sys.version_info.major}.{sys.version_info.minor}"
    resources = {
        THAW: {
            "Type": "AWS::Serverless::Function",
            "Properties": {
                "PackageType": "Image",
                **settings,
                "Environment": {"Variables": environment},
            },
        },
        BARE: {
            "Type": "AWS::Serverless::Function",
            "Properties": {
                "PackageType": "Zip",
                "Runtime": runtime,
                "Handler": "bench.bare_lambda.handler",
                "CodeUri": str(ROOT),
                **settings,
                "Environment": {"Variables": {**environment, "BARE_HANDLER": handler}},
            },
        },
    }
    path.write_bytes(orjson.dumps({"Resources": resources}, option=orjson.OPT_INDENT_2))
    return path


def one_cold_invocation(
    handler: str, function: str, tmp: Path, source: Path | None = None
) -> dict[str, float]:
    """A fresh `thaw emulate`, and `function` invoked once through it: its cold REPORT."""
    env = runtime_env(tmp, HANDLERS=f"handlers.{handler}")
    if source is not None:
        env["THAW_BUNDLE_SOURCE"] = str(source)
    template = write_template(handler, tmp / "template.yaml", source)
    with stopping([]) as procs:
        emulator = start_emulator(procs, template, env, tmp / "emulate.log")
        client = lambda_client(emulator.port)
        event = event_for(handler)
        if function == THAW:
            event = {"handler": handler, "input": event, "wait_s": 300}
        started = time.monotonic()
        answer = client.invoke(FunctionName=function, Payload=orjson.dumps(event), LogType="Tail")
        wall_ms = (time.monotonic() - started) * 1000.0
        body: Any = orjson.loads(answer["Payload"].read())
        if answer.get("FunctionError") or "output" not in body:
            raise RuntimeError(f"{function}: the invocation failed: {body}\n{emulator.log()}")
        fields = report_fields(base64.b64decode(answer["LogResult"]).decode(errors="replace"))
    if "Init Duration" not in fields or "Duration" not in fields:
        raise RuntimeError(f"{function}: no cold REPORT in the tail log: {fields}")
    return {**fields, "total_ms": fields["Init Duration"] + fields["Duration"], "wall_ms": wall_ms}


def measure(
    handler: str, runs: int, source: Path | None = None
) -> dict[str, list[dict[str, float]]]:
    """`runs` cold starts of each function, interleaved: Thaw, bare; bare, Thaw; ..."""
    found: dict[str, list[dict[str, float]]] = {THAW: [], BARE: []}
    for index in range(runs):
        order = (THAW, BARE) if index % 2 == 0 else (BARE, THAW)
        for function in order:
            with tempfile.TemporaryDirectory(prefix="thaw-emulated-") as tmp:
                found[function].append(one_cold_invocation(handler, function, Path(tmp), source))
            shown = {k: round(v) for k, v in found[function][-1].items()}
            print(f"[emulated] {handler} round {index + 1} {function}: {shown}", file=sys.stderr)
    return found


def table(handler: str, found: dict[str, list[dict[str, float]]]) -> str:
    """One markdown table: the medians of each function, and Thaw / bare."""
    medians = {f: {k: median([r[k] for r in runs]) for k in COLUMNS} for f, runs in found.items()}
    thaw, bare = medians[THAW], medians[BARE]
    ratios = {k: thaw[k] / bare[k] if bare[k] else float("nan") for k in COLUMNS}
    ratio = ratios["total_ms"]
    runs = len(found[THAW])
    lines = [
        f"| `{handler}`, cold, medians of {runs} | Init Duration | Duration | Init + Duration "
        "| Max Memory Used | caller's wall time |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def row(label: str, r: dict[str, float]) -> str:
        return (
            f"| {label} | {r['Init Duration']:.0f} ms | {r['Duration']:.0f} ms "
            f"| {r['total_ms']:.0f} ms | {r['Max Memory Used']:.0f} MB | {r['wall_ms']:.0f} ms |"
        )

    lines.append(row("Thaw (`python -m runtime`)", thaw))
    lines.append(row("bare script as a Lambda handler (awslambdaric)", bare))
    lines.append(
        f"| Thaw / bare | {fmt_x(ratios['Init Duration'])} | {fmt_x(ratios['Duration'])} "
        f"| **{fmt_x(ratio)}** (target <= {TARGET_X:.2f}x: {verdict(ratio <= TARGET_X)}) "
        f"| {fmt_x(ratios['Max Memory Used'])} | {fmt_x(ratios['wall_ms'])} |"
    )
    spread = "; ".join(
        f"{label} " + ", ".join(f"{r['total_ms']:.0f}" for r in found[f])
        for label, f in (("Thaw", THAW), ("bare", BARE))
    )
    return (
        "\n".join(lines)
        + "\n\nEach cell is its own column's median (Init + Duration is not the sum of two cells)."
        + f"\nInit + Duration of each run (ms, in order): {spread}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--handler",
        default="embed",
        help=f"one or more of {','.join(sorted(BUNDLES))}, comma-separated (default: embed)",
    )
    parser.add_argument(
        "--read-only",
        action="store_true",
        help="read the bundle from a tmpfs sealed read-only, as Lambda's image is (root)",
    )
    args = parser.parse_args(argv)
    handlers = [h.strip() for h in args.handler.split(",") if h.strip()]
    unknown = [h for h in handlers if h not in BUNDLES]
    if unknown or not handlers:
        parser.error(f"--handler: choose from {', '.join(sorted(BUNDLES))}")
    for handler in handlers:
        if not (ROOT / "bundles" / BUNDLES[handler] / "bundle.json").is_file():
            print(f"bundle {BUNDLES[handler]} not built: make bundles", file=sys.stderr)
            return 1
    compile_bytecode([*(f"handlers.{h}" for h in handlers), "bench.bare_lambda"])
    for handler in handlers:
        with contextlib.ExitStack() as stack:
            source = None
            if args.read_only:
                tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="thaw-ro-")))
                source = stack.enter_context(read_only_copy(BUNDLES[handler], tmp / "ro"))
                if source is None:
                    print("--read-only needs the right to mount a tmpfs (root)", file=sys.stderr)
                    return 1
            found = measure(handler, max(1, args.runs), source)
        print(table(handler, found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
