"""The endpoints, by resource: invocations (invoke.py), jobs (jobs.py), model
bundles (models.py), and the instance itself: probes, drain, metrics and the
OpenAPI document (health.py). Each is a module-level function that asks the
`Instance` (app.state.instance) and renders its answer; errors are raised
and rendered in one place (runtime/http/problems.py).
"""

from __future__ import annotations

from starlette.requests import Request

from runtime.instance import Instance


def instance_of(request: Request) -> Instance:
    """The instance the app serves (set by its lifespan)."""
    instance: Instance = request.app.state.instance
    return instance
