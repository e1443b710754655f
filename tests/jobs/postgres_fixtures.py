"""PostgreSQL for tests: a throwaway cluster, and a PgBouncer in transaction mode before it.

A cluster is Debian's `postgresql` server binaries run on a free 127.0.0.1 port,
its data in a fresh temporary directory (initdb), stopped and removed when the
session ends. Its only role is `thaw`, a superuser with trust auth on loopback.
As root (CI, this machine) the server runs as the `postgres` user, as initdb
and postgres refuse root. `fsync=off`: the tests restart and kill servers, but
never the machine, so a commit that reached the kernel survives either way.

PgBouncer runs in the foreground as a child process (as `postgres` when root:
it refuses root too) with `pool_mode = transaction`, a wildcard database entry
(any database name is forwarded to the cluster), and no server-side prepared
statements or LISTEN, the limits a store must live with behind it.

Where no server binaries exist the fixtures skip with the reason; `.ci/run`
installs them, so they run there. Bound to module names in a test module, as
`aws_fixtures` are:

    from tests.jobs import postgres_fixtures
    postgres_cluster = postgres_fixtures.postgres_cluster
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

_START_TIMEOUT_S = 60.0
ROLE = "thaw"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def server_bindir() -> Path | None:
    """The newest PostgreSQL server's bin directory (Debian keeps them out of PATH)."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/postgres"),
        key=lambda p: (
            int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0
        ),
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def pgbouncer_binary() -> str | None:
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/sbin")


def _as_server_user(argv: list[str]) -> list[str]:
    """argv run as `postgres` when we are root (the server refuses root)."""
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


def _own(path: Path) -> None:
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _private_dir(prefix: str) -> Path:
    """A directory the server user can use: pytest's tmp dirs are root's, mode 0700."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _own(path)
    return path


class PostgresCluster:
    """One PostgreSQL server of our own: `start()`, `stop()`, `restart()`, `remove()`."""

    def __init__(self, bindir: Path, *, port: int | None = None, durable: bool = False) -> None:
        self.bindir = bindir
        self.port = port or free_port()
        self.root = _private_dir("thaw-pg-")
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        # durable: the server's defaults (fsync on), for figures that mean something.
        self.durable = durable
        self._run(
            [
                str(bindir / "initdb"),
                "-D",
                str(self.data),
                "-U",
                ROLE,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--locale=C.UTF-8",
            ]
        )

    def _run(self, argv: list[str]) -> None:
        done = subprocess.run(_as_server_user(argv), capture_output=True, text=True, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(
                f"{argv[0]} failed ({done.returncode}): {done.stderr or done.stdout}"
            )

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        options = [
            f"-c port={self.port}",
            "-c listen_addresses=127.0.0.1",
            f"-c unix_socket_directories={self.root}",
            "-c max_connections=300",
        ]
        if not self.durable:
            options += ["-c fsync=off", "-c full_page_writes=off"]
        self._run(
            [
                str(self.bindir / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log),
                "-w",
                "-t",
                str(int(_START_TIMEOUT_S)),
                "-o",
                " ".join(options),
                "start",
            ]
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; `immediate` is as abrupt as a crash (no shutdown checkpoint)."""
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def execute(self, sql: str, dbname: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.dsn(dbname), autocommit=True) as conn:
            conn.execute(sql.encode())

    def create_database(self) -> str:
        """A new, empty database; its name."""
        name = f"t_{secrets.token_hex(6)}"
        # FILE_COPY from template0: 50 ms here, against 330 ms for the default strategy
        # (which WAL-logs every page of the template).
        self.execute(f"CREATE DATABASE {name} TEMPLATE template0 STRATEGY = FILE_COPY")
        return name

    def drop_database(self, name: str) -> None:
        # FORCE: PgBouncer may still hold server connections to it.
        self.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def remove(self) -> None:
        if self.running:
            with contextlib.suppress(RuntimeError):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


class PgBouncer:
    """PgBouncer in transaction mode before `cluster`, as a child process."""

    def __init__(self, binary: str, cluster: PostgresCluster, *, pool_size: int = 20) -> None:
        self.cluster = cluster
        self.port = free_port()
        self.root = _private_dir("thaw-pgbouncer-")
        self.log = self.root / "pgbouncer.log"
        users = self.root / "users.txt"
        users.write_text(f'"{ROLE}" ""\n')
        config = self.root / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={cluster.port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 2000\n"
            # While the server is down a client waits this long for one, then errors
            # (the default, 120 s, would hold every store call for two minutes);
            # a failed login is retried after 1 s, failing clients meanwhile.
            "query_wait_timeout = 2\n"
            "server_login_retry = 1\n"
            f"logfile = {self.log}\n" + ("user = postgres\n" if os.geteuid() == 0 else "")
            # As root it switches to `postgres` itself (it refuses to run as root),
            # so the child we signal and reap is PgBouncer, not a runuser wrapper.
        )
        for path in (users, config):
            _own(path)
        self.proc = subprocess.Popen(
            [binary, str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self._wait_until_up()

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log.read_text() if self.log.exists() else ""
                raise RuntimeError(f"pgbouncer exited with {self.proc.returncode}: {log}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen within {_START_TIMEOUT_S} s")

    def dsn(self, dbname: str) -> str:
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{dbname}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM: at once (SIGINT would wait for its clients to leave).
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def started_cluster(*, durable: bool = False) -> PostgresCluster:
    """A running cluster, or a pytest skip saying why there can be none."""
    bindir = server_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql; .ci/run does)")
    cluster = PostgresCluster(bindir, durable=durable)
    try:
        cluster.start()
    except BaseException:
        cluster.remove()
        raise
    return cluster


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """The session's cluster (tests that stop or restart a server start their own)."""
    cluster = started_cluster()
    yield cluster
    cluster.remove()


@pytest.fixture(scope="session")
def pgbouncer(postgres_cluster: PostgresCluster) -> Iterator[PgBouncer]:
    binary = pgbouncer_binary()
    if binary is None:
        pytest.skip("no pgbouncer binary (apt-get install pgbouncer; .ci/run does)")
    bouncer = PgBouncer(binary, postgres_cluster)
    yield bouncer
    bouncer.stop()


@pytest.fixture(scope="session")
def _postgres_session_database(postgres_cluster: PostgresCluster) -> str:
    return postgres_cluster.create_database()


@pytest.fixture
def postgres_database(postgres_cluster: PostgresCluster, _postgres_session_database: str) -> str:
    """An empty database of the session's cluster for one test; its name.

    One database for the session, emptied before each test (2 ms): a new one
    per test costs a checkpoint each (over a second once earlier tests left
    pages to write).
    """
    postgres_cluster.execute(
        "DROP SCHEMA public CASCADE; CREATE SCHEMA public", _postgres_session_database
    )
    return _postgres_session_database


def store_dsn(request: pytest.FixtureRequest, through_pgbouncer: bool) -> str:
    """The URL of a store on this test's fresh database: straight to the cluster, or
    through PgBouncer (writes) with the listening session straight to the cluster."""
    cluster: PostgresCluster = request.getfixturevalue("postgres_cluster")
    name: str = request.getfixturevalue("postgres_database")
    if not through_pgbouncer:
        return cluster.dsn(name)
    bouncer: PgBouncer = request.getfixturevalue("pgbouncer")
    return f"{bouncer.dsn(name)}?listen={quote(cluster.dsn(name), safe='')}"
