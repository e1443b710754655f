"""SmolLM2's decode steps and prefills with each matmul setting, in one process.

    .venv/bin/python bench/experiments/model_steps.py [--threads 1] [--reps 8] [--bundles DIR]

The shipped bundle's weights, built twice: `matmul: auto` (bfloat16 matrices
prepacked for AMX where the CPU has it, `handlers.models.llama.packed_bf16`)
and `matmul: plain` (float32 everywhere). For each, a decode step of 1, 2, 4,
8 and 16 sequences (contexts of 64 to 514 tokens) and a prefill of 32, 128 and
256 tokens; the two models alternate rep by rep, medians of each. This is the
model alone, no runtime: `bench/generation.py` measures what callers see.
Prints one markdown table; without AMX both columns are the same kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import ROOT

STEP_SEQUENCES = (1, 2, 4, 8, 16)
PREFILL_TOKENS = (32, 128, 256)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--bundles", default=str(ROOT / "bundles"))
    args = parser.parse_args()
    import torch
    from safetensors.torch import load_file

    from handlers.models.llama import Llama, LlamaConfig

    torch.set_num_threads(args.threads)
    bundle = Path(args.bundles) / "smollm2"
    config = json.loads((bundle / "bundle.json").read_text())["config"]
    models = {
        matmul: Llama(
            LlamaConfig.from_config({**config, "matmul": matmul}),
            load_file(bundle / "model.safetensors"),
            "cpu",
        )
        for matmul in ("auto", "plain")
    }

    def timed(fn: Callable[[], object]) -> float:
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3

    def compare(make: Callable[[Llama], Callable[[], object]]) -> tuple[float, float]:
        runs = {name: make(model) for name, model in models.items()}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(args.reps + 1):  # the first warms the kernels
            order = list(runs) if rep % 2 else list(reversed(runs))
            for name in order:
                took = timed(runs[name])
                if rep:
                    times[name].append(took)
        return statistics.median(times["auto"]), statistics.median(times["plain"])

    def decode_step(size: int) -> Callable[[Llama], Callable[[], object]]:
        def make(model: Llama) -> Callable[[], object]:
            caches = [model.new_cache(800) for _ in range(size)]
            for j, cache in enumerate(caches):
                model.prefill(torch.arange(1, 65 + 30 * j), cache)
            lengths = [cache.length for cache in caches]

            def step() -> object:
                for cache, length in zip(caches, lengths, strict=True):
                    cache.length = length  # every rep decodes at the same positions
                return model.decode([5] * size, caches)

            return step

        return make

    def prefill(tokens: int) -> Callable[[Llama], Callable[[], object]]:
        def make(model: Llama) -> Callable[[], object]:
            cache = model.new_cache(tokens + 8)

            def run() -> object:
                cache.length = 0
                return model.prefill(torch.arange(1, tokens + 1), cache)

            return run

        return make

    auto = models["auto"]
    print(f"matmul auto: {auto.matmul_dtype} (packed for AMX: {auto.packed}); plain: float32")
    print()
    print("| work | auto, ms | plain, ms | auto / plain |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for size in STEP_SEQUENCES:
            a, p = compare(decode_step(size))
            print(f"| decode step, {size} sequences | {a:.1f} | {p:.1f} | {a / p:.2f}x |")
        for tokens in PREFILL_TOKENS:
            a, p = compare(prefill(tokens))
            print(f"| prefill, {tokens} tokens | {a:.1f} | {p:.1f} | {a / p:.2f}x |")
    print(f"\nintra-op threads {args.threads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
