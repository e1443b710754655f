"""`thaw emulate` authenticates nobody (it checks no AWS_IAM signature), so it
refuses a non-loopback address unless `--insecure` says so, before it binds."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import free_port

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def emulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "emulate", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def a_non_loopback_address() -> str:
    """This machine's address on its way out (no packet is sent: UDP connect)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed, never reached
        except OSError:
            pytest.skip("no route off loopback here")
        address: str = probe.getsockname()[0]
    return address


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_bind_is_refused_without_insecure(host: str) -> None:
    port = free_port()
    done = emulate("--host", host, "--port", str(port))
    assert done.returncode != 0
    assert f"refusing to listen on {host}" in done.stderr
    assert "AWS_IAM" in done.stderr and "--insecure" in done.stderr
    # Refused before binding: the port is still free.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_an_interface_address_is_refused_too() -> None:
    host = a_non_loopback_address()
    done = emulate("--host", host, "--port", str(free_port()))
    assert done.returncode != 0 and "refusing to listen" in done.stderr


def test_insecure_lets_the_bind_through_to_the_template() -> None:
    # Past the refusal, the next check (the template) answers: the flag was heard.
    done = emulate("--host", "0.0.0.0", "--insecure", "--template", "/nonexistent.yaml")
    assert done.returncode != 0
    assert "refusing to listen" not in done.stderr
    assert "nonexistent.yaml" in done.stderr
