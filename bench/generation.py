"""Continuous batching (issue 26): `generate` under concurrent streaming callers.

    .venv/bin/python bench/generation.py [--window S] [--rounds N] [--pairs N] [--ttft-prompts N]
                                         [--threads N] [--bundles DIR] [--skip-transformers]
    .venv/bin/python bench/generation.py --identity N [--identity-tokens T]
    .venv/bin/python bench/generation.py --steps THREADS

One run, one `thaw serve` process, the same SmolLM2 bundle and loaded model for both:

- Thaw: `generate` (continuous batching: every sequence shares each decode step,
  runtime/dispatch/decode.py);
- today: `generate_private` (below: the shipped model's own per-request loop,
  `ChatLM.stream`, one private decode loop per request on its own handler
  thread, behind the shipped handler's request checks);
- transformers' own continuous batching (`init_continuous_batching`, the manager
  behind `generate_batch`, transformers 5) on the same weights, in this process,
  fed the same requests with the same number in flight, its model once in
  float32 and once in bfloat16 (`TRANSFORMERS_DTYPES`).

Load: closed loop. Each of C callers (1, 8, 16) streams (`Accept: text/event-stream`)
one request after another for `--window` seconds, every window (and the
transformers runs) once per `--rounds`, in alternating order, medians across
rounds; every request is a prompt drawn from a fixed list of mixed lengths (a
few tokens to ~330, raw and chat) and a `max_tokens` drawn from 16-128, greedy,
the same seeded sequence for every server.
Measured in the window: tokens/s (every token event that arrived), time to first
token (request written -> first token event), inter-token gaps (between one
request's token events). A lone caller, alternating between the two handlers
request by request: `--pairs` pairs of one 64-token request (tokens/s, TTFT), and
`--ttft-prompts` pairs of the workload's first requests cut to one token (TTFT on
the workload's own prompt mix: the baseline of TTFT under load). Ratios are taken
within the run. Prints one markdown table; progress on stderr.
Every process it starts runs on 127.0.0.1 and is stopped before it returns.

`--identity N` only checks greedy output: N prompts (the list above, each made
distinct), run in one batch whose size changes at every step, against each
prompt alone; it prints how many completions are identical. `--steps THREADS`
only times one decode step of 1, 2, 8 and 16 sequences with that many intra-op
threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    ROOT,
    Proc,
    Row,
    fmt_s,
    fmt_x,
    free_port,
    median,
    percentile,
    render,
    runtime_env,
    stopping,
    thaw_serve_argv,
    verdict,
)
from handlers.generate import (
    _ACCELERATOR_WARMUP,
    _item,
    build_smollm2,  # noqa: F401  (the registry collects it)
    join_completion,
    parse_request,
)
from runtime import Context, handler

if TYPE_CHECKING:
    from handlers.models.chat import ChatLM

SSE = {"accept": "text/event-stream"}
THROUGHPUT_TARGET = 3.0  # Thaw / today, tokens/s at 8 callers
TTFT_TARGET = 1.5  # Thaw's TTFT p50 at 8 callers / a lone caller's
LONE_TARGET = 1.05  # Thaw / today for a lone caller: TTFT (and today / Thaw tokens/s)
PEER_TARGET = 1.0  # Thaw / transformers, tokens/s at 8 callers
_LONG = "Thaw loads a model once and keeps it warm for the requests that follow. "
PROMPTS: list[dict[str, Any]] = [
    {"prompt": "Once upon a time"},
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"prompt": "def fibonacci(n):"},
    {"messages": [{"role": "user", "content": "Write a short poem about the sea."}]},
    {"prompt": "The history of the bicycle begins in"},
    {"messages": [{"role": "user", "content": _LONG * 4 + "What does Thaw do?"}]},
    {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,"},
    {"messages": [{"role": "user", "content": "Explain photosynthesis to a child."}]},
    {"prompt": _LONG * 20 + "In short,"},
    {"messages": [{"role": "user", "content": "List three uses of a paperclip."}]},
]


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def workload(seed: int) -> list[dict[str, Any]]:
    """The requests, in order: the same for every server and concurrency."""
    rng = random.Random(seed)
    return [{**rng.choice(PROMPTS), "max_tokens": rng.randint(16, 128)} for _ in range(2000)]


# The baseline, served beside `generate` (THAW_HANDLERS=handlers.generate,bench.generation),
# warmed as `generate` is: on an accelerator only.
@handler(
    "generate_private",
    uses=["smollm2"],
    accelerator_warmup=_ACCELERATOR_WARMUP,
    join=join_completion,
)
def generate_private(event: Any, smollm2: ChatLM, ctx: Context) -> Iterator[dict[str, Any]]:
    """Complete a prompt or a chat in a decode loop of its own."""
    request = parse_request(event, smollm2)
    for piece in smollm2.stream(request.prompt_ids, request.max_tokens, request.opts, request.stop):
        yield _item(piece)


@dataclass
class Window:
    """What the callers saw in one measurement window."""

    seconds: float
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    requests: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


async def stream_one(
    client: httpx.AsyncClient, handler: str, event: dict[str, Any], window: Window, end: float
) -> None:
    sent = time.perf_counter()
    last: float | None = None
    async with client.stream("POST", f"/invoke/{handler}", json=event, headers=SSE) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{handler}: {response.status_code} {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("id:"):  # one per token event
                continue
            now = time.perf_counter()
            if now > end:
                return
            window.tokens += 1
            if last is None:
                window.ttft_s.append(now - sent)
            else:
                window.gaps_s.append(now - last)
            last = now
    window.requests += 1


async def measure(url: str, handler: str, callers: int, window_s: float, seed: int) -> Window:
    requests = iter(workload(seed))
    window = Window(window_s)
    limits = httpx.Limits(max_connections=callers + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        end = time.perf_counter() + window_s

        async def caller() -> None:
            while time.perf_counter() < end:
                await stream_one(client, handler, next(requests), window, end)

        tasks = [asyncio.ensure_future(caller()) for _ in range(callers)]
        await asyncio.wait(tasks, timeout=window_s)
        for task in tasks:
            task.cancel()  # the callers still streaming go away: their slots free
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        # Settle: nothing of this window still runs when the next one starts.
        for _ in range(6000):
            models = (await client.get("/models")).json()["models"]
            if all(m["in_flight"] == 0 for m in models):
                break
            await asyncio.sleep(0.05)
    return window


async def lone_pairs(url: str, pairs: int) -> list[tuple[dict[str, float], dict[str, float]]]:
    """A lone caller, request by request: the same request to each handler in turn (who
    goes first alternates), so the two of a pair see the same machine. Per request:
    time to first token, and tokens/s from the first token to the last."""
    # Counting never stops early: all 64 tokens come (a chat answer ends after ~8,
    # leaving tokens/s to a handful of gaps).
    event = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 64}
    out: list[tuple[dict[str, float], dict[str, float]]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for i in range(pairs):
            seen: dict[str, dict[str, float]] = {}
            order = ("generate", "generate_private") if i % 2 else ("generate_private", "generate")
            for handler in order:
                window = Window(1.0)
                started = time.perf_counter()
                await stream_one(client, handler, event, window, float("inf"))
                elapsed = time.perf_counter() - started
                decode_s = elapsed - window.ttft_s[0]
                if window.tokens < 64:
                    raise RuntimeError(f"{handler}: the lone request stopped early")
                seen[handler] = {
                    "ttft_s": window.ttft_s[0],
                    "tokens_per_s": (window.tokens - 1) / decode_s,
                }
            out.append((seen["generate"], seen["generate_private"]))
    return out


async def lone_ttfts(url: str, seed: int, count: int) -> list[tuple[float, float]]:
    """A lone caller's time to first token over the workload's own prompts (its first
    `count` requests, one token each), the same request to each handler in turn (who
    goes first alternates): the baseline of TTFT under load, on the same prompt mix."""
    out: list[tuple[float, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for i, event in enumerate(workload(seed)[:count]):
            seen: dict[str, float] = {}
            order = ("generate", "generate_private") if i % 2 else ("generate_private", "generate")
            for handler in order:
                window = Window(1.0)
                await stream_one(client, handler, {**event, "max_tokens": 1}, window, float("inf"))
                seen[handler] = window.ttft_s[0]
            out.append((seen["generate"], seen["generate_private"]))
    return out


# ---- transformers' continuous batching, in this process -------------------------

# Thaw's matrices are bfloat16 where the CPU has AMX (handlers/models/llama.py
# `packed_bf16`), so the peer runs in both: its float32 and its bfloat16 (every
# tensor, attention and cache included), and Thaw is held to each.
TRANSFORMERS_DTYPES = ("float32", "bfloat16")


def transformers_tokens_per_s(
    bundle: Path, callers: int, requests: int, seed: int, dtype: str = "float32"
) -> tuple[float, str]:
    """Its manager fed the workload's first `requests`, `callers` in flight at a time,
    its model in `dtype`: generated tokens over the elapsed time; or NaN and why it
    could not run."""
    try:
        import torch
        from safetensors.torch import load_file
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        return float("nan"), f"not installed ({exc}; pip install 'thaw-runtime[bench]')"
    from handlers.models.chat import ChatLM

    config = json.loads((bundle / "bundle.json").read_text())["config"]
    weights = load_file(str(bundle / "model.safetensors"))
    lm = ChatLM(config, weights, bundle / "tokenizer.json", "cpu")  # its tokenizer and stops
    hf = LlamaConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_layers"],
        num_attention_heads=config["num_heads"],
        num_key_value_heads=config["num_kv_heads"],
        head_dim=config["head_dim"],
        rope_theta=config["rope_theta"],
        rms_norm_eps=config["rms_norm_eps"],
        tie_word_embeddings=True,
        max_position_embeddings=config["max_context_tokens"],
    )
    model = LlamaForCausalLM(hf)
    as_dtype = getattr(torch, dtype)
    model.load_state_dict({k: v.to(as_dtype) for k, v in weights.items()}, strict=False)
    model = model.to(as_dtype).eval()
    events = workload(seed)[:requests]
    ids = [
        lm.encode_prompt(e["prompt"])
        if "prompt" in e
        else lm.encode_chat([(m["role"], m["content"]) for m in e["messages"]])
        for e in events
    ]
    stops = sorted(lm.stop_ids)
    generation = GenerationConfig(
        do_sample=False, max_new_tokens=128, eos_token_id=stops, pad_token_id=stops[0]
    )
    try:
        with torch.inference_mode():
            manager = model.init_continuous_batching(generation_config=generation)
            manager.start()
            try:
                # One request of the same shape first: the manager's own set-up is not timed.
                manager.add_request(ids[0], max_new_tokens=2)
                manager.get_result(timeout=600)
                started = time.perf_counter()
                queue = list(zip(ids, events, strict=True))
                in_flight = 0
                tokens = 0
                while queue or in_flight:
                    while queue and in_flight < callers:
                        prompt, event = queue.pop(0)
                        manager.add_request(prompt, max_new_tokens=event["max_tokens"])
                        in_flight += 1
                    result = manager.get_result(timeout=600)
                    if result is None:
                        raise RuntimeError("its generation thread stopped")
                    if result.is_finished():
                        in_flight -= 1
                        tokens += len(result.generated_tokens)
                elapsed = time.perf_counter() - started
            finally:
                manager.stop(block=True, timeout=60)
    except Exception as exc:  # a CPU it cannot run on: say why, the run goes on
        return float("nan"), f"failed: {type(exc).__name__}: {exc}"[:200]
    return tokens / elapsed, f"{requests} requests, {tokens} tokens"


# ---- greedy identity, in this process ------------------------------------------------


def identity(bundle: Path, prompts: int, max_tokens: int, seed: int) -> int:
    """`prompts` greedy completions run in a batch that changes size at every step
    (two admitted, then one more per step, finished ones dropped; each new prompt
    prefilled on its own, as served) against each alone (the per-request loop):
    prints how many differ, and where."""
    from safetensors.torch import load_file

    from handlers.models.chat import ChatLM, Completion, TextSequence
    from handlers.models.llama import Sampling

    config = json.loads((bundle / "bundle.json").read_text())["config"]
    lm = ChatLM(
        config, load_file(str(bundle / "model.safetensors")), bundle / "tokenizer.json", "cpu"
    )
    rng = random.Random(seed)
    events = [rng.choice(PROMPTS) for _ in range(prompts)]
    ids = [
        lm.encode_prompt(f"{e['prompt']} ({i})")
        if "prompt" in e
        else lm.encode_chat([("user", f"{e['messages'][0]['content']} ({i})")])
        for i, e in enumerate(events)
    ]
    greedy = Sampling()
    started = time.perf_counter()
    alone = [lm.complete(p, max_tokens, greedy, []) for p in ids]
    alone_s = time.perf_counter() - started
    done: dict[int, Completion] = {}
    waiting = list(enumerate(ids))
    active: list[tuple[int, TextSequence]] = []
    admit, sizes = 2, []
    started = time.perf_counter()
    while waiting or active:
        for i, p in waiting[:admit]:
            sequence = lm.begin(p, max_tokens, greedy, [])
            lm.run_prompt(sequence)  # on its own, as the served path's prefill runs it
            active.append((i, sequence))
        waiting, admit = waiting[admit:], 1
        sizes.append(len(active))
        for (i, sequence), out in zip(active, lm.advance([s for _, s in active]), strict=True):
            if sequence.finished:
                done[i] = out[-1]  # type: ignore[assignment]
                sequence.release()
        active = [(i, s) for i, s in active if not s.finished]
    batched_s = time.perf_counter() - started
    differ = [i for i in range(prompts) if done[i] != alone[i]]
    tokens = sum(c.completion_tokens for c in alone)
    print(
        f"greedy identity: {prompts - len(differ)} of {prompts} completions identical "
        f"({tokens} tokens; prompts {min(map(len, ids))}-{max(map(len, ids))} tokens; batch "
        f"sizes {min(sizes)}-{max(sizes)}); alone {alone_s:.1f} s, batched {batched_s:.1f} s"
    )
    for i in differ:
        print(f"  prompt {i}: alone {alone[i].text!r}\n  batched {done[i].text!r}")
    return 1 if differ else 0


def step_costs(bundle: Path, threads: int) -> int:
    """One decode step of B sequences (`Llama.decode`, 64-token contexts) with `threads`
    intra-op threads: ms per step and tokens/s, B = 1, 2, 8, 16 (medians of 8 steps)."""
    import torch
    from safetensors.torch import load_file

    from handlers.models.llama import Llama, LlamaConfig

    torch.set_num_threads(threads)
    config = json.loads((bundle / "bundle.json").read_text())["config"]
    model = Llama(
        LlamaConfig.from_config(config), load_file(str(bundle / "model.safetensors")), "cpu"
    )
    with torch.inference_mode():
        for size in (1, 2, 8, 16):
            caches = [model.new_cache(128) for _ in range(size)]
            for cache in caches:
                model.prefill(torch.arange(1, 65), cache)
            times = []
            for _ in range(10):
                started = time.perf_counter()
                model.decode([5] * size, caches)
                times.append(time.perf_counter() - started)
            step_s = median(times[2:])
            print(
                f"threads {threads}, {size:2d} sequences: {step_s * 1000:7.1f} ms per step, "
                f"{size / step_s:6.1f} tokens/s",
                flush=True,
            )
    return 0


# ---- the run ------------------------------------------------------------------------


def build_bundle(bundles: Path) -> Path:
    if not (bundles / "smollm2" / "bundle.json").exists():
        progress(f"building the smollm2 bundle into {bundles} ...")
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "build_model_bundles.py"),
                "--out",
                str(bundles),
                "--only",
                "smollm2",
            ],
            check=True,
        )
    return bundles / "smollm2"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=30.0, help="seconds per measurement")
    parser.add_argument("--bundles", default=str(ROOT / "bundles"))
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--pairs", type=int, default=10, help="lone-caller request pairs")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of every window (orders alternate)"
    )
    parser.add_argument(
        "--ttft-prompts", type=int, default=20, help="lone-caller TTFT pairs over the workload"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op threads of the server and of transformers (OMP_NUM_THREADS; default: "
        "torch's, one per core)",
    )
    parser.add_argument(
        "--identity", type=int, metavar="N", help="only: N greedy prompts, batched vs alone"
    )
    parser.add_argument("--identity-tokens", type=int, default=64)
    parser.add_argument(
        "--steps", type=int, metavar="THREADS", help="only: decode step costs, B = 1-16"
    )
    args = parser.parse_args()
    bundle = build_bundle(Path(args.bundles))
    if args.identity:
        return identity(bundle, args.identity, args.identity_tokens, args.seed)
    if args.steps:
        return step_costs(bundle, args.steps)
    memory = json.loads((bundle / "bundle.json").read_text())["memory"]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, stopping([]) as procs:
        port = free_port()
        env = runtime_env(
            Path(tmp),
            bundle_source=str(bundle.parent),
            handlers="handlers.generate,bench.generation",
            prewarm="smollm2",
            # 16 sequences beside the weights; THAW_MAX_QUEUE past the callers.
            memory_budget=str(memory["weights_bytes"] + 17 * memory["per_request_bytes"]),
            log_level="WARNING",
        )
        if args.threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
        server = Proc(thaw_serve_argv(port), env, port, Path(tmp) / "server.log")
        procs.append(server)
        server.start()
        server.wait_healthy(120)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(6000):
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            else:
                raise RuntimeError("the server never became ready")
        progress(f"a lone caller, {args.pairs} pairs ...")
        lone = asyncio.run(lone_pairs(url, args.pairs))
        progress(f"a lone caller's first token, {args.ttft_prompts} workload prompts ...")
        first = asyncio.run(lone_ttfts(url, args.seed, args.ttft_prompts))
        plan: list[tuple[str, int]] = [
            ("generate_private", 1),
            ("generate", 1),
            ("generate_private", 8),
            ("generate", 8),
            ("generate_private", 16),
            ("generate", 16),
        ]
        results: dict[tuple[str, int], list[Window]] = {}
        runs: dict[tuple[int, str], list[tuple[float, str]]] = {}
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)  # transformers, in this process
        for round_ in range(args.rounds):
            # Rounds alternate the order, so a load that rises or falls during the
            # run weighs on both handlers (and on transformers) alike.
            for handler, callers in plan if round_ % 2 == 0 else plan[::-1]:
                progress(f"[{round_ + 1}/{args.rounds}] {handler} x{callers} for {args.window:g} s")
                window = asyncio.run(measure(url, handler, callers, args.window, args.seed))
                results.setdefault((handler, callers), []).append(window)
                progress(
                    f"  {window.tokens_per_s:.1f} tokens/s, {window.requests} requests, "
                    f"TTFT p50 {fmt_s(median(window.ttft_s))}"
                )
            if not args.skip_transformers:
                peers = [(c, d) for c in (8, 16) for d in TRANSFORMERS_DTYPES]
                for callers, dtype in peers if round_ % 2 == 0 else peers[::-1]:
                    progress(
                        f"[{round_ + 1}/{args.rounds}] transformers ({dtype}), {callers} in flight"
                    )
                    run = transformers_tokens_per_s(bundle, callers, 3 * callers, args.seed, dtype)
                    runs.setdefault((callers, dtype), []).append(run)
                    progress(f"  {run}")
    peer: dict[tuple[int, str], tuple[float, str]] = {
        key: (
            median([rate for rate, _ in done]),
            f"{done[0][1]}" + (f"; median of {len(done)} rounds" if len(done) > 1 else ""),
        )
        for key, done in sorted(runs.items())
    }
    load_after = os.getloadavg()
    print(render(rows(results, peer, lone, first)))
    print(
        f"\nload average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"{os.cpu_count()} CPUs; {args.rounds} x window {args.window:g} s; intra-op threads "
        f"{args.threads or 'default'}"
    )
    return 0


def rows(
    results: dict[tuple[str, int], list[Window]],
    peer: dict[tuple[int, str], tuple[float, str]],
    lone: list[tuple[dict[str, float], dict[str, float]]],
    first: list[tuple[float, float]],
) -> list[Row]:
    def rate(handler: str, callers: int) -> float:
        return median([w.tokens_per_s for w in results[(handler, callers)]])

    def pooled(handler: str, callers: int, what: str) -> list[float]:
        return [x for w in results[(handler, callers)] for x in getattr(w, what)]

    out: list[Row] = []
    for callers in (8, 16):
        thaw, today = rate("generate", callers), rate("generate_private", callers)
        ratio = thaw / today
        target = THROUGHPUT_TARGET if callers == 8 else None
        out.append(
            Row(
                f"tokens/s, {callers} streaming callers (vs today's per-request generation)",
                f"{thaw:.1f}",
                f"{today:.1f}",
                fmt_x(ratio),
                f">= {target:g}x" if target else "—",
                verdict(ratio >= target) if target else "info",
            )
        )
    # A lone caller's TTFT on the same prompt mix: the pairs, one request at a time.
    lone_ttft = median([t for t, _ in first])
    for callers in (8, 16):
        ttft = median(pooled("generate", callers, "ttft_s"))
        ratio = ttft / lone_ttft
        out.append(
            Row(
                f"TTFT p50, {callers} callers (vs a lone caller's, the same prompts one at a "
                f"time; today at {callers}: "
                f"{fmt_s(median(pooled('generate_private', callers, 'ttft_s')))})",
                fmt_s(ttft),
                fmt_s(lone_ttft),
                fmt_x(ratio),
                f"<= {TTFT_TARGET:g}x" if callers == 8 else "—",
                verdict(ratio <= TTFT_TARGET) if callers == 8 else "info",
            )
        )
    for callers in (8, 16):
        out.append(
            Row(
                f"inter-token p99, {callers} callers (vs today's)",
                fmt_s(percentile(pooled("generate", callers, "gaps_s"), 99)),
                fmt_s(percentile(pooled("generate_private", callers, "gaps_s"), 99)),
            )
        )
    for what, label, better_high in (
        ("tokens_per_s", "tokens/s", True),
        ("ttft_s", "TTFT", False),
    ):
        ratios = [t[what] / p[what] for t, p in lone]
        ratio = median(ratios)
        ok = ratio >= 1 / LONE_TARGET if better_high else ratio <= LONE_TARGET
        out.append(
            Row(
                f"{label}, a lone caller, median of {len(lone)} alternating pairs (vs today; "
                f"pair ratios {min(ratios):.2f}-{max(ratios):.2f})",
                fmt_s(median([t[what] for t, _ in lone]))
                if what == "ttft_s"
                else f"{median([t[what] for t, _ in lone]):.2f}",
                fmt_s(median([p[what] for _, p in lone]))
                if what == "ttft_s"
                else f"{median([p[what] for _, p in lone]):.2f}",
                fmt_x(ratio),
                f">= {1 / LONE_TARGET:.2f}x" if better_high else f"<= {LONE_TARGET:g}x",
                verdict(ok),
            )
        )
    ratios = [t / p for t, p in first]
    out.append(
        Row(
            f"TTFT, a lone caller, the workload's prompts, median of {len(first)} alternating "
            f"pairs (vs today; pair ratios {min(ratios):.2f}-{max(ratios):.2f})",
            fmt_s(lone_ttft),
            fmt_s(median([p for _, p in first])),
            fmt_x(median(ratios)),
            f"<= {LONE_TARGET:g}x",
            verdict(median(ratios) <= LONE_TARGET),
        )
    )
    for (callers, dtype), (tokens_per_s, note) in peer.items():
        thaw = rate("generate", callers)
        ok = tokens_per_s == tokens_per_s  # not NaN
        out.append(
            Row(
                f"tokens/s, {callers} in flight vs transformers continuous batching, its "
                f"model in {dtype} ({note})",
                f"{thaw:.1f}",
                f"{tokens_per_s:.1f}" if ok else "n/a",
                fmt_x(thaw / tokens_per_s) if ok else "n/a",
                f">= {PEER_TARGET:g}x" if callers == 8 else "—",
                (verdict(thaw / tokens_per_s >= PEER_TARGET) if ok else "skipped")
                if callers == 8
                else "info",
            )
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
