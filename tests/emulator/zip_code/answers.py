"""A plain Lambda handler: answers with its event and what Lambda told it (context, env).

Imported from its CodeUri by awslambdaric (`Handler: answers.handler`); it prints
a line per event, for the tail log.
"""

from __future__ import annotations

import os
from typing import Any

IMPORTED_IN = os.getcwd()


def handler(event: Any, context: Any) -> dict[str, Any]:
    print(f"answering {event!r}", flush=True)
    return {
        "event": event,
        "pid": os.getpid(),
        "cwd": IMPORTED_IN,
        "request_id": context.aws_request_id,
        "function_name": context.function_name,
        "function_version": context.function_version,
        "memory_limit_in_mb": context.memory_limit_in_mb,
        "remaining_ms": context.get_remaining_time_in_millis(),
        "env": {
            name: os.environ.get(name)
            for name in (
                "LAMBDA_TASK_ROOT",
                "_HANDLER",
                "AWS_EXECUTION_ENV",
                "AWS_LAMBDA_FUNCTION_NAME",
                "AWS_LAMBDA_FUNCTION_TIMEOUT",
                "FROM_TEMPLATE",
            )
        },
    }
