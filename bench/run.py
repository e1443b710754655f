"""Every benchmark, one markdown table.

    .venv/bin/python bench/run.py [--quick] [--only coldstart,load,...] [--out FILE]

Progress goes to stderr, the table to stdout (and to FILE with --out). Every
server, moto and runtime process a benchmark starts is stopped before it
returns, also on Ctrl-C. Exit status: 0 when every benchmark ran (targets
missed show as FAIL rows), 1 when one crashed (its row says why).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Row, render  # noqa: E402

MODULES = ("coldstart", "load", "overhead", "singleflight", "eviction_sim", "s3fetch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about 2-3 minutes)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {MODULES}")
    parser.add_argument("--out", default="", help="also write the table to this file")
    args = parser.parse_args(argv)
    chosen = [m.strip() for m in args.only.split(",") if m.strip()] or list(MODULES)
    unknown = sorted(set(chosen) - set(MODULES))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {MODULES}")
    rows: list[Row] = []
    crashed = False
    started = time.monotonic()
    for name in chosen:
        began = time.monotonic()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            module = importlib.import_module(f"bench.{name}")
            rows += module.run(quick=args.quick)
        except Exception as exc:
            crashed = True
            traceback.print_exc(file=sys.stderr)
            rows.append(
                Row(f"{name}: crashed", f"{type(exc).__name__}: {exc}"[:200], verdict="FAIL")
            )
        print(
            f"[bench] {name} done in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True
        )
    table = render(rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    print(f"[bench] all done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
