"""The one settings object, read once from `THAW_*` environment variables.

Nothing else in the runtime reads `os.environ` for configuration; every
component receives the settings (or the values it needs) in its constructor.

A function project (docs/projects.md) is found here too, as settings are read:
the working directory or its nearest parent whose pyproject.toml has a
`[tool.thaw]` table. In a project its `handlers` package and its bundles/ are
the ones served (its root goes first on `sys.path`, its bundles/ is the
default bundle source); THAW_HANDLERS and THAW_BUNDLE_SOURCE still override.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from runtime.errors import ConfigError


def _parse_bytes(text: str) -> int:
    """`8GiB`, `512MB`, `1e9` or a plain integer -> bytes."""
    units = {
        "kib": 1024,
        "mib": 1024**2,
        "gib": 1024**3,
        "tib": 1024**4,
        "kb": 1000,
        "mb": 1000**2,
        "gb": 1000**3,
        "tb": 1000**4,
        "k": 1024,
        "m": 1024**2,
        "g": 1024**3,
        "b": 1,
    }
    raw = text.strip().lower().replace("_", "")
    for suffix, factor in units.items():
        if raw.endswith(suffix):
            return int(float(raw[: -len(suffix)].strip()) * factor)
    return int(float(raw))


def _split_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


PROJECT_FILE = "pyproject.toml"


def find_project(start: Path) -> Path | None:
    """The root of the function project `start` is in: `start` or its nearest parent
    whose pyproject.toml has a `[tool.thaw]` table; None outside any project."""
    for directory in (start, *start.parents):
        try:
            text = (directory / PROJECT_FILE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        # tomllib only for a file that may hold the table: a start parses no TOML
        # of a project that is not Thaw's.
        if "tool.thaw" in text.replace(" ", "").replace('"', "") and _marks_project(
            directory / PROJECT_FILE, text
        ):
            return directory
    return None


def _marks_project(path: Path, text: str) -> bool:
    import tomllib

    try:
        table = tomllib.loads(text).get("tool", {}).get("thaw")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from exc
    return isinstance(table, dict)


def _put_first_on_path(directory: str) -> None:
    """The project's root on sys.path (first, unless it is there already): `handlers`
    is then its own package, also under the `thaw` script, whose sys.path holds
    the script's directory rather than the working directory."""
    if directory not in sys.path:
        sys.path.insert(0, directory)


# Plain keys, read once: handler code in this process must not find them in its environment.
SECRET_VARIABLES = ("THAW_API_KEYS", "THAW_OPERATOR_KEYS")


def forget_secrets(environ: MutableMapping[str, str] | None = None) -> None:
    """Drop the plain keys from the environment once the settings hold them."""
    env = os.environ if environ is None else environ
    for name in SECRET_VARIABLES:
        env.pop(name, None)


@dataclass(frozen=True)
class Settings:
    """Runtime configuration. Each field `x` is read from `THAW_X`."""

    # Seconds a caller waits by default before getting a 202 and a job.
    wait_s: float = 10.0
    # Answer a turned-into-a-job request this long before its deadline.
    deadline_margin_s: float = 0.15
    # Where bundles come from: a directory or s3://bucket/prefix.
    bundle_source: str = "bundles"
    # Node cache for fetched bundles and persisted load statistics.
    cache_dir: str = ".thaw/cache"
    state_dir: str = ".thaw/state"
    # sqlite:///path or dynamodb://table?bucket=name
    job_store: str = "sqlite:///.thaw/jobs.sqlite3"
    # Retention: a job is kept this long after it is recorded, then purged.
    job_ttl_s: float = 24 * 3600.0
    # Stored jobs (runtime/jobs/quota.py): per key, and in all, as counts and
    # bytes of input and output JSON; past them a new job is 429 quota-exceeded.
    max_jobs_per_key: int = 1000
    max_job_bytes_per_key: int = 1024**3
    max_jobs: int = 10000
    max_job_bytes: int = 8 * 1024**3
    job_lease_s: float = 30.0
    job_max_attempts: int = 3
    # 0 means "derive from the machine" (free GPU memory or the cgroup/host limit).
    memory_budget: int = 0
    prewarm: tuple[str, ...] = ()
    # Handler modules to import; empty means every module in the `handlers` package.
    handlers: tuple[str, ...] = ()
    # The function project's root (a pyproject.toml with [tool.thaw]); empty: the
    # working directory's project, found upward, if any (docs/projects.md).
    project_dir: str = ""
    max_queue: int = 64
    # Sync handlers' calls run on at most this many threads at once (the thread limit).
    handler_threads: int = 64
    max_body_bytes: int = 6 * 1024 * 1024
    # A request body must arrive whole within this long (408 otherwise).
    body_timeout_s: float = 30.0
    # Request bytes buffered across all connections; past it 503 + Retry-After.
    max_buffered_bytes: int = 256 * 1024 * 1024
    # Deepest nesting of arrays/objects accepted in a JSON body (orjson stops at 1024).
    max_json_depth: int = 64
    drain_grace_s: float = 30.0
    device: str = ""
    # Back-off after a failed load before the next attempt, doubled per failure.
    retry_backoff_s: float = 1.0
    # Used for estimates before any load of a bundle was observed.
    default_bandwidth_bytes_s: float = 200e6
    default_init_s: float = 2.0
    fetch_stall_s: float = 30.0
    # A load phase (fetch, load, init, one warm-up example) making no progress this long fails.
    phase_stall_s: float = 300.0
    # A handler run longer than this fails with handler-timeout (a sync one wedges the instance).
    run_timeout_s: float = 900.0
    # A server-sent event stream idle this long gets a comment line, so proxies
    # and clients with read timeouts keep it open (runtime/http/sse.py).
    sse_heartbeat_s: float = 15.0
    # The Function URL's invoke mode (template.yaml's FunctionUrlInvokeMode):
    # RESPONSE_STREAM makes the Lambda loop stream its Function URL answers.
    invoke_mode: str = "BUFFERED"
    fetch_concurrency: int = 8
    min_residency_s: float = 30.0
    # Secrets: kept out of the settings' repr so no log line can carry them.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_file: str = ""
    # Operator keys: they alone reach instance-wide actions (drain, load, unload)
    # and readiness details; they reach every tenant route too.
    operator_keys: tuple[str, ...] = field(default=(), repr=False)
    operator_keys_file: str = ""
    # Held connections (job long-polls, SSE follows and streams): in total, and per key.
    max_held: int = 256
    max_held_per_key: int = 32
    # The longest wait a caller may ask for, by `?wait=` or `Prefer: wait`.
    max_wait_s: float = 60.0
    log_level: str = "INFO"
    # Host memory (runtime/models/weights/host.py, glibc only): while a bundle
    # loads or unloads, allocations from this size up get a mapping of their own,
    # unmapped on free; between those, requests reuse the heap (0: glibc's threshold, which
    # climbs past weight tensors after the first unload); at most this many
    # malloc arenas (0: glibc's 8 per core); and the allocator's free pages
    # handed back to the OS once a bundle unloads or is evicted.
    mmap_threshold_bytes: int = 1024 * 1024
    malloc_arena_max: int = 4
    malloc_trim: bool = True
    # A server process whose handlers use bundles loads the framework's native
    # libraries on another thread as it starts, not at its first load
    # (runtime/preload.py); its Python modules still wait for the first load.
    preload_framework: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = f"THAW_{f.name.upper()}"
            if key not in env:
                continue
            raw = env[key]
            default = f.default
            try:
                if f.name == "memory_budget":
                    values[f.name] = _parse_bytes(raw) if raw.strip() else 0
                elif f.name in (
                    "max_body_bytes",
                    "max_buffered_bytes",
                    "max_job_bytes_per_key",
                    "max_job_bytes",
                    "mmap_threshold_bytes",
                ):
                    values[f.name] = _parse_bytes(raw)
                elif isinstance(default, tuple):
                    values[f.name] = _split_list(raw)
                elif isinstance(default, bool):
                    values[f.name] = raw.strip().lower() in {"1", "true", "yes", "on"}
                elif isinstance(default, int):
                    values[f.name] = int(raw)
                elif isinstance(default, float):
                    values[f.name] = float(raw)
                else:
                    values[f.name] = raw
            except ValueError as exc:
                raise ConfigError(f"{key}={raw!r} is not a valid {type(default).__name__}") from exc
        values.update(overrides)
        if "project_dir" not in values:
            found = find_project(Path.cwd())
            values["project_dir"] = str(found) if found is not None else ""
        if values["project_dir"]:
            root = Path(values["project_dir"]).resolve()
            values["project_dir"] = str(root)
            values.setdefault("bundle_source", str(root / "bundles"))
            _put_first_on_path(str(root))
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.wait_s < 0:
            raise ConfigError("THAW_WAIT_S must be >= 0")
        if self.max_queue < 1:
            raise ConfigError("THAW_MAX_QUEUE must be >= 1")
        if self.handler_threads < 1:
            raise ConfigError("THAW_HANDLER_THREADS must be >= 1")
        if self.job_max_attempts < 1:
            raise ConfigError("THAW_JOB_MAX_ATTEMPTS must be >= 1")
        if self.max_body_bytes < 1:
            raise ConfigError("THAW_MAX_BODY_BYTES must be >= 1")
        if self.max_json_depth < 1:
            raise ConfigError("THAW_MAX_JSON_DEPTH must be >= 1")
        if self.phase_stall_s <= 0:
            raise ConfigError("THAW_PHASE_STALL_S must be > 0")
        if self.run_timeout_s <= 0:
            raise ConfigError("THAW_RUN_TIMEOUT_S must be > 0")
        if self.sse_heartbeat_s <= 0:
            raise ConfigError("THAW_SSE_HEARTBEAT_S must be > 0")
        if self.invoke_mode not in ("BUFFERED", "RESPONSE_STREAM"):
            raise ConfigError("THAW_INVOKE_MODE must be BUFFERED or RESPONSE_STREAM")
        if min(self.max_jobs_per_key, self.max_job_bytes_per_key) < 1:
            raise ConfigError("THAW_MAX_JOBS_PER_KEY and THAW_MAX_JOB_BYTES_PER_KEY must be >= 1")
        if min(self.max_jobs, self.max_job_bytes) < 1:
            raise ConfigError("THAW_MAX_JOBS and THAW_MAX_JOB_BYTES must be >= 1")
        if self.max_held < 1 or self.max_held_per_key < 1:
            raise ConfigError("THAW_MAX_HELD and THAW_MAX_HELD_PER_KEY must be >= 1")
        if self.max_wait_s < 0:
            raise ConfigError("THAW_MAX_WAIT_S must be >= 0")
        if self.body_timeout_s <= 0:
            raise ConfigError("THAW_BODY_TIMEOUT_S must be > 0")
        if not 0 <= self.mmap_threshold_bytes <= 32 * 1024 * 1024:
            raise ConfigError("THAW_MMAP_THRESHOLD_BYTES must be 0 (glibc's own) to 32MiB")
        if self.malloc_arena_max < 0:
            raise ConfigError("THAW_MALLOC_ARENA_MAX must be >= 0 (0: glibc's own)")
        # Bodies still arriving may not take the cap's last min(64 KiB, cap/4)
        # (runtime/http/intake.py): a largest body must still fit beside that.
        if self.max_buffered_bytes < self.max_body_bytes + min(
            64 * 1024, self.max_buffered_bytes // 4
        ):
            raise ConfigError(
                "THAW_MAX_BUFFERED_BYTES must leave room for one THAW_MAX_BODY_BYTES body "
                "beyond its reserve (max body + 64 KiB)"
            )

    @property
    def auth(self) -> bool:
        """Whether any key is configured (HTTP mode then refuses callers without one)."""
        return bool(
            self.api_keys or self.api_keys_file or self.operator_keys or self.operator_keys_file
        )

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir)

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)
