"""Why `Llama` stores its weights as it does: a decode step's GEMMs in each layout.

    .venv/bin/python bench/experiments/gemm_layout.py [--threads 1] [--rows 1,8,16]

SmolLM2-135M's matrices (hidden 576, intermediate 1536, vocab 49,152; 30 layers),
random float32 values (the kernels' times do not depend on them): for M rows (a
decode step of M sequences), `F.linear(x, w)` with Hugging Face's (out, in) `w`
against `x @ w` with `w` stored transposed, (in, out), as `Llama` applies it.
Where the CPU has AMX (`handlers.models.llama.packed_bf16`), a third column:
bfloat16 weights reordered once by oneDNN (`_reorder_linear_weight`) and applied
by `_linear_pointwise`, as `Llama` does by default there; its time includes the
casts of `x` to bfloat16 and of the result back to float32.
The layouts alternate call by call (the same machine for all); medians of each.
A step's GEMMs are 30 layers of qkv, o, gate_up and down, plus the LM head.
Prints one markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from handlers.models.llama import packed_bf16

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


def packed_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        x.to(torch.bfloat16), w, None, "none", [], ""
    )
    return y.float()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--rows", default="1,2,8,16", help="rows (sequences per step)")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    packed = packed_bf16("cpu")
    head = "| rows | F.linear (out, in), ms per step | x @ w (in, out), ms per step | ratio |"
    rule = "|---|---|---|---|"
    if packed:
        head += " packed bfloat16, ms per step | ratio to x @ w |"
        rule += "---|---|"
    print(head)
    print(rule)
    for rows in (int(r) for r in args.rows.split(",")):
        linear_s = matmul_s = packed_s = 0.0
        for name, (out, inn) in SHAPES.items():
            w = torch.randn(out, inn)
            wt = w.t().contiguous()
            wp = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16)) if packed else None
            x = torch.randn(rows, inn)
            reps = args.reps if name != "lm_head" else max(3, args.reps // 3)
            a: list[float] = []
            b: list[float] = []
            c: list[float] = []
            for i in range(reps + 3):  # the first three warm the kernels
                ta, tb = timed(F.linear, x, w), timed(torch.matmul, x, wt)
                tc = timed(packed_mm, x, wp) if wp is not None else 0.0
                if i >= 3:
                    a.append(ta)
                    b.append(tb)
                    c.append(tc)
            times = 1 if name == "lm_head" else LAYERS
            linear_s += statistics.median(a) * times
            matmul_s += statistics.median(b) * times
            packed_s += statistics.median(c) * times
        row = (
            f"| {rows} | {linear_s * 1e3:.1f} | {matmul_s * 1e3:.1f} | {matmul_s / linear_s:.2f}x |"
        )
        if packed:
            row += f" {packed_s * 1e3:.1f} | {packed_s / matmul_s:.2f}x |"
        print(row)
    print(f"\nintra-op threads {args.threads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
