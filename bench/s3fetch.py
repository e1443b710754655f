"""S3 fetch: an 8-shard 512 MiB bundle from a moto server process on 127.0.0.1.

Thaw: `S3Source.fetch` (all byte ranges of all shards by `concurrency`
threads, sha256 while streaming, files renamed into the node cache once
verified). Baseline: boto3's `download_file` with default settings, one shard
after another (its default transfer config already splits each file into
8 MiB ranges fetched by 10 threads), hashing nothing. A third variant,
`download_file` with one GET per shard, shows what moto charges for ranged
GETs: it copies the whole object for every range it serves.

Variants alternate per round; medians.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

# `python bench/s3fetch.py` puts bench/ on sys.path, not the repository root.
ROOT_DIR = Path(__file__).resolve().parent.parent
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

from bench.common import HOST, Row, fmt_bw, fmt_s, fmt_x, free_port, median, verdict  # noqa: E402

SHARDS = 8
SHARD_BYTES = 64 * 1024 * 1024
TARGET = 2.0
CREDENTIALS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "region_name": "us-east-1",
}


def s3_client(url: str, session: Any) -> Any:
    """A boto3 S3 client for the moto server: default settings, fake credentials."""
    return session.client("s3", endpoint_url=url, **CREDENTIALS)


class MotoServer:
    """`python -m moto.server` on 127.0.0.1, always stopped."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> MotoServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
        with open(self.log, "wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=2):
                    return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("moto server did not start within 60 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_bundle(root: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from runtime.bundles.manifest import build_bundle

    src = root / "src"
    src.mkdir()
    generator = torch.Generator().manual_seed(0)
    floats = (SHARD_BYTES - 1024) // 4  # leave room for the safetensors header
    for shard in range(SHARDS):
        tensor = torch.rand(floats, generator=generator)
        save_file({f"shard{shard}.weight": tensor}, src / f"model-{shard:05d}.safetensors")
    build_bundle(src, "big", out=root / "big")
    shutil.rmtree(src)
    return root / "big"


def run(*, quick: bool = False) -> list[Row]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    from runtime.bundles.manifest import read_manifest
    from runtime.bundles.sources.s3 import S3Source, make_client

    rounds = 1 if quick else 2
    with tempfile.TemporaryDirectory(prefix="thaw-bench-s3-") as tmp_dir:
        tmp = Path(tmp_dir)
        bundle = make_bundle(tmp)
        manifest = read_manifest(bundle)
        nbytes = manifest.total_bytes
        with MotoServer(tmp / "moto.log") as moto:
            session = boto3.session.Session()
            s3 = s3_client(moto.url, session)
            s3.create_bucket(Bucket="bench")
            for path in sorted(bundle.iterdir()):
                with open(path, "rb") as body:
                    s3.put_object(Bucket="bench", Key=f"bundles/big/{path.name}", Body=body)
            shards = [f.path for f in manifest.files]

            def thaw() -> float:
                cache = tmp / "node-cache"
                client = make_client(
                    stall_s=30.0, concurrency=8, endpoint_url=moto.url, **CREDENTIALS
                )
                source = S3Source("bench", "bundles/", cache, client=client, concurrency=8)
                started = time.perf_counter()
                source.fetch(manifest, lambda n: None)
                elapsed = time.perf_counter() - started
                shutil.rmtree(cache)
                return elapsed

            def boto(config: TransferConfig | None) -> float:
                out = tmp / "boto"
                out.mkdir()
                client = s3_client(moto.url, session)
                started = time.perf_counter()
                for name in shards:
                    key = f"bundles/big/{name}"
                    if config is None:
                        client.download_file("bench", key, str(out / name))
                    else:
                        client.download_file("bench", key, str(out / name), Config=config)
                elapsed = time.perf_counter() - started
                shutil.rmtree(out)
                return elapsed

            single_get = TransferConfig(multipart_threshold=1 << 40)
            variants: dict[str, Callable[[], float]] = {
                "thaw": thaw,
                "boto": lambda: boto(None),
                "boto-single": lambda: boto(single_get),
            }
            times: dict[str, list[float]] = {name: [] for name in variants}
            for index in range(rounds):
                names = list(variants)
                for name in names if index % 2 == 0 else names[::-1]:
                    times[name].append(variants[name]())
    thaw_s, boto_s, single_s = (median(times[n]) for n in ("thaw", "boto", "boto-single"))
    ratio = median([b / t for t, b in zip(times["thaw"], times["boto"], strict=True)])
    size = f"{nbytes / 2**20:.0f} MiB, {SHARDS} shards"
    return [
        Row(
            f"S3 fetch {size} from moto: Thaw S3Source (8 streams, sha256 verified) "
            "vs boto3 download_file (defaults), shard after shard",
            f"{fmt_s(thaw_s)} ({fmt_bw(nbytes / thaw_s)})",
            f"{fmt_s(boto_s)} ({fmt_bw(nbytes / boto_s)})",
            fmt_x(ratio),
            f">= {TARGET}x",
            verdict(ratio >= TARGET),
        ),
        Row(
            f"S3 fetch {size}: vs boto3 download_file, one GET per shard (no ranges)",
            f"{fmt_s(thaw_s)}",
            f"{fmt_s(single_s)} ({fmt_bw(nbytes / single_s)})",
            fmt_x(
                median([b / t for t, b in zip(times["thaw"], times["boto-single"], strict=True)])
            ),
        ),
    ]


if __name__ == "__main__":
    from bench.common import table_main

    table_main(run, __doc__)
