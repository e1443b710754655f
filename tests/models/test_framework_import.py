"""The framework's first import: with the cyclic GC paused, and what it made frozen
out of the collector's view; the GC's own setting is left as it was."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

pytest.importorskip("torch")

SCRIPT = """
import gc, sys
import orjson
if sys.argv[1] == "off":
    gc.disable()
from runtime.models.weights import resolve_device
assert "torch" not in sys.modules
before = gc.get_freeze_count()
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
device = resolve_device("")
again = resolve_device("cpu")  # the second resolve changes nothing
print(orjson.dumps({
    "device": device, "again": again, "enabled": gc.isenabled(),
    "frozen": gc.get_freeze_count() - before, "torch": "torch" in sys.modules,
    "collections": len(collections),
}).decode())
"""


def _resolve(gc_mode: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, gc_mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = orjson.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_first_import_freezes_the_framework_and_turns_the_collector_back_on() -> None:
    result = _resolve("on")
    assert result["torch"] is True and result["device"] in {"cpu", "cuda"}
    assert result["again"] == "cpu"
    # Not one collection ran during the import (353 did before, and a full one after).
    assert result["collections"] == 0
    assert result["enabled"] is True
    # torch's modules, functions and registrations: some 10^5 objects no collection
    # walks again (a few thousand would mean only the runtime's own were frozen).
    assert isinstance(result["frozen"], int) and result["frozen"] > 50_000


def test_a_collector_the_process_turned_off_stays_off() -> None:
    result = _resolve("off")
    assert result["enabled"] is False
    assert isinstance(result["frozen"], int) and result["frozen"] > 50_000
