"""The HTTP contract: the Starlette app (app.py), `thaw serve` on uvicorn
(server.py), its OpenAPI description, `Prefer` parsing and API keys.

May import runtime.instance (the composition root) and below; never runtime.aws.
"""
