"""Thaw: a serverless function runtime for GPU inference.

The public handler API is re-exported here; everything else is imported from
its own module. Importing this package must stay cheap (no torch).
"""

from runtime.context import Context
from runtime.errors import InvalidInput
from runtime.registry import Batch, Decode, bundle, handler
from runtime.version import __version__
from runtime.wire.openai_spec import OpenAI

__all__ = [
    "Batch",
    "Context",
    "Decode",
    "InvalidInput",
    "OpenAI",
    "__version__",
    "bundle",
    "handler",
]
