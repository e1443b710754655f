"""`thaw keys new` prints a fresh random key; `thaw keys hash` turns it into the line
either key file (tenant or operator) holds, and the ring built from that file
knows the key in the role of the file it is in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.http.auth import KeyRing
from tests.security.inprocess import settings_under

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def thaw(*args: str, stdin: str = "") -> str:
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def test_new_keys_are_random_and_hash_into_an_operator_file(tmp_path: Path) -> None:
    first, second = thaw("keys", "new"), thaw("keys", "new")
    assert first != second and len(first) >= 43  # 32 bytes, URL-safe base64
    line = thaw("keys", "hash", stdin=first + "\n")
    assert line.startswith("sha256:") and first not in line
    operators = tmp_path / "operators"
    operators.write_text(line + " on-call\n")
    ring = KeyRing.from_settings(
        settings_under(tmp_path, api_keys=(), operator_keys=(), operator_keys_file=str(operators))
    )
    assert ring is not None
    found = ring.caller(first.encode())
    assert found is not None and found[1] is True
    assert ring.caller(second.encode()) is None
