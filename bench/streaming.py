"""Token streaming (issue 18): `generate` over server-sent events and through the emulator.

    .venv/bin/python bench/streaming.py [--rounds N] [--pairs N]

One run, one prompt, the same SmolLM2 bundle (bundles/smollm2) everywhere:

- time to first token: a `thaw serve` process answering `POST /invoke/generate`
  with `Accept: text/event-stream`, from just before the request is written to
  the arrival of the first token event, against a bare loop in this process
  with the same model code (the bundle's builder, `generate_steps`): encode,
  prefill, sample the first token, decode its text. Alternating rounds (11),
  medians.
  Target: <= 1.1x.
- tokens per second while streaming: the same request (128 tokens, greedy)
  streamed and not streamed, from the same server, alternating (7 pairs);
  completion tokens over each request's wall time, medians. Target: >= 0.95x.
- the emulator: `thaw emulate` with the function's Function URL in
  RESPONSE_STREAM mode, boto3's `invoke_with_response_stream` with a direct
  streaming event: the first PayloadChunk against the InvokeComplete, from
  just before the call. Target: the first chunk before 20 % of the whole.

Prints one markdown table (bench/common.py's `render`); progress on stderr.
Every process it starts runs on 127.0.0.1 and is stopped before it returns.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    ROOT,
    Proc,
    Row,
    fmt_s,
    fmt_x,
    free_port,
    lambda_client,
    median,
    render,
    runtime_env,
    start_emulator,
    stopping,
    thaw_serve_argv,
    verdict,
)

BUNDLE = ROOT / "bundles" / "smollm2"
MESSAGES = [
    {
        "role": "user",
        "content": (
            "You keep a lighthouse on a rocky island. Describe one winter night there: "
            "the storm, the lamp, the ships you watch for, and what you think about."
        ),
    }
]
TTFT_TARGET = 1.1
RATE_TARGET = 0.95
FIRST_CHUNK_TARGET = 0.2
SSE = {"accept": "text/event-stream"}
SETTLE_S = 0.5
TEMPLATE = """
AWSTemplateFormatVersion: "2010-09-09"
Transform: AWS::Serverless-2016-10-31
Resources:
  ThawFunction:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Timeout: 300
      FunctionUrlConfig: {AuthType: NONE, InvokeMode: RESPONSE_STREAM}
      Environment:
        Variables:
          THAW_HANDLERS: handlers.generate
          THAW_INVOKE_MODE: RESPONSE_STREAM
"""


def progress(message: str) -> None:
    print(f"[streaming] {message}", file=sys.stderr, flush=True)


# ---- the bare loop ----------------------------------------------------------------


def load_bare() -> Any:
    """The bundle's model, built in this process by its own builder."""
    from safetensors.torch import load_file

    from handlers.generate import build_smollm2

    manifest = json.loads((BUNDLE / "bundle.json").read_text())
    files = {f["path"]: BUNDLE / f["path"] for f in manifest["files"]}
    weights: dict[str, Any] = {}
    for path in files.values():
        if path.suffix == ".safetensors":
            weights.update(load_file(str(path)))
    return build_smollm2(weights, manifest["config"], "cpu", files)


def bare_first_token_s(lm: Any) -> float:
    """Encode, prefill, sample the first token and decode its text: the bare loop."""
    from handlers.models.llama import Sampling, generate_steps

    started = time.monotonic()
    ids = lm.encode_chat([(m["role"], m["content"]) for m in MESSAGES])
    steps = generate_steps(lm.model, ids, 128, Sampling(), lm.stop_ids)
    token = next(steps)
    lm.tokenizer.decode([token])
    took = time.monotonic() - started
    steps.close()
    return took


# ---- over HTTP ------------------------------------------------------------------


def sse_first_token_s(client: httpx.Client, max_tokens: int = 128) -> float:
    """From just before the request to the first token event (the rest is read and dropped)."""
    body = {"messages": MESSAGES, "max_tokens": max_tokens}
    started = time.monotonic()
    first = 0.0
    with client.stream("POST", "/invoke/generate", json=body, headers=SSE) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and not first:
                first = time.monotonic() - started
    return first


def streamed_rate(client: httpx.Client, max_tokens: int) -> tuple[float, int]:
    """(tokens per second, completion tokens) of one streamed request."""
    body = {"messages": MESSAGES, "max_tokens": max_tokens}
    started = time.monotonic()
    result: dict[str, Any] = {}
    event = ""
    with client.stream("POST", "/invoke/generate", json=body, headers=SSE) as response:
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line.partition(":")[2].strip()
            elif line.startswith("data:") and event == "result":
                result = orjson.loads(line.partition(":")[2])
    took = time.monotonic() - started
    tokens = int(result["usage"]["completion_tokens"])
    return tokens / took, tokens


def plain_rate(client: httpx.Client, max_tokens: int) -> tuple[float, int]:
    body = {"messages": MESSAGES, "max_tokens": max_tokens}
    started = time.monotonic()
    response = client.post("/invoke/generate", json=body, headers={"prefer": "wait=600"})
    took = time.monotonic() - started
    response.raise_for_status()
    tokens = int(response.json()["usage"]["completion_tokens"])
    return tokens / took, tokens


def wait_ready(client: httpx.Client, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get("/readyz").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become ready")
        time.sleep(0.1)


def http_rows(tmp: Path, rounds: int, pairs: int) -> list[Row]:
    lm = load_bare()
    bare_first_token_s(lm)  # the bare loop's own first call pays its set-up
    port = free_port()
    env = runtime_env(tmp / "serve", handlers="handlers.generate", prewarm="smollm2")
    with stopping([]) as procs:
        server = Proc(thaw_serve_argv(port), env, port, tmp / "serve.log")
        procs.append(server.start())
        server.wait_healthy()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            wait_ready(client)
            sse_first_token_s(client, 2)  # the keep-alive connection, and a first call
            bare_s: list[float] = []
            sse_s: list[float] = []
            for index in range(rounds):
                # Alternating order: drift in the machine's load hits both alike. Each
                # measurement starts after a pause: torch's OpenMP workers spin a while
                # after their last op, and on two cores the other process's spinning
                # threads would be timed too.
                order = (0, 1) if index % 2 else (1, 0)
                for which in order:
                    time.sleep(SETTLE_S)
                    if which:
                        sse_s.append(sse_first_token_s(client, 8))
                    else:
                        bare_s.append(bare_first_token_s(lm))
            progress(f"first token: bare {median(bare_s):.4f} s, SSE {median(sse_s):.4f} s")
            streamed: list[float] = []
            plain: list[float] = []
            tokens = 0
            for index in range(pairs):
                first, second = (
                    (plain_rate, streamed_rate) if index % 2 else (streamed_rate, plain_rate)
                )
                for fn in (first, second):
                    time.sleep(SETTLE_S)
                    rate, tokens = fn(client, 128)
                    (streamed if fn is streamed_rate else plain).append(rate)
            progress("tokens/s streamed: " + " ".join(f"{r:.1f}" for r in streamed))
            progress("tokens/s plain:    " + " ".join(f"{r:.1f}" for r in plain))
    ttft = median(sse_s) / median(bare_s)
    rate = median(streamed) / median(plain)
    return [
        Row(
            "time to first token, SSE vs bare in-process loop (median)",
            fmt_s(median(sse_s)),
            fmt_s(median(bare_s)),
            fmt_x(ttft),
            f"<= {TTFT_TARGET}x",
            verdict(ttft <= TTFT_TARGET),
        ),
        Row(
            f"tokens/s while streaming vs not streaming ({tokens} tokens, median)",
            f"{median(streamed):.1f}/s",
            f"{median(plain):.1f}/s",
            fmt_x(rate),
            f">= {RATE_TARGET}x",
            verdict(rate >= RATE_TARGET),
        ),
    ]


# ---- through the emulator ---------------------------------------------------------


def emulator_rows(tmp: Path, runs: int) -> list[Row]:
    template = tmp / "template.yaml"
    template.write_text(TEMPLATE)
    env = runtime_env(tmp / "emulate")
    with stopping([]) as procs:
        emulator = start_emulator(procs, template, env, tmp / "emulate.log")
        client = lambda_client(emulator.port)
        event = {"handler": "generate", "input": {"messages": MESSAGES, "max_tokens": 128}}
        payload = orjson.dumps({**event, "stream": True, "wait_s": 300})

        def once() -> tuple[float, float, int]:
            started = time.monotonic()
            answer = client.invoke_with_response_stream(
                FunctionName="ThawFunction", Payload=payload
            )
            first = 0.0
            chunks = 0
            for item in answer["EventStream"]:
                if "PayloadChunk" in item:
                    chunks += 1
                    first = first or time.monotonic() - started
                elif item["InvokeComplete"].get("ErrorCode"):
                    raise RuntimeError(f"invocation failed: {item['InvokeComplete']}")
            return first, time.monotonic() - started, chunks

        once()  # the cold start: loads the model in the sandbox
        results = [once() for _ in range(runs)]
    firsts = [r[0] for r in results]
    fulls = [r[1] for r in results]
    share = median([f / w for f, w, _ in results])
    progress(f"emulator: first chunk {median(firsts):.3f} s of {median(fulls):.3f} s")
    return [
        Row(
            "emulator invoke_with_response_stream: first chunk / complete "
            f"({results[0][2]} chunks, median)",
            fmt_s(median(firsts)),
            fmt_s(median(fulls)),
            f"{share * 100:.1f} %",
            f"< {FIRST_CHUNK_TARGET * 100:.0f} %",
            verdict(share < FIRST_CHUNK_TARGET),
        )
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=11, help="first-token rounds (default 11)")
    parser.add_argument(
        "--pairs", type=int, default=7, help="streamed/plain 128-token pairs (default 7)"
    )
    args = parser.parse_args()
    if not (BUNDLE / "bundle.json").exists():
        print("bundles/smollm2 is missing: python scripts/build_model_bundles.py", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="thaw-bench-streaming-") as tmp:
        rows = http_rows(Path(tmp), args.rounds, args.pairs)
        rows += emulator_rows(Path(tmp), 3)
    print(render(rows))
    return 0 if all(r.verdict != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
