"""Process start -> first answer: Thaw against a bare script doing the same work.

    .venv/bin/python bench/firstanswer.py [--repeat 5] [--handlers embed,classify,generate]

For each shipped model handler, in one run, interleaved: a fresh `thaw serve`
process (spawn -> /healthz -> POST /invoke -> the answer), and a fresh bare
script (`python -m runtime.cli.bare`: import torch, read the same safetensors,
build the same model with the handler's own builder, call the handler once;
no server, no verification, no warm-up). Medians of `--repeat` runs each, the
phases of the Thaw run nearest its median, and the ratio (target <= 1.3x).

Two kinds of node, each measured: `warm node`, where the node's state
directory survives between processes (as on a server restart: the bundle's
files were verified before and are not hashed again, load estimates exist),
and `fresh node`, a new state directory per start (as every Lambda cold start
with the bundle baked into the image: every file is hashed again).

The same requests as the issue: embed two short sentences; classify one small
JPEG; generate "The capital of France is" with max_tokens 8.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Row, fmt_s, fmt_x, median, render, runtime_env, verdict  # noqa: E402
from runtime.cli.coldstart import compile_bytecode, measure, measure_bare  # noqa: E402

TARGET_X = 1.3
BUNDLES = {"embed": "minilm", "classify": "efficientnet", "generate": "smollm2"}


def event_for(handler: str) -> Any:
    if handler == "embed":
        return {"texts": ["A man is eating food.", "A man is riding a horse."]}
    if handler == "classify":
        from handlers.classify import _SMALL_JPEG

        return {"image": _SMALL_JPEG}
    return {"prompt": "The capital of France is", "max_tokens": 8}


def one_round(handler: str, state: Path, fresh_node: bool) -> tuple[dict[str, Any], float]:
    if fresh_node:
        shutil.rmtree(state, ignore_errors=True)
    env = runtime_env(state.parent, STATE_DIR=str(state), HANDLERS=f"handlers.{handler}")
    thaw = measure(handler, event_for(handler), 0, env)
    bare = measure_bare(handler, event_for(handler), env)
    return thaw, bare["first_answer_ms"]


def run(*, quick: bool = False, repeat: int = 5, handlers: list[str] | None = None) -> list[Row]:
    repeat = 1 if quick else repeat
    compile_bytecode(["handlers"])
    rows: list[Row] = []
    for node in ("warm node", "fresh node"):
        for handler in handlers or list(BUNDLES):
            if not (ROOT / "bundles" / BUNDLES[handler] / "bundle.json").is_file():
                rows.append(Row(f"`{handler}`", "bundle not built", verdict="skipped"))
                continue
            with tempfile.TemporaryDirectory(prefix="thaw-first-") as tmp:
                state = Path(tmp) / "state"
                if node == "warm node":
                    one_round(handler, state, fresh_node=False)  # the node's first start
                results = [
                    one_round(handler, state, fresh_node=node == "fresh node")
                    for _ in range(repeat)
                ]
            thaw_ms = median([t["process_start_to_first_answer_ms"] for t, _ in results])
            bare_ms = median([b for _, b in results])
            nearest = min(
                (t for t, _ in results),
                key=lambda t: abs(t["process_start_to_first_answer_ms"] - thaw_ms),
            )
            phases = nearest["phases_ms"]
            split = ", ".join(
                f"{p} {phases[p]:.0f}" for p in ("fetch", "load", "init", "warmup", "run")
            )
            ratio = thaw_ms / bare_ms
            rows.append(
                Row(
                    f"{node}: `{handler}` process start -> first answer "
                    f"(median of {len(results)}; healthz "
                    f"{nearest['process_start_to_healthy_ms']:.0f} ms, {split} ms)",
                    fmt_s(thaw_ms / 1000),
                    f"{fmt_s(bare_ms / 1000)} bare script",
                    fmt_x(ratio),
                    f"<= {TARGET_X}x bare",
                    verdict(ratio <= TARGET_X),
                )
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--handlers", default=",".join(BUNDLES))
    args = parser.parse_args()
    handlers = [h.strip() for h in args.handlers.split(",") if h.strip()]
    print(render(run(repeat=args.repeat, handlers=handlers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
