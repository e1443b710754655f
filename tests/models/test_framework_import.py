"""The framework's first import: with the cyclic GC paused, and what it made frozen
out of the collector's view; the GC's own setting is left as it was."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

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


@pytest.fixture(scope="module")
def resolved() -> dict[str, dict[str, object]]:
    """One fresh interpreter per collector setting, run side by side (each imports torch)."""
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", SCRIPT, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode in ("on", "off")
    }
    results: dict[str, dict[str, object]] = {}
    try:
        for mode, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            results[mode] = orjson.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_the_first_import_freezes_the_framework_and_turns_the_collector_back_on(
    resolved: dict[str, dict[str, object]],
) -> None:
    result = resolved["on"]
    assert result["torch"] is True and result["device"] in {"cpu", "cuda"}
    assert result["again"] == "cpu"
    # Not one collection ran during the import (353 did before, and a full one after).
    assert result["collections"] == 0
    assert result["enabled"] is True
    # torch's modules, functions and registrations: some 10^5 objects no collection
    # walks again (a few thousand would mean only the runtime's own were frozen).
    assert isinstance(result["frozen"], int) and result["frozen"] > 50_000


def test_a_collector_the_process_turned_off_stays_off(
    resolved: dict[str, dict[str, object]],
) -> None:
    result = resolved["off"]
    assert result["enabled"] is False
    assert isinstance(result["frozen"], int) and result["frozen"] > 50_000
