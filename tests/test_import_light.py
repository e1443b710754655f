"""Starting the control interface must not import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

SCRIPT = """
import sys
import runtime
from runtime.http.app import create_app
from runtime.registry import discover
from runtime.settings import Settings
registry = discover(())          # every shipped handler module
app = create_app(Settings())
# The home of torch and safetensors imports them only when first used.
import runtime.models.weights.cpu
import runtime.models.weights.device
import runtime.models.weights.format
import runtime.models.weights.framework
print(sorted(registry.handlers))
heavy = [m for m in ("torch", "safetensors", "numpy", "boto3", "tokenizers") if m in sys.modules]
print("HEAVY", heavy)
"""


def test_runtime_app_and_registry_do_not_import_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    assert "'echo'" in result.stdout and "'fahrenheit'" in result.stdout
    assert "HEAVY []" in result.stdout, result.stdout
