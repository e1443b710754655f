"""Process start -> first answer: Thaw against a bare script doing the same work.

    .venv/bin/python bench/firstanswer.py [--repeat 5] [--handlers embed,classify,generate]

For each shipped model handler, in one run, interleaved: a fresh `thaw serve`
process (spawn -> /healthz -> POST /invoke -> the answer), and a fresh bare
script (`python -m runtime.cli.bare`: import torch, read the same safetensors,
build the same model with the handler's own builder, call the handler once;
no server, no verification, no warm-up). Medians of `--repeat` runs each, the
phases of the Thaw run nearest its median, and the ratio (target <= 1.05x,
issue 29). With `--phases`, a second table: the Thaw run's phases beside the
bare script's own split (import, load, build, run) of the bare run nearest
its median, so the difference shows where it goes.

Three kinds of node, each measured: `warm node`, where the node's state
directory survives between processes (as on a server restart: the bundle's
files were verified before and are not hashed again, load estimates exist),
and two fresh nodes, a new state directory per start, where every file is
hashed again: `fresh node, read-only image`, the bundle on a filesystem sealed
read-only (a tmpfs, remounted `ro`), as every Lambda cold start with the
bundle baked into the image (Lambda's image filesystem is read-only, and Thaw
then maps the weights for the build: runtime/models/weights/mapped.py); and
`fresh node, writable`, the bundle in a writable directory (a container whose
image or volume is writable), where Thaw copies every byte. The read-only one
needs the right to mount (root); without it that row says so.

The same requests as the issue: embed two short sentences; classify one small
JPEG; generate "The capital of France is" with max_tokens 8.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Row, fmt_s, fmt_x, median, render, runtime_env, verdict  # noqa: E402
from runtime.cli.coldstart import compile_bytecode, measure, measure_bare  # noqa: E402

# Issue 29: every shipped handler's first answer at the bare script's floor.
TARGET_X = 1.05
BUNDLES = {"embed": "minilm", "classify": "efficientnet", "generate": "smollm2"}
BUNDLES_DIR = ROOT / "bundles"


def event_for(handler: str) -> Any:
    if handler == "embed":
        return {"texts": ["A man is eating food.", "A man is riding a horse."]}
    if handler == "classify":
        from handlers.classify import _SMALL_JPEG

        return {"image": _SMALL_JPEG}
    return {"prompt": "The capital of France is", "max_tokens": 8}


WARM, FRESH_RO, FRESH_RW = "warm node", "fresh node, read-only image", "fresh node, writable"
NODES = (WARM, FRESH_RO, FRESH_RW)


def one_round(handler: str, state: Path, fresh_node: bool) -> tuple[dict[str, Any], float]:
    thaw, bare = one_pair(handler, state, fresh_node)
    return thaw, bare["first_answer_ms"]


def one_pair(
    handler: str, state: Path, fresh_node: bool, source: Path = BUNDLES_DIR
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One Thaw cold start, then one bare script, both reading `source`: both results whole."""
    if fresh_node:
        shutil.rmtree(state, ignore_errors=True)
    env = runtime_env(
        state.parent,
        STATE_DIR=str(state),
        HANDLERS=f"handlers.{handler}",
        BUNDLE_SOURCE=str(source),
    )
    thaw = measure(handler, event_for(handler), 0, env)
    bare = measure_bare(handler, event_for(handler), env)
    return thaw, bare


@contextlib.contextmanager
def read_only_copy(bundle: str, where: Path) -> Iterator[Path | None]:
    """`bundle` copied onto a tmpfs at `where`, sealed read-only; None without the right
    to mount. Unmounted on the way out."""
    where.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(where)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode:
        yield None
        return
    try:
        shutil.copytree(BUNDLES_DIR / bundle, where / bundle)
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


# The bare script's own split, seconds (runtime/cli/bare.py).
BARE_STEPS = ("import_s", "load_s", "build_s", "run_s")


def phase_rows(node: str, handler: str, thaw: dict[str, Any], bare: dict[str, Any]) -> list[Row]:
    """Where the time goes: Thaw's phases (ms) beside the bare script's (ms)."""
    phases = thaw["phases_ms"]
    thaw_split = ", ".join(
        [f"healthz {thaw['process_start_to_healthy_ms']:.0f}"]
        + [f"{p} {phases[p]:.0f}" for p in ("fetch", "load", "init", "warmup", "run")]
    )
    bare_split = ", ".join(f"{s[:-2]} {bare[s] * 1000:.0f}" for s in BARE_STEPS)
    spawn_ms = bare["first_answer_ms"] - bare["in_process_s"] * 1000
    return [
        Row(
            f"{node}: `{handler}` phases, ms (Thaw; bare script)",
            f"{thaw_split}; total {thaw['process_start_to_first_answer_ms']:.0f}",
            f"interpreter start {spawn_ms:.0f}, {bare_split}; total {bare['first_answer_ms']:.0f}",
        )
    ]


def run(
    *,
    quick: bool = False,
    repeat: int = 5,
    handlers: list[str] | None = None,
    nodes: tuple[str, ...] = NODES,
    phase_table: list[Row] | None = None,
) -> list[Row]:
    """`phase_table`: a list to fill with each handler's phase rows (see `phase_rows`)."""
    repeat = 1 if quick else repeat
    compile_bytecode(["handlers"])
    rows: list[Row] = []
    for node in nodes:
        for handler in handlers or list(BUNDLES):
            if not (BUNDLES_DIR / BUNDLES[handler] / "bundle.json").is_file():
                built = "bundle not built (scripts/build_model_bundles.py)"
                rows.append(Row(f"`{handler}`", built, verdict="skipped"))
                continue
            with contextlib.ExitStack() as stack:
                tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="thaw-first-")))
                state = tmp / "state"
                source: Path | None = BUNDLES_DIR
                if node == FRESH_RO:
                    source = stack.enter_context(read_only_copy(BUNDLES[handler], tmp / "ro"))
                if source is None:
                    why = "needs the right to mount a read-only tmpfs (root)"
                    rows.append(Row(f"{node}: `{handler}`", why, verdict="skipped"))
                    continue
                if node == WARM:
                    one_round(handler, state, fresh_node=False)  # the node's first start
                pairs = [
                    one_pair(handler, state, fresh_node=node != WARM, source=source)
                    for _ in range(repeat)
                ]
            results = [(t, b["first_answer_ms"]) for t, b in pairs]
            thaw_ms = median([t["process_start_to_first_answer_ms"] for t, _ in results])
            bare_ms = median([b for _, b in results])
            nearest = min(
                (t for t, _ in results),
                key=lambda t: abs(t["process_start_to_first_answer_ms"] - thaw_ms),
            )
            if phase_table is not None:
                bare_nearest = min(
                    (b for _, b in pairs), key=lambda b: abs(b["first_answer_ms"] - bare_ms)
                )
                phase_table += phase_rows(node, handler, nearest, bare_nearest)
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
    parser.add_argument(
        "--fresh-only", action="store_true", help="only the fresh nodes (issue 29's target)"
    )
    parser.add_argument(
        "--phases", action="store_true", help="also a table of each handler's phases"
    )
    args = parser.parse_args()
    handlers = [h.strip() for h in args.handlers.split(",") if h.strip()]
    nodes = (FRESH_RO, FRESH_RW) if args.fresh_only else NODES
    phases: list[Row] | None = [] if args.phases else None
    print(render(run(repeat=args.repeat, handlers=handlers, nodes=nodes, phase_table=phases)))
    if phases:
        print()
        print(render(phases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
