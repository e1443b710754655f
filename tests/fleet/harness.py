"""A fleet for tests: N real `thaw serve` processes on one PostgreSQL database,
behind a real nginx that round-robins over them, all on 127.0.0.1.

Each instance has its own state and cache directories, as instances on other
machines would: what they share is the database alone. An instance killed is
restarted on its own port, so nginx's upstream list never changes. nginx is
Debian's package (`.ci/run` installs it when missing); without it the
fixtures skip with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from tests.jobs.postgres_fixtures import free_port
from tests.support import ServerProcess

_START_TIMEOUT_S = 30.0


def nginx_binary() -> str | None:
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")


class Nginx:
    """nginx in the foreground, round-robin over `upstreams` (ports on 127.0.0.1)."""

    def __init__(self, binary: str, upstreams: list[int]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = Path(tempfile.mkdtemp(prefix="thaw-nginx-"))
        self.error_log = self.root / "error.log"
        servers = "".join(
            # A refused connection marks the instance down for a second, and the
            # request goes to the next one (only for requests nginx may repeat:
            # not a POST, since 1.9.13).
            f"        server 127.0.0.1:{port} max_fails=1 fail_timeout=1s;\n"
            for port in upstreams
        )
        temp = "".join(
            f"    {kind}_temp_path {self.root / kind};\n"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        self.config = self.root / "nginx.conf"
        self.config.write_text(
            ("user root;\n" if os.geteuid() == 0 else "") + "worker_processes 1;\n"
            "daemon off;\n"
            f"pid {self.root / 'nginx.pid'};\n"
            f"error_log {self.error_log} warn;\n"
            "events { worker_connections 4096; }\n"
            "http {\n"
            "    access_log off;\n"
            f"{temp}"
            "    upstream thaw {\n"
            f"{servers}"
            "        keepalive 32;\n"
            "    }\n"
            "    server {\n"
            f"        listen 127.0.0.1:{self.port};\n"
            "        client_max_body_size 8m;\n"
            "        location / {\n"
            "            proxy_pass http://thaw;\n"
            "            proxy_http_version 1.1;\n"
            '            proxy_set_header Connection "";\n'
            "            proxy_set_header Host $host;\n"
            # Server-sent events and long polls pass through as they come.
            "            proxy_buffering off;\n"
            "            proxy_read_timeout 600s;\n"
            "            proxy_connect_timeout 2s;\n"
            "        }\n"
            "    }\n"
            "}\n"
        )
        self.proc = subprocess.Popen(
            [binary, "-p", str(self.root), "-e", str(self.error_log), "-c", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_until_up()

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.error_log.read_text() if self.error_log.exists() else ""
                raise RuntimeError(f"nginx exited with {self.proc.returncode}: {log}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return
            time.sleep(0.02)
        raise RuntimeError(f"nginx did not listen within {_START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM is nginx's fast shutdown (SIGQUIT would wait for open streams).
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


class Fleet:
    """`count` instances of `env` on the job store `dsn`, and nginx before them."""

    def __init__(
        self, nginx: str, env: Mapping[str, str], dsn: str, root: Path, count: int = 3
    ) -> None:
        self.instances: list[ServerProcess] = []
        self.nginx: Nginx | None = None
        self._generation = 0
        try:
            for index in range(count):
                state = root / f"instance-{index}"
                server = ServerProcess(
                    {
                        **env,
                        "THAW_JOB_STORE": dsn,
                        "THAW_STATE_DIR": str(state / "state"),
                        "THAW_CACHE_DIR": str(state / "cache"),
                    }
                )
                self.instances.append(server)
                server.start(wait=False)
            for server in self.instances:
                server.wait_healthy()
            self.nginx = Nginx(nginx, [server.port for server in self.instances])
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        assert self.nginx is not None
        return self.nginx.url

    def client(self, **kwargs: object) -> httpx.Client:
        timeout = kwargs.pop("timeout", 30.0)
        return httpx.Client(base_url=self.url, timeout=timeout, **kwargs)  # type: ignore[arg-type]

    def kill(self, index: int) -> None:
        """SIGKILL instance `index` (and its process group): no drain, no goodbye."""
        self.instances[index].kill()

    def restart(self, index: int, *, wait: bool = True, fresh: bool = False) -> ServerProcess:
        """Start instance `index` again on its port: with its state directory, as a
        process restarted on its machine, or (`fresh`) a new one, as a replacement
        on another machine (which finds no lock file of the dead owner's)."""
        server = self.instances[index]
        server.kill()
        if fresh:
            self._generation += 1
            state = Path(server.env["THAW_STATE_DIR"]).parent.parent
            server.env["THAW_STATE_DIR"] = str(state / f"restart-{self._generation}" / "state")
        return server.start(wait=wait)

    def stop(self) -> None:
        if self.nginx is not None:
            self.nginx.stop()
        for server in self.instances:
            server.kill()

    def logs(self) -> str:
        return "\n".join(f"--- instance {i}\n{s.log()}" for i, s in enumerate(self.instances))
