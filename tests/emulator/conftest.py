"""A real `thaw emulate` process, shared by the emulator tests, and the template it reads."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config

from tests.support import SAFETY_S, make_bundle

HANDLERS = ",".join(
    f"tests.handlers.{m}"
    for m in ("echo", "raises", "sleepy", "slow_builder", "writes_file", "crashes")
)

# AWS wiring the emulator must override locally (job store, bundle source), short-form tags,
# a parameter default, Globals, and functions with different limits.
TEMPLATE = f"""
AWSTemplateFormatVersion: "2010-09-09"
Transform: AWS::Serverless-2016-10-31
Parameters:
  FunctionTimeout: {{Type: Number, Default: 10}}
Globals:
  Function:
    Timeout: !Ref FunctionTimeout
    MemorySize: 256
    Environment:
      Variables:
        THAW_HANDLERS: {HANDLERS}
        THAW_JOB_STORE: !Sub "dynamodb://${{JobsTable}}?bucket=${{Outputs}}"
        THAW_BUNDLE_SOURCE: s3://not-reachable/bundles
Resources:
  JobsTable: {{Type: AWS::DynamoDB::Table}}
  Outputs: {{Type: AWS::S3::Bucket}}
  ThawFunction:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      FunctionUrlConfig: {{AuthType: NONE}}
      Environment:
        Variables:
          TABLE_ARN: !GetAtt JobsTable.Arn
  Capped:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      ReservedConcurrentExecutions: 2
  Short:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      FunctionName: thaw-short
      Timeout: 1
  Multi:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Environment:
        Variables:
          AWS_LAMBDA_MAX_CONCURRENCY: 4
  Broken:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Environment:
        Variables:
          THAW_HANDLERS: tests.handlers.import_fails
  Foreign:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Environment:
        Variables:
          THAW_HANDLERS: tests.emulator.foreign_runtime
          FOREIGN_MODE: serve
  ForeignInit:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Environment:
        Variables:
          THAW_HANDLERS: tests.emulator.foreign_runtime
          FOREIGN_MODE: init-error
"""

EMULATE = (sys.executable, "-m", "runtime.cli.main", "emulate", "--port", "0")
_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")
_REPORT = re.compile(r"^REPORT RequestId: (\S+)\t(.*)$")


@dataclass(frozen=True)
class Report:
    request_id: str
    fields: dict[str, str]

    @property
    def cold(self) -> bool:
        return "Init Duration" in self.fields


class Emulator:
    """`thaw emulate --port 0` with REPORT lines on stdout and logs on stderr."""

    def __init__(
        self, workdir: Path, env: dict[str, str], *args: str, template: Path | None = None
    ) -> None:
        """`template`: the template to read; the suite's own (TEMPLATE) if None."""
        workdir.mkdir(parents=True, exist_ok=True)
        if template is None:
            template = workdir / "template.yaml"
            template.write_text(TEMPLATE)
        self.out_path, self.err_path = workdir / "emulator.out", workdir / "emulator.err"
        self.proc = subprocess.Popen(
            [*EMULATE, "--template", str(template), *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.out_path.open("wb"),
            stderr=self.err_path.open("wb"),
            start_new_session=True,
        )
        self.url = self._wait_listening()

    def _wait_listening(self, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = _LISTENING.search(self.err_path.read_text(errors="replace"))
            if match:
                return f"http://127.0.0.1:{match.group(1)}"
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"emulator did not start:\n{self.errors()}")

    def errors(self) -> str:
        return self.err_path.read_text(errors="replace")[-6000:]

    def report_lines(self) -> list[Report]:
        """Every REPORT so far, in order (a retried event has one per attempt)."""
        found: list[Report] = []
        for line in self.out_path.read_text().splitlines():
            match = _REPORT.match(line)
            if match:
                fields = dict(f.split(": ", 1) for f in match.group(2).split("\t"))
                found.append(Report(match.group(1), fields))
        return found

    def reports(self) -> dict[str, Report]:
        return {report.request_id: report for report in self.report_lines()}

    def report(self, request_id: str, timeout_s: float = 20.0) -> Report:
        """The invocation's REPORT, once it has ended (when its worker asks for more)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.reports().get(request_id)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"no REPORT for {request_id}:\n{self.errors()}")
            time.sleep(0.02)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0)

    def invoke(
        self, function: str, payload: bytes, *, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        with self.client() as client:
            return client.post(
                f"/2015-03-31/functions/{function}/invocations", content=payload, headers=headers
            )

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def state_env(root: Path) -> dict[str, str]:
    """This process's environment less THAW_* and Lambda's, with Thaw's state under `root`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env.update(
        {
            "THAW_BUNDLE_SOURCE": str(root / "bundles"),
            "THAW_CACHE_DIR": str(root / "cache"),
            "THAW_STATE_DIR": str(root / "state"),
            "THAW_JOB_STORE": f"sqlite:///{root / 'jobs.sqlite3'}",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def emulator_env(root: Path) -> dict[str, str]:
    """`state_env` with a bundle `tiny` (loads in 0.5 s, logging each load)."""
    make_bundle(
        root / "bundles", "tiny", config={"sleep_s": 0.5, "load_log": str(root / "loads.log")}
    )
    return state_env(root)


def lambda_client(emulator: Emulator) -> Any:
    """boto3's Lambda client on the emulator: one try, a minute to answer."""
    return boto3.client(
        "lambda",
        endpoint_url=emulator.url,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        config=Config(retries={"max_attempts": 1}, read_timeout=60),
    )


@pytest.fixture(scope="package")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """Shared by the package's tests: max 3 sandboxes, idle ones stopped after 2 s."""
    root = tmp_path_factory.mktemp("emulator")
    emu = Emulator(root, emulator_env(root), "--max-sandboxes", "3", "--idle-timeout", "2")
    yield emu
    emu.stop()


def wait_for(predicate: object, timeout_s: float = SAFETY_S, interval_s: float = 0.05) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError("condition not met in time")
