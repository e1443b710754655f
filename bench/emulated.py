"""A cold start as Lambda reports it: `thaw emulate`'s REPORT line for a first invocation.

    .venv/bin/python bench/emulated.py [--runs 3] [--handler embed]

Each run starts a fresh `thaw emulate` (the repository's template.yaml, one
sandbox) and invokes the handler once through the Lambda Invoke API (boto3,
`LogType: Tail`) with the same event as bench/firstanswer.py. The sandbox is
new, so the REPORT carries `Init Duration` (process start to its first
`next`) and `Duration` (the event to the instance asking for the next one:
fetch, load, init, warm-up and run). Prints one markdown table: each run, then
the medians (each column its own); the caller's own wall time from the invoke to the answer beside
them. Every process it starts runs on 127.0.0.1 and is stopped before it returns.
"""

from __future__ import annotations

import argparse
import base64
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

from bench.common import lambda_client, median, runtime_env, start_emulator, stopping  # noqa: E402
from bench.firstanswer import BUNDLES, event_for  # noqa: E402
from runtime.cli.coldstart import compile_bytecode  # noqa: E402

_FIELD = re.compile(r"(Init Duration|Billed Duration|Duration|Max Memory Used): ([\d.]+)")


def report_fields(log: str) -> dict[str, float]:
    """The numbers of the REPORT line in a tail log: {"Duration": ms, "Init Duration": ms, ...}."""
    line = next((ln for ln in log.splitlines() if ln.startswith("REPORT ")), "")
    return {name: float(value) for name, value in _FIELD.findall(line)}


def one_cold_invocation(handler: str, tmp: Path) -> dict[str, float]:
    env = runtime_env(tmp, HANDLERS=f"handlers.{handler}")
    with stopping([]) as procs:
        emulator = start_emulator(procs, ROOT / "template.yaml", env, tmp / "emulate.log")
        client = lambda_client(emulator.port)
        payload = orjson.dumps({"handler": handler, "input": event_for(handler), "wait_s": 300})
        started = time.monotonic()
        answer = client.invoke(FunctionName="ThawFunction", Payload=payload, LogType="Tail")
        wall_ms = (time.monotonic() - started) * 1000.0
        body: Any = orjson.loads(answer["Payload"].read())
        if answer.get("FunctionError") or "output" not in body:
            raise RuntimeError(f"the invocation failed: {body}")
        fields = report_fields(base64.b64decode(answer["LogResult"]).decode(errors="replace"))
    if "Init Duration" not in fields or "Duration" not in fields:
        raise RuntimeError(f"no cold REPORT in the tail log: {fields}")
    return {**fields, "total_ms": fields["Init Duration"] + fields["Duration"], "wall_ms": wall_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--handler", default="embed", choices=sorted(BUNDLES))
    args = parser.parse_args(argv)
    if not (ROOT / "bundles" / BUNDLES[args.handler] / "bundle.json").is_file():
        print(f"bundle {BUNDLES[args.handler]} not built: make bundles", file=sys.stderr)
        return 1
    compile_bytecode(["handlers"])
    runs: list[dict[str, float]] = []
    for index in range(max(1, args.runs)):
        with tempfile.TemporaryDirectory(prefix="thaw-emulated-") as tmp:
            runs.append(one_cold_invocation(args.handler, Path(tmp)))
        print(f"[emulated] run {index + 1}: {runs[-1]}", file=sys.stderr, flush=True)
    lines = [
        f"| `{args.handler}`, cold | Init Duration | Duration | Init + Duration "
        "| caller's wall time | Max Memory Used |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def row(label: str, r: dict[str, float]) -> str:
        return (
            f"| {label} | {r['Init Duration']:.0f} ms | {r['Duration']:.0f} ms "
            f"| {r['total_ms']:.0f} ms "
            f"| {r['wall_ms']:.0f} ms | {r.get('Max Memory Used', 0):.0f} MB |"
        )

    lines += [row(f"run {i + 1}", r) for i, r in enumerate(runs)]
    medians = {k: median([r[k] for r in runs]) for k in runs[0]}
    lines.append(row(f"median of {len(runs)}", medians))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
