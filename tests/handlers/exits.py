"""Handlers that call sys.exit(3), as code built on argparse or click does on
bad input: `exits` (a plain def), `exits_async` (async def) and `exits_alpha`
(a plain def using bundle `alpha` of tests.handlers.loadlog).
"""

from __future__ import annotations

import sys
from typing import Any

from runtime import Context, handler


@handler("exits")
def exits(event: Any, ctx: Context) -> Any:
    sys.exit(3)


@handler("exits_async")
async def exits_async(event: Any, ctx: Context) -> Any:
    sys.exit(3)


@handler("exits_alpha", uses=["alpha"])
def exits_alpha(event: Any, alpha: Any, ctx: Context) -> Any:
    sys.exit(3)
