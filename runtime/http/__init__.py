"""The HTTP contract: the route table and app factory (app.py), the edge every
request passes (edge.py), body intake (intake.py), problem+json errors
(problems.py), the endpoints by resource (routes/), `thaw serve` on uvicorn
(server.py), its OpenAPI description (openapi.py, schemas.py), `Prefer`
parsing, API keys and their roles (auth.py), held connections (holds.py) and
server-sent events.

May import runtime.instance (the composition root) and below; never runtime.aws.
"""
