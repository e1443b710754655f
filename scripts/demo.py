"""The Thaw demo: build the bundles, start the runtime, show cold and warm invocations.

Run with `make demo` (which sets up .venv first). It starts a real `thaw serve`
on 127.0.0.1, sends each shipped handler one cold invocation (the first with a
short deadline, so it is answered 202 with a job that is then polled) and one
warm invocation, printing phase times from the Server-Timing header; then
submits one job (`POST /handlers/{handler}/jobs`, always 202) and polls it at
its Location, and stops the server with a drain. Last, each handler's cold
start is drawn as a waterfall (`thaw coldstart --waterfall`: a fresh server per
handler, with an empty cache) into .thaw/demo/waterfalls/, and the paths printed.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / ".thaw" / "demo"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def sample_image() -> str | None:
    try:
        import matplotlib.cbook

        path = matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
        return base64.b64encode(Path(str(path)).read_bytes()).decode()
    except (ImportError, OSError, ValueError):
        return None


def events() -> list[tuple[str, str, dict[str, Any]]]:
    """(handler, bundle dir, event) for every shipped handler whose bundle is built."""
    candidates: list[tuple[str, str, dict[str, Any]]] = [
        ("fahrenheit", "tempconv", {"celsius": [-40, 0, 37, 100]}),
        ("embed", "minilm", {"texts": ["A man is eating food.", "A man is eating bread."]}),
        (
            "generate",
            "smollm2",
            {
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24,
            },
        ),
    ]
    image = sample_image()
    if image is not None:
        candidates.append(("classify", "efficientnet", {"image": image, "top_k": 3}))
    return [c for c in candidates if (ROOT / "bundles" / c[1] / "bundle.json").exists()]


def phases(header: str) -> str:
    # The one Server-Timing parser (`thaw coldstart`'s): metrics carry other
    # parameters too, e.g. `batch;dur=0.03;desc="n=1"`.
    from runtime.cli.coldstart import parse_server_timing

    timings = parse_server_timing(header)
    return ", ".join(f"{name} {ms:.1f}" for name, ms in timings.items()) + " (ms)"


def summary(output: Any) -> str:
    text = str(output)
    if isinstance(output, dict):
        if "embeddings" in output:
            vectors = output["embeddings"]
            text = f"{len(vectors)} embeddings of dim {len(vectors[0])}"
        elif "labels" in output:
            text = ", ".join(f"{x['label']} {x['score']:.2f}" for x in output["labels"])
        elif "text" in output:
            text = repr(output["text"]) + f" usage={output.get('usage')}"
    return text if len(text) < 160 else text[:157] + "..."


def build_bundles() -> None:
    script = ROOT / "scripts" / "build_model_bundles.py"
    if script.exists():
        print("== building model bundles from the installed packages")
        subprocess.run([sys.executable, str(script), "--out", str(ROOT / "bundles")], check=True)


def waterfalls(env: dict[str, str]) -> None:
    """Each handler's cold invocation in a fresh `thaw serve`, drawn as a waterfall."""
    from runtime.cli.coldstart import compile_bytecode, measure
    from runtime.cli.waterfall import write

    print("\n== cold-start waterfalls (a fresh thaw serve per handler, empty cache)")
    if str(ROOT) not in sys.path:  # the checkout's handlers/: its project's, not installed
        sys.path.insert(0, str(ROOT))
    compile_bytecode(["handlers"])
    for name, _bundle, event in events():
        with tempfile.TemporaryDirectory(prefix="thaw-demo-") as tmp:
            fresh = {**env, "THAW_CACHE_DIR": f"{tmp}/cache", "THAW_STATE_DIR": f"{tmp}/state"}
            fresh["THAW_JOB_STORE"] = f"sqlite:///{tmp}/jobs.sqlite3"
            fresh.setdefault("THAW_BUNDLE_SOURCE", str(ROOT / "bundles"))
            result = measure(name, event, runs=3, env=fresh)
        svg, html = write(result, STATE / "waterfalls" / f"coldstart-{name}")
        total_s = result["process_start_to_first_answer_ms"] / 1000
        print(f"   {name}: {total_s:.2f} s to the first answer -> {svg} ({html})")


def main() -> int:
    build_bundles()
    STATE.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {
        **os.environ,
        "THAW_STATE_DIR": str(STATE / "state"),
        "THAW_CACHE_DIR": str(STATE / "cache"),
        "THAW_JOB_STORE": f"sqlite:///{STATE / 'jobs.sqlite3'}",
        "THAW_LOG_LEVEL": "WARNING",
    }
    print(f"== starting thaw serve on 127.0.0.1:{port}")
    started = time.monotonic()
    server = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli.main", "serve", "--port", str(port)],
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.01)
            print(f"   /healthz 200 after {time.monotonic() - started:.2f} s (no model loaded)")
            for index, (name, _bundle, event) in enumerate(events()):
                wait_s = 0.5 if index == 0 else 120
                print(f"\n== {name}: cold invocation (Prefer: wait={wait_s})")
                sent = time.monotonic()
                response = client.post(
                    f"/invoke/{name}", json=event, headers={"Prefer": f"wait={wait_s}"}
                )
                took_ms = (time.monotonic() - sent) * 1000
                if response.status_code == 202:
                    job = response.json()
                    print(
                        f"   202 in {took_ms:.0f} ms: job {job['id']} ({job['status']}, "
                        f"phase {job['phase']}), Retry-After {response.headers['retry-after']} s"
                    )
                    # The 202's Location is the job's poll (GET /jobs/{id}).
                    poll = response.headers["location"]
                    final = client.get(poll, params={"wait": 60}).json()
                    print(f"   polled: {final['status']} -> {summary(final.get('output'))}")
                    model = next(
                        m for m in client.get("/models").json()["models"] if m["name"] == _bundle
                    )
                    timings = ", ".join(f"{k} {v:.1f}" for k, v in model["phase_ms"].items())
                    print(f"   load phases: {timings} (ms)")
                else:
                    response.raise_for_status()
                    print(
                        f"   {response.status_code} in {took_ms:.0f} ms: {summary(response.json())}"
                    )
                    print(f"   Server-Timing: {phases(response.headers['server-timing'])}")
                sent = time.monotonic()
                warm = client.post(f"/invoke/{name}", json=event)
                took_ms = (time.monotonic() - sent) * 1000
                warm.raise_for_status()
                print(f"== {name}: warm invocation -> {warm.status_code} in {took_ms:.1f} ms")
                print(f"   Server-Timing: {phases(warm.headers['server-timing'])}")
            print(f"\n== {name}: submitted as a job (POST /handlers/{name}/jobs)")
            submitted = client.post(f"/handlers/{name}/jobs", json=event)
            submitted.raise_for_status()
            poll = submitted.headers["location"]
            print(f"   {submitted.status_code}, Location {poll}")
            final = client.get(poll, params={"wait": 60}).json()
            print(f"   polled: {final['status']} -> {summary(final.get('output'))}")
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        print(f"\n== server drained and exited with {code}")
    waterfalls(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
