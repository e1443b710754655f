"""The bare script of runtime/cli/bare.py as a Lambda function, in Lambda's usual style.

    Handler: bench.bare_lambda.handler     (a Zip python3.X function, CodeUri: the repository)
    BARE_HANDLER=embed                     the shipped handler it serves
    THAW_BUNDLE_SOURCE, THAW_HANDLERS      where the bundles are, which handler modules to import

At import, which is Lambda's init phase, it does what the bare script does
before its call: import torch, read the bundle's safetensors and build the
model with the handler's own builder (`runtime.cli.bare.prepare`, the same
code). Each invocation runs the shipped handler once on the event
(`runtime.cli.bare.call`) and returns `{"output": ...}`. No server, no
verification, no warm-up, no jobs: the floor that `thaw emulate`'s cold REPORT
for Thaw is held against (bench/emulated.py).
"""

from __future__ import annotations

import os
from typing import Any

from runtime.cli.bare import call, prepare

PREPARED = prepare(os.environ["BARE_HANDLER"])


def handler(event: Any, context: Any) -> dict[str, Any]:
    return {"output": call(PREPARED, event, context.aws_request_id)}
