"""`python -m runtime`: the container entrypoint.

With AWS_LAMBDA_RUNTIME_API set (on Lambda, or under `thaw emulate`) it runs
the Runtime API loop; otherwise it serves the HTTP contract on 0.0.0.0:$PORT
(default 8080), as container platforms expect. `--insecure` is passed through
to the server, whose security rules decide what a non-loopback bind needs.
"""

from __future__ import annotations

import os
import sys

from runtime.errors import ThawError
from runtime.wire.render import cli_exit_code, cli_line


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    from runtime import preload

    preload.start()  # before the server's (or the loop's) imports, beside which it runs
    if os.environ.get("AWS_LAMBDA_RUNTIME_API"):
        from runtime.aws.lambda_loop import main as lambda_main

        return lambda_main()
    from runtime.http.server import serve

    try:
        return serve(
            host="0.0.0.0", port=int(os.environ.get("PORT") or 8080), insecure="--insecure" in args
        )
    except ThawError as exc:
        print(cli_line(exc), file=sys.stderr)
        return cli_exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
