"""The model handlers are discovered without importing any heavy library."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

SCRIPT = """
import json, sys
from runtime.registry import discover
registry = discover(["handlers.embed", "handlers.generate", "handlers.classify"])
heavy = ("torch", "numpy", "PIL", "tokenizers", "safetensors", "gguf")
print(json.dumps({
    "handlers": {h.name: list(h.uses) for h in registry.handlers.values()},
    "builders": sorted(registry.builders),
    "warmups": {h.name: len(h.warmup_for("cpu")) for h in registry.handlers.values()},
    "accelerated": {h.name: len(h.warmup_for("cuda")) for h in registry.handlers.values()},
    "heavy": sorted(m for m in heavy if m in sys.modules),
}))
"""


def test_model_handlers_discover_light() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    found = json.loads(result.stdout)
    assert found["heavy"] == []
    assert found["handlers"] == {
        "embed": ["minilm"],
        "generate": ["smollm2"],
        "classify": ["efficientnet"],
    }
    assert found["builders"] == ["efficientnet", "minilm", "smollm2"]
    # Warm-up lists are built on first use or are small: discovery stays light.
    # generate warms nothing on a CPU (no first-call cost there: handlers/generate.py).
    assert found["warmups"] == {"embed": 1, "classify": 1, "generate": 0}
    assert all(found["accelerated"][h] > found["warmups"][h] for h in found["warmups"])
