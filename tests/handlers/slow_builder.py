"""Bundle `tiny` whose builder sleeps `config["sleep_s"]` and appends one line per
load to the file named by `config["load_log"]`; handler `predict` multiplies its
input by the weights' sum, with a warm-up example, so every load phase takes time.
"""

from __future__ import annotations

import os
import time
from typing import Any

from runtime import Context, bundle, handler


class Tiny:
    def __init__(self, scale: float, warmup_sleep_s: float) -> None:
        self.scale = scale
        self.warmup_sleep_s = warmup_sleep_s


@bundle("tiny")
def build_tiny(weights: dict[str, Any], config: dict[str, Any]) -> Tiny:
    time.sleep(float(config.get("sleep_s", 0.0)))
    log = config.get("load_log")
    if log:
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()} {time.time()}\n")
    scale = float(sum(float(t.sum()) for t in weights.values()))
    return Tiny(scale, float(config.get("warmup_sleep_s", 0.0)))


@handler("predict", uses=["tiny"], warmup=[{"x": 1.0, "warmup": True}])
def predict(event: Any, tiny: Tiny, ctx: Context) -> dict[str, Any]:
    if event.get("warmup"):
        time.sleep(tiny.warmup_sleep_s)
    time.sleep(float(event.get("run_s", 0.0)))
    return {"y": float(event.get("x", 0.0)) * tiny.scale, "pid": os.getpid()}
