"""A real `thaw serve` under a small file-handle limit: one tenant holding waits
past its share is refused at once, and /healthz and another tenant's calls are
answered beside the held connections (the process is the point: its sockets)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.security.conftest import bearer, clean_env
from tests.support import ServerProcess

pytestmark = [pytest.mark.anyio, pytest.mark.process]
ATTACKER = "attacker-key-3f"
OTHER = "other-key-8c"
NOFILE = 256
PER_KEY = 16


class LimitedServer(ServerProcess):
    """`thaw serve` with at most NOFILE open files, as a small container might have."""

    def start(self, *, wait: bool = True) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        command = [sys.executable, "-m", "runtime.cli.main", "serve", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            ["prlimit", f"--nofile={NOFILE}:{NOFILE}", *command],
            env=self.env,
            stdout=open(self.log_path, "ab"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if wait:
            self.wait_healthy()
        return self


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    (tmp_path / "bundles").mkdir()
    env = {
        **clean_env(tmp_path),
        "THAW_HANDLERS": "handlers.echo,tests.handlers.sleepy",
        "THAW_API_KEYS": f"{ATTACKER},{OTHER}",
        "THAW_MAX_HELD": "64",
        "THAW_MAX_HELD_PER_KEY": str(PER_KEY),
        "THAW_DRAIN_GRACE_S": "0.5",
    }
    with LimitedServer(env) as started:
        yield started


async def test_held_waits_never_starve_healthz_or_another_tenant(server: ServerProcess) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
        job = await client.post("/handlers/sleepy/jobs", json={"s": 60}, headers=bearer(ATTACKER))
        job_id = job.json()["id"]
        # Three times the connections the process could hold if each waited.
        polls = [
            asyncio.create_task(
                client.get(f"/jobs/{job_id}", params={"wait": 30}, headers=bearer(ATTACKER))
            )
            for _ in range(3 * NOFILE // 4)
        ]
        refused = []
        for poll in asyncio.as_completed(polls):
            answer = await poll
            refused.append(answer.status_code)
            if len(refused) == len(polls) - PER_KEY:
                break  # what is left is held
        assert set(refused) == {429}, refused
        # Beside the attacker's held waits, at the attacker's bound:
        for _ in range(20):
            assert (await client.get("/healthz")).status_code == 200
            served = await client.post("/invoke/echo", json={"n": 1}, headers=bearer(OTHER))
            assert served.status_code == 200 and served.json() == {"n": 1}
        still_held = [p for p in polls if not p.done()]
        assert len(still_held) == PER_KEY
        for poll in still_held:
            poll.cancel()
        await asyncio.gather(*still_held, return_exceptions=True)
    assert "Too many open files" not in server.log_path.read_text(errors="replace")
