"""Why a decode step waits for a prompt in flight: a prefill beside the steps.

    .venv/bin/python bench/experiments/prefill_contention.py [--sequences 7] [--reps 5]
                                                             [--bundles DIR]

SmolLM2's shipped weights, one intra-op thread per computing thread (as
`bench/generation.py --threads 1` serves). Prompts of 8 to 330 tokens are
prefilled (`Llama.prefill`) alone, then beside a thread of the same process that
runs decode steps of `--sequences` sequences back to back (what the decode
scheduler does while a new caller's prompt runs on another handler thread),
then beside a separate process doing the same steps (its own interpreter, its
own copy of the weights). Two threads share one GIL, which every tensor
operation called from Python takes and gives back; two processes share only the
machine. Also the decode step's own time, alone and beside the prefills.
Medians of `--reps`. Prints one markdown table; needs two cores to mean anything.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import ROOT

PROMPTS = (8, 20, 40, 80, 150, 330)


def _model(bundles: str) -> Any:
    import torch
    from safetensors.torch import load_file

    from handlers.models.llama import Llama, LlamaConfig

    torch.set_num_threads(1)
    bundle = Path(bundles) / "smollm2"
    config = json.loads((bundle / "bundle.json").read_text())["config"]
    return Llama(LlamaConfig.from_config(config), load_file(bundle / "model.safetensors"), "cpu")


class Decoding:
    """Decode steps of `sequences` sequences, at the same positions every time."""

    def __init__(self, model: Any, sequences: int) -> None:
        import torch

        self.model = model
        self.caches = [model.new_cache(900) for _ in range(sequences)]
        for j, cache in enumerate(self.caches):
            model.prefill(torch.arange(1, 65 + 30 * j), cache)
        self.lengths = [cache.length for cache in self.caches]

    def step(self) -> None:
        for cache, length in zip(self.caches, self.lengths, strict=True):
            cache.length = length
        self.model.decode([5] * len(self.caches), self.caches)


def _decode_forever(bundles: str, sequences: int, ready: Any) -> None:
    import torch

    with torch.inference_mode():
        decoding = Decoding(_model(bundles), sequences)
        ready.set()
        while True:
            decoding.step()


def _prefills(model: Any, reps: int) -> dict[int, float]:
    import torch

    out: dict[int, float] = {}
    for tokens in PROMPTS:
        cache = model.new_cache(tokens + 4)
        times = []
        for _ in range(reps):
            cache.length = 0
            started = time.perf_counter()
            model.prefill(torch.arange(1, tokens + 1), cache)
            times.append(time.perf_counter() - started)
        out[tokens] = statistics.median(times) * 1e3
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=7, help="sequences per decode step")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bundles", default=str(ROOT / "bundles"))
    args = parser.parse_args()
    import torch

    model = _model(args.bundles)
    with torch.inference_mode():
        _prefills(model, 1)  # warm the kernels
        alone = _prefills(model, args.reps)
        decoding = Decoding(model, args.sequences)
        started = time.perf_counter()
        for _ in range(10):
            decoding.step()
        step_alone = (time.perf_counter() - started) / 10 * 1e3
        stop = threading.Event()
        steps = 0

        def decode() -> None:
            nonlocal steps
            with torch.inference_mode():
                while not stop.is_set():
                    decoding.step()
                    steps += 1

        thread = threading.Thread(target=decode)
        thread.start()
        time.sleep(0.5)
        started, before = time.perf_counter(), steps
        beside_thread = _prefills(model, args.reps)
        step_beside = (time.perf_counter() - started) / max(1, steps - before) * 1e3
        stop.set()
        thread.join()
        ready = multiprocessing.get_context("spawn").Event()
        process = multiprocessing.get_context("spawn").Process(
            target=_decode_forever, args=(args.bundles, args.sequences, ready), daemon=True
        )
        process.start()
        try:
            if not ready.wait(300):
                raise RuntimeError("the decoding process never became ready")
            time.sleep(0.5)
            beside_process = _prefills(model, args.reps)
        finally:
            process.terminate()
            process.join()
    print("| prompt, tokens | alone, ms | beside a decode thread | beside a decode process |")
    print("|---|---|---|---|")
    for tokens in PROMPTS:
        a, t, p = alone[tokens], beside_thread[tokens], beside_process[tokens]
        print(f"| {tokens} | {a:.1f} | {t:.1f} ms ({t / a:.2f}x) | {p:.1f} ms ({p / a:.2f}x) |")
    print(
        f"\ndecode step of {args.sequences} sequences: {step_alone:.1f} ms alone, "
        f"{step_beside:.1f} ms beside the prefills ({step_beside / step_alone:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
