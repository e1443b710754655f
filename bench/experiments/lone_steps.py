"""A lone `generate` call's handler side: its decode steps against the per-request loop.

    .venv/bin/python bench/experiments/lone_steps.py [--pairs 6] [--threads 1] [--bundles DIR]

In one process, no server: `runtime.registry.alone(GenerateSteps)` (what the
decode scheduler runs for a lone sequence: `prefill`, then `step` after `step`)
against `ChatLM.stream` (the per-request loop `bench/generation.py` serves as `generate_private`),
the same 64-token greedy counting request (it never stops early), alternating
who goes first, pair by pair. Prints each pair's times and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import ROOT
from bench.generation import build_bundle

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"
TOKENS = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--bundles", default=str(ROOT / "bundles"))
    args = parser.parse_args()
    import torch
    from safetensors.torch import load_file

    from handlers.generate import GenerateSteps
    from handlers.models.chat import ChatLM
    from handlers.models.llama import Sampling
    from runtime.registry import alone

    torch.set_num_threads(args.threads)
    bundle = build_bundle(Path(args.bundles))
    config = json.loads((bundle / "bundle.json").read_text())["config"]
    lm = ChatLM(
        config, load_file(str(bundle / "model.safetensors")), bundle / "tokenizer.json", "cpu"
    )
    stepped = alone(GenerateSteps)
    ids = lm.encode_prompt(PROMPT)

    def steps() -> int:
        return sum(1 for _ in stepped({"prompt": PROMPT, "max_tokens": TOKENS}, lm, None))

    def private() -> int:
        return sum(1 for _ in lm.stream(ids, TOKENS, Sampling(), []))

    ratios: list[float] = []
    with torch.inference_mode():
        steps(), private()  # warm both
        for i in range(args.pairs):
            took: dict[str, float] = {}
            order = [("steps", steps), ("private", private)]
            for name, fn in order if i % 2 == 0 else order[::-1]:
                started = time.perf_counter()
                if fn() < TOKENS:
                    raise RuntimeError(f"{name}: the request stopped early")
                took[name] = time.perf_counter() - started
            ratios.append(took["steps"] / took["private"])
            print(
                f"pair {i}: steps {took['steps'] * 1e3:.0f} ms, per-request "
                f"{took['private'] * 1e3:.0f} ms, ratio {ratios[-1]:.3f}"
            )
    print(
        f"median time ratio (steps / per-request) {statistics.median(ratios):.3f}, "
        f"pairs {min(ratios):.2f}-{max(ratios):.2f}; intra-op threads {args.threads}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
