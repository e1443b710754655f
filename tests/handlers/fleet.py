"""Eight bundles `fleet0`..`fleet7` whose builders sleep `config["sleep_s"]`, and
handlers of the same names that sleep `event["run_s"]` and append
`event["token"]` to the ledger file named by `config["ledger"]`, so a test can
prove each request ran exactly once.
"""

from __future__ import annotations

import os
import time
from typing import Any

from runtime import Context, bundle, handler

FLEET = 8


class Model:
    def __init__(self, config: dict[str, Any]) -> None:
        self.ledger = str(config["ledger"])


def _make(index: int) -> None:
    name = f"fleet{index}"

    def build(config: dict[str, Any]) -> Model:
        time.sleep(float(config.get("sleep_s", 0.0)))
        return Model(config)

    def run(event: Any, model: Model, ctx: Context) -> dict[str, Any]:
        time.sleep(float(event.get("run_s", 0.0)))
        if not ctx.warmup:
            with open(model.ledger, "a") as handle:
                handle.write(f"{event['token']}\n")
        return {"token": event.get("token"), "pid": os.getpid()}

    build.__name__ = f"build_{name}"
    run.__name__ = name
    globals()[f"build_{name}"] = bundle(name)(build)
    globals()[name] = handler(name, uses=[name])(run)


for _index in range(FLEET):
    _make(_index)
