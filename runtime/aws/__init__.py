"""Lambda mode: the Runtime API client (lambda_api.py), the loop that serves it
(lambda_loop.py) and Function URL / API Gateway v2 events (events.py).

May import runtime.http (the loop routes events through the HTTP app) and below.
"""

import sys

# httpx's package imports its command-line client when click, rich and pygments
# are installed (thaw-runtime[cli] brings rich): 30 ms of a Lambda init here, for a client
# this process never runs. None in sys.modules makes that import fail as it does
# where they are absent, which httpx expects (its `main` then says what to install).
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]  # None blocks an import
