"""The version: its one source, read by pyproject.toml (statically, at build time), the
CLI, the server's banner and /openapi.json, so a start never needs importlib.metadata."""

__version__ = "0.1.0"
