"""Why `Llama` stores its weights (in, out): a decode step's GEMMs in both layouts.

    .venv/bin/python bench/gemm_layout.py [--threads 1] [--rows 1,8,16]

SmolLM2-135M's matrices (hidden 576, intermediate 1536, vocab 49,152; 30 layers),
random float32 values (the kernels' times do not depend on them): for M rows (a
decode step of M sequences), `F.linear(x, w)` with Hugging Face's (out, in) `w`
against `x @ w` with `w` stored transposed, (in, out), as `Llama` applies it.
The two alternate call by call (the same machine for both); medians of each.
A step's GEMMs are 30 layers of qkv, o, gate_up and down, plus the LM head.
Prints one markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

LAYERS = 30
SHAPES = {  # (out, in)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def timed(fn: object, x: torch.Tensor, w: torch.Tensor) -> float:
    started = time.perf_counter()
    fn(x, w)  # type: ignore[operator]
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--rows", default="1,2,8,16", help="rows (sequences per step)")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| rows | F.linear (out, in), ms per step | x @ w (in, out), ms per step | ratio |")
    print("|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        linear_s = matmul_s = 0.0
        for name, (out, inn) in SHAPES.items():
            w = torch.randn(out, inn)
            wt = w.t().contiguous()
            x = torch.randn(rows, inn)
            reps = args.reps if name != "lm_head" else max(3, args.reps // 3)
            a: list[float] = []
            b: list[float] = []
            for i in range(reps + 3):  # the first three warm the kernels
                ta, tb = timed(F.linear, x, w), timed(torch.matmul, x, wt)
                if i >= 3:
                    a.append(ta)
                    b.append(tb)
            times = 1 if name == "lm_head" else LAYERS
            linear_s += statistics.median(a) * times
            matmul_s += statistics.median(b) * times
        print(
            f"| {rows} | {linear_s * 1e3:.1f} | {matmul_s * 1e3:.1f} | {matmul_s / linear_s:.2f}x |"
        )
    print(f"\nintra-op threads {args.threads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
