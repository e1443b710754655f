"""Fixtures for the fleet's tests: a throwaway PostgreSQL cluster (the session's,
tests/jobs/postgres_fixtures.py), a database of its own per test, and
`make_fleet(count, **env)`, whose instances and nginx the test's end stops."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fleet.harness import Fleet, nginx_binary
from tests.jobs import postgres_fixtures

postgres_cluster = postgres_fixtures.postgres_cluster

MakeFleet = Callable[..., Fleet]

# Without the postgres extra (psycopg) a fleet cannot run: its tests are not
# collected (test_kubernetes.py reads the Secret's URL with the store's parser).
if importlib.util.find_spec("psycopg") is None:
    collect_ignore = [
        "test_chaos.py",
        "test_cross_instance.py",
        "test_fleet.py",
        "test_liveness_wakeups.py",
        "test_store_faults.py",
        "test_kubernetes.py",
    ]


@pytest.fixture
def fleet_dsn(postgres_cluster: postgres_fixtures.PostgresCluster) -> Iterator[str]:
    """The URL of an empty database of its own, dropped after the test."""
    name = postgres_cluster.create_database()
    yield postgres_cluster.dsn(name)
    postgres_cluster.drop_database(name)


@pytest.fixture
def fleet_env(thaw_env: dict[str, str]) -> dict[str, str]:
    return {
        **thaw_env,
        "THAW_HANDLERS": "handlers.echo,tests.handlers.sleepy,tests.handlers.raises,"
        "tests.handlers.ticks",
        "THAW_LOG_LEVEL": "INFO",
    }


@pytest.fixture
def make_fleet(fleet_env: dict[str, str], fleet_dsn: str, tmp_path: Path) -> Iterator[MakeFleet]:
    binary = nginx_binary()
    if binary is None:
        pytest.skip("no nginx binary (apt-get install nginx; .ci/run does)")
    started: list[Fleet] = []

    def make(count: int = 3, **env: str) -> Fleet:
        fleet = Fleet(binary, {**fleet_env, **env}, fleet_dsn, tmp_path / "fleet", count)
        started.append(fleet)
        return fleet

    yield make
    for fleet in started:
        fleet.stop()
