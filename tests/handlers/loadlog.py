"""Builders that record each load (start and end times, one line per load) and
sleep `config["sleep_s"]`; a builder fails while `config["fault_file"]` exists.
A handler call whose event holds `"hold": true`, and a builder whose config
does, wait in their thread until the test sets `HOLD`; across processes, a
call whose event names `"hold_file"` waits while that file exists (no test
has to guess how long a sleep outlasts its work). Two builders whose config
says `"meet": true` wait for each other at `MEET`: both return only if their
loads ran at the same time.

Bundles: `alpha`, `beta`, `gamma`, `huge` (same builder); handlers of the same
names return the model object's identity and the load record.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from runtime import Context, bundle, handler

HOLD = threading.Event()
MEET = threading.Barrier(2)


class Model:
    def __init__(self, name: str, started: float, ended: float, tensors: int) -> None:
        self.name = name
        self.started = started
        self.ended = ended
        self.tensors = tensors


def _build(name: str, weights: dict[str, Any], config: dict[str, Any]) -> Model:
    started = time.time()
    fault = config.get("fault_file")
    if fault and Path(fault).exists():
        raise RuntimeError(f"injected builder fault for {name}")
    time.sleep(float(config.get("sleep_s", 0.0)))
    if config.get("hold") and not HOLD.wait(timeout=60):
        raise TimeoutError("the test never set HOLD")
    if config.get("meet"):
        MEET.wait(timeout=60)  # BrokenBarrierError: the other load never ran alongside
    log = config.get("log_file") or os.environ.get("THAW_TEST_LOAD_LOG")
    ended = time.time()
    if log:
        with open(log, "a") as handle:
            handle.write(f"{name} {started} {ended}\n")
    return Model(name, started, ended, len(weights))


def _view(model: Model, event: Any, ctx: Context) -> dict[str, Any]:
    if isinstance(event, dict) and event.get("sleep_s"):
        time.sleep(float(event["sleep_s"]))
    if isinstance(event, dict) and event.get("hold") and not HOLD.wait(timeout=60):
        raise TimeoutError("the test never set HOLD")
    while isinstance(event, dict) and event.get("hold_file") and Path(event["hold_file"]).exists():
        time.sleep(0.01)
    return {
        "bundle": model.name,
        "model_id": id(model),
        "pid": os.getpid(),
        "load": [model.started, model.ended],
        "tensors": model.tensors,
    }


@bundle("alpha")
def build_alpha(weights: dict[str, Any], config: dict[str, Any]) -> Model:
    return _build("alpha", weights, config)


@bundle("beta")
def build_beta(weights: dict[str, Any], config: dict[str, Any]) -> Model:
    return _build("beta", weights, config)


@bundle("gamma")
def build_gamma(weights: dict[str, Any], config: dict[str, Any]) -> Model:
    return _build("gamma", weights, config)


@bundle("huge")
def build_huge(weights: dict[str, Any], config: dict[str, Any]) -> Model:
    return _build("huge", weights, config)


@handler("alpha", uses=["alpha"])
def alpha(event: Any, model: Model, ctx: Context) -> dict[str, Any]:
    return _view(model, event, ctx)


@handler("beta", uses=["beta"])
def beta(event: Any, model: Model, ctx: Context) -> dict[str, Any]:
    return _view(model, event, ctx)


@handler("gamma", uses=["gamma"])
def gamma(event: Any, model: Model, ctx: Context) -> dict[str, Any]:
    return _view(model, event, ctx)


@handler("huge", uses=["huge"])
def huge(event: Any, model: Model, ctx: Context) -> dict[str, Any]:
    return _view(model, event, ctx)
