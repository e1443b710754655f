"""The GPU check (issue 29, part 3): load, unload, first request, throughput, peak memory.

    .venv/bin/python bench/gpu.py [--bundles bundles] [--no-build] [--out FILE]
    .venv/bin/python bench/gpu.py --smoke      # every code path on the CPU, tiny sizes

One command, one table, every figure measured in real `thaw serve` processes
on 127.0.0.1 (bench/common.py): 78-108 s on one H200 (BENCHMARKS.md).
Where CUDA is absent it prints one line saying so and exits 0.

- Load: Thaw's load phase (`phase_ms.load` in `GET /models`: the shards read
  to the device through safetensors) in GB/s, against a pinned host-to-device
  copy of the same bytes in this process (`torch.empty(..., pin_memory=True)`,
  then `.to("cuda", non_blocking=True)` and a synchronize; median of 5), for
  the largest shipped bundle (`smollm2`) and a synthetic 2 GiB one written
  here with the bundle tools (`build_bundle`, what `thaw bundle build` runs).
- Unload: `gpu-synthetic` loaded and `DELETE /models/gpu-synthetic`ed 10
  times; after each DELETE the server's allocator (`memory_allocated`,
  `memory_reserved`) and the driver (`mem_get_info`) are read inside the
  server process (bench/fixtures.py's `device_memory` handler).
- First request after READY against steady state (every timed request after
  `idle_s` idle), per shipped handler, in a fresh process each, with the
  accelerator warm-up the handler declares (what it saves on a device:
  docs/decisions/0009-accelerator-warm-up.md).
- Throughput: batched `embed` at 32 keep-alive clients against one, and
  `generate` tokens/s at 8 concurrent callers against one.
- Peak device memory of each handler's largest request
  (`max_memory_allocated` after `reset_peak_memory_stats`, over what was
  allocated before it) against the memory plan's `per_request_bytes`.

`--smoke` runs the same code on the CPU with tiny sizes (an 8 MiB synthetic
bundle, a few requests); device memory is then the server's resident memory
(VmRSS/VmHWM), marked "RSS", the pinned copy is a plain host copy, and no row
has a verdict. Rows of a shipped bundle whose package is not installed say
"skipped".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    Conn,
    Proc,
    Row,
    fmt_bw,
    fmt_s,
    fmt_x,
    free_port,
    median,
    percentile,
    render,
    request,
    runtime_env,
    thaw_serve_argv,
)

GIB = 1024**3
MIB = 1024**2
SYNTHETIC = "gpu-synthetic"
BUNDLES = {"embed": "minilm", "classify": "efficientnet", "generate": "smollm2"}
FIRST_TARGET = 1.1  # first / steady with the accelerator warm-up (bench/warmup.py's)
# Unload: the allocator gives back every byte; the driver's free memory after
# the 10th unload within a few of the CUDA allocator's 2 MiB pages of the 1st.
ALLOCATED_SLACK = 1 * MIB
DRIVER_GROWTH_SLACK = 16 * MIB
SENTENCE = "A man is riding a white horse on an enclosed ground."
THROUGHPUT = {
    "embed": "`embed` batched, {plan.embed_clients} keep-alive clients: requests/s",
    "generate": "`generate`, {plan.generate_callers} concurrent callers",
}
STORY = "Write a long story about a lighthouse keeper and a storm."


# ---- one `thaw serve` process, and what the check asks of it over HTTP ----

LOAD_TIMEOUT_S = 300.0
POLL_S = 0.01


def load_average() -> float:
    return os.getloadavg()[0]


def driver_used_bytes(pid: int) -> int | None:
    """Device memory the driver accounts to process `pid` (nvidia-smi), or None where
    nvidia-smi is absent or does not list it (no device; another PID namespace)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    done = subprocess.run([exe, *query], capture_output=True, text=True, timeout=60)
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        found, _, used_mib = line.partition(",")
        if found.strip() == str(pid):
            return int(used_mib.strip()) * 1024 * 1024
    return None


@dataclass
class Loop:
    """A closed loop's outcome: each client sent its next request when its answer came."""

    seconds: float
    latencies: list[float] = field(default_factory=list)
    completion_tokens: int = 0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds

    @property
    def tokens_rate(self) -> float:
        return self.completion_tokens / self.seconds


class Server:
    """`thaw serve` on a free port, serving `modules` from `source` on `device`; its
    log is `node/{name}.log`."""

    def __init__(self, node: Path, name: str, source: Path, modules: str, device: str) -> None:
        self.device = device
        self.port = free_port()
        # One node for every server of a run, one after another (as restarts on one
        # machine): its cache and stamps spare each later start the files' hashing.
        env = runtime_env(
            node,
            HANDLERS=modules,
            BUNDLE_SOURCE=str(source),
            DEVICE=device,
            # Every answer is awaited: the largest requests must not become jobs.
            WAIT_S="600",
            MAX_WAIT_S="600",
        )
        self.proc = Proc(thaw_serve_argv(self.port), env, self.port, node / f"{name}.log")

    async def __aenter__(self) -> Server:
        self.proc.start()
        await asyncio.to_thread(self.proc.wait_healthy, 120.0)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.proc.stop)

    @property
    def pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid

    async def driver_used(self) -> int | None:
        """What nvidia-smi says this server holds on the device (None: it cannot say)."""
        return await asyncio.to_thread(driver_used_bytes, self.pid)

    def _fail(self, what: str) -> RuntimeError:
        return RuntimeError(f"{what}\n--- server log ---\n{self.proc.log()}")

    async def invoke(self, handler: str, event: Any) -> tuple[float, Any]:
        """(seconds from before the connect to the last byte, output) of one invocation."""
        reply = await request(self.port, "POST", f"/invoke/{handler}", orjson.dumps(event))
        if reply.status != 200:
            raise self._fail(f"{handler}: {reply.status} {reply.body[:500]!r}")
        return reply.wall_s, orjson.loads(reply.body)

    async def view(self, bundle: str) -> dict[str, Any]:
        reply = await request(self.port, "GET", "/models")
        models = orjson.loads(reply.body)["models"]
        found: dict[str, Any] = next(m for m in models if m["name"] == bundle)
        return found

    async def load(self, bundle: str) -> dict[str, Any]:
        """Ask for a load (`POST /models/{bundle}/load`) and wait until it is READY."""
        reply = await request(self.port, "POST", f"/models/{bundle}/load")
        if reply.status != 202:
            raise self._fail(f"load {bundle}: {reply.status} {reply.body[:500]!r}")
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            view = await self.view(bundle)
            if view["state"] == "ready":
                return view
            if view["state"] == "failed":
                raise self._fail(f"load {bundle} failed: {view['error']}")
            await asyncio.sleep(POLL_S)
        raise self._fail(f"{bundle} not ready after {LOAD_TIMEOUT_S} s")

    async def unload(self, bundle: str) -> None:
        """`DELETE /models/{bundle}`: answers once the memory was released."""
        reply = await request(self.port, "DELETE", f"/models/{bundle}")
        if reply.status != 200:
            raise self._fail(f"unload {bundle}: {reply.status} {reply.body[:500]!r}")

    async def memory(self, *, reset_peak: bool = False) -> dict[str, Any]:
        """The server process's device memory (bench/fixtures.py's probe), in bytes."""
        event = {"device": self.device, "reset_peak": reset_peak}
        figures: dict[str, Any] = (await self.invoke("device_memory", event))[1]
        return figures

    async def closed_loop(self, handler: str, event: Any, clients: int, each: int) -> Loop:
        """`clients` keep-alive connections, `each` requests apiece, back to back."""
        body = orjson.dumps(event)
        conns = [await Conn(self.port).open() for _ in range(clients)]
        loop = Loop(0.0)

        async def client(conn: Conn) -> None:
            for _ in range(each):
                reply = await conn.request("POST", f"/invoke/{handler}", body)
                if reply.status != 200:
                    raise self._fail(f"{handler}: {reply.status} {reply.body[:500]!r}")
                loop.latencies.append(reply.wall_s)
                usage = orjson.loads(reply.body).get("usage") if handler == "generate" else None
                if usage:
                    loop.completion_tokens += int(usage["completion_tokens"])

        started = time.perf_counter()
        try:
            await asyncio.gather(*(client(c) for c in conns))
        finally:
            loop.seconds = time.perf_counter() - started
            for conn in conns:
                await conn.close()
        return loop


@dataclass(frozen=True)
class Plan:
    """How much of everything one run measures."""

    smoke: bool
    device: str
    synthetic_bytes: int
    synthetic_shards: int
    unload_cycles: int
    smollm2_loads: int
    steady_runs: int
    idle_s: float
    copy_repeats: int
    embed_clients: int
    embed_requests: int  # per client
    generate_callers: int
    generate_tokens: int


def plan_for(smoke: bool) -> Plan:
    if smoke:
        return Plan(True, "cpu", 8 * MIB, 2, 3, 1, 2, 0.05, 2, 32, 1, 8, 2)
    return Plan(False, "cuda", 2 * GIB, 4, 10, 3, 5, 0.2, 5, 32, 20, 8, 128)


def cuda_missing() -> str | None:
    """Why this machine cannot run the check, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"no CUDA device (torch {torch.__version__} is a CPU-only build)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def skipped_without_cuda(script: str, smoke: bool) -> bool:
    """Unless `smoke`, where this machine cannot run a GPU check: one line saying why
    (the check then exits 0), and True."""
    missing = None if smoke else cuda_missing()
    if missing is not None:
        print(f"{script}: skipped: {missing}; `--smoke` runs its code on the CPU")
    return missing is not None


def share(part: float, whole: float) -> float | None:
    """part / whole, or None (shown as —) where there is no whole."""
    return part / whole if whole else None


_STARTED = time.monotonic()


def progress(message: str) -> None:
    print(f"[gpu {time.monotonic() - _STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


def fmt_bytes(n: float, *, signed: bool = True) -> str:
    """Bytes in the unit that reads best; with `signed`, a change (+/-)."""
    sign = ("-" if n < 0 else "+") if signed else ""
    n = abs(n)
    if n >= GIB:
        return f"{sign}{n / GIB:.2f} GiB"
    if n >= MIB:
        return f"{sign}{n / MIB:.1f} MiB"
    return f"{sign}{n / 1024:.0f} KiB" if n >= 1024 else f"{sign}{n:.0f} B"


class Table:
    """The rows of one run; in a smoke run no row passes or fails."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.rows: list[Row] = []
        self.unit = "RSS, smoke" if plan.smoke else "device"

    def add(
        self,
        measurement: str,
        thaw: str,
        baseline: str = "—",
        ratio: float | None = None,
        target: str = "—",
        ok: bool | None = None,
    ) -> None:
        if self.plan.smoke:
            verdict = "smoke"
        elif ok is None:
            verdict = "info"
        else:
            verdict = "pass" if ok else "FAIL"
        shown = "—" if ratio is None else fmt_x(ratio)
        self.rows.append(Row(measurement, thaw, baseline, shown, target, verdict))
        progress(f"{measurement}: {thaw} ({baseline})")

    def skip(self, measurement: str, why: str) -> None:
        self.rows.append(Row(measurement, why, verdict="skipped"))
        progress(f"{measurement}: skipped ({why})")


# ---- bundles ------------------------------------------------------------------


def write_synthetic(source: Path, plan: Plan) -> list[Path]:
    """`gpu-synthetic`: `plan.synthetic_bytes` of fp16 safetensors in equal shards."""
    import torch
    from safetensors.torch import save_file

    from runtime.bundles.manifest import build_bundle

    directory = source / SYNTHETIC
    directory.mkdir(parents=True)
    per_shard = plan.synthetic_bytes // plan.synthetic_shards
    for index in range(plan.synthetic_shards):
        tensor = torch.full((per_shard // 2,), float(index + 1), dtype=torch.float16)
        save_file({f"w{index}": tensor}, str(directory / f"shard-{index}.safetensors"))
        del tensor
    build_bundle(directory, SYNTHETIC, version="1")
    return sorted(directory.glob("*.safetensors"))


def shipped_bundles(source: Path, bundles: Path) -> set[str]:
    """Copy the built shipped bundles into the servers' source directory (beside the
    synthetic one; a bundle file may not be a hard link)."""
    present: set[str] = set()
    for name in BUNDLES.values():
        built = bundles / name
        if (built / "bundle.json").exists():
            shutil.copytree(built, source / name)
            present.add(name)
    return present


def safetensors_of(directory: Path) -> list[Path]:
    return sorted(directory.glob("**/*.safetensors"))


def host_copy_bps(files: list[Path], plan: Plan) -> float:
    """Bytes/s of one copy of the files' bytes from pinned host memory to the device
    (on the CPU: a plain host copy), median of `plan.copy_repeats`."""
    import torch

    total = sum(f.stat().st_size for f in files)
    cuda = plan.device == "cuda"
    host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    view = memoryview(host.numpy().data)
    offset = 0
    for f in files:
        with open(f, "rb") as stream:
            offset += stream.readinto(view[offset:])
    seconds = []
    for _ in range(plan.copy_repeats):
        started = time.perf_counter()
        if cuda:
            copy = host.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
        else:
            copy = host.clone()
        seconds.append(time.perf_counter() - started)
        del copy
    del view, host
    if cuda:
        torch.cuda.empty_cache()
    return total / median(seconds)


# ---- measurements -------------------------------------------------------------


async def load_and_unload(table: Table, tmp: Path, source: Path, present: set[str]) -> None:
    plan = table.plan
    synthetic_files = safetensors_of(source / SYNTHETIC)
    synthetic_total = sum(f.stat().st_size for f in synthetic_files)
    smollm2 = "smollm2" in present
    copies = {SYNTHETIC: host_copy_bps(synthetic_files, plan)}
    if smollm2:
        copies["smollm2"] = host_copy_bps(safetensors_of(source / "smollm2"), plan)
    modules = "bench.fixtures" + (",handlers.generate" if smollm2 else "")
    async with Server(tmp / "node", "memory", source, modules, plan.device) as server:
        before = await server.memory()
        load_ms: list[float] = []
        loaded: list[dict[str, Any]] = []
        after: list[dict[str, Any]] = []
        smi: list[int | None] = []  # nvidia-smi's figure for the server's pid
        for cycle in range(plan.unload_cycles):
            view = await server.load(SYNTHETIC)
            load_ms.append(view["phase_ms"]["load"])
            loaded.append(await server.memory())
            if cycle == 0:
                held = (await server.invoke("synthetic_bytes", {}))[1]
                progress(f"synthetic bundle held: {held}")
            await server.unload(SYNTHETIC)
            after.append(await server.memory())
            smi.append(await server.driver_used())
        smollm2_ms: list[float] = []
        for _ in range(plan.smollm2_loads if smollm2 else 0):
            smollm2_ms.append((await server.load("smollm2"))["phase_ms"]["load"])
            await server.unload("smollm2")
    label = "host copy" if plan.smoke else "pinned host->device copy"
    size = fmt_bytes(synthetic_total, signed=False)
    what = f"synthetic {size}, {len(synthetic_files)} shards"
    bps = synthetic_total / (median(load_ms) / 1000)
    table.add(
        f"load to {plan.device}, {what}: Thaw's load phase (median of {len(load_ms)} loads)",
        f"{fmt_bw(bps)} ({median(load_ms):.1f} ms)",
        f"{fmt_bw(copies[SYNTHETIC])} {label}",
        bps / copies[SYNTHETIC],
    )
    if smollm2:
        total = sum(f.stat().st_size for f in safetensors_of(source / "smollm2"))
        bps = total / (median(smollm2_ms) / 1000)
        table.add(
            f"load to {plan.device}, smollm2 {fmt_bytes(total, signed=False)} (largest shipped "
            "bundle): "
            f"Thaw's load phase (median of {len(smollm2_ms)} loads)",
            f"{fmt_bw(bps)} ({median(smollm2_ms):.1f} ms)",
            f"{fmt_bw(copies['smollm2'])} {label}",
            bps / copies["smollm2"],
        )
    else:
        table.skip(f"load to {plan.device}, smollm2 (largest shipped bundle)", "no bundle")
    unit, n = table.unit, plan.unload_cycles
    grown = [a["allocated"] - before["allocated"] for a in after]
    held_bytes = median([m["allocated"] - before["allocated"] for m in loaded])
    table.add(
        f"unload x{n} ({SYNTHETIC}): allocated after each DELETE vs before the first load ({unit})",
        f"worst {fmt_bytes(max(grown))}, last {fmt_bytes(grown[-1])}",
        f"{fmt_bytes(held_bytes)} while loaded",
        None,
        f"<= {fmt_bytes(ALLOCATED_SLACK, signed=False)}",
        max(grown) <= ALLOCATED_SLACK,
    )
    reserved = [a["reserved"] - before["reserved"] for a in after]
    held_reserved = median([m["reserved"] - before["reserved"] for m in loaded])
    table.add(
        f"unload x{n}: reserved by the caching allocator after each DELETE (returned to "
        f"the driver) vs before the first load ({unit})",
        f"worst {fmt_bytes(max(reserved))}",
        f"{fmt_bytes(held_reserved)} while loaded",
        None,
        f"<= {fmt_bytes(ALLOCATED_SLACK, signed=False)}",
        max(reserved) <= ALLOCATED_SLACK,
    )
    used = [before["free"] - a["free"] for a in after]  # driver: more used = less free
    by_pid = ""
    if smi[0] is not None and smi[-1] is not None:
        by_pid = f"; nvidia-smi, server pid: {smi[0] / MIB:.0f} -> {smi[-1] / MIB:.0f} MiB"
    table.add(
        f"unload x{n}: driver's used memory (mem_get_info) after DELETE 1 and {n}, vs before "
        f"the first load ({'MemAvailable, smoke' if plan.smoke else 'device-wide'})",
        f"{fmt_bytes(used[0])} -> {fmt_bytes(used[-1])}{by_pid}",
        f"{fmt_bytes(median([before['free'] - m['free'] for m in loaded]))} while loaded",
        None,
        f"growth <= {fmt_bytes(DRIVER_GROWTH_SLACK, signed=False)}",
        used[-1] - used[0] <= DRIVER_GROWTH_SLACK,
    )


def first_event(handler: str) -> Any:
    from bench.firstanswer import event_for

    return event_for(handler)


def largest_event(handler: str, smoke: bool) -> Any:
    """The largest request each handler accepts (tests/pretrained/test_memory_plan.py's);
    tiny ones in a smoke run."""
    if handler == "embed":
        from handlers.embed import _LONG_TEXT, MAX_TEXTS

        return {"texts": [_LONG_TEXT] * (2 if smoke else MAX_TEXTS)}
    if handler == "classify":
        from handlers.classify import MAX_IMAGE_PIXELS, _png_base64

        side = 64 if smoke else int(MAX_IMAGE_PIXELS**0.5)
        return {"image": _png_base64(side, side, 2, b"\x20\x80\xc0")}
    from handlers.generate import MAX_CONTEXT_TOKENS

    return {"prompt": "word " * (20 if smoke else MAX_CONTEXT_TOKENS - 100), "max_tokens": 8}


async def first_and_steady(server: Server, handler: str, plan: Plan) -> tuple[float, list[float]]:
    event = first_event(handler)
    times: list[float] = []
    for _ in range(1 + plan.steady_runs):
        await asyncio.sleep(plan.idle_s)
        times.append((await server.invoke(handler, event))[0])
    return times[0], times[1:]


async def peak_memory(table: Table, server: Server, handler: str, declared: int) -> None:
    before = await server.memory(reset_peak=True)
    await server.invoke(handler, largest_event(handler, table.plan.smoke))
    peak = (await server.memory())["peak"] - before["allocated"]
    table.add(
        f"peak {table.unit} memory of the largest `{handler}` request over what was held "
        f"before it, vs the plan's per_request_bytes",
        fmt_bytes(peak),
        f"{fmt_bytes(declared, signed=False)} declared",
        share(peak, declared),
        "<= 1.00x",
        peak <= declared,
    )


async def embed_throughput(table: Table, server: Server) -> None:
    plan = table.plan
    event = {"texts": [SENTENCE]}
    one = await server.closed_loop("embed", event, 1, plan.embed_requests * 4)
    many = await server.closed_loop("embed", event, plan.embed_clients, plan.embed_requests)
    table.add(
        THROUGHPUT["embed"].format(plan=plan) + f" (p99 {fmt_s(percentile(many.latencies, 99))})",
        f"{many.rate:.0f}",
        f"{one.rate:.0f} at 1 client",
        share(many.rate, one.rate),
    )


async def generate_throughput(table: Table, server: Server) -> None:
    plan = table.plan
    event = {"messages": [{"role": "user", "content": STORY}], "max_tokens": plan.generate_tokens}
    one = await server.closed_loop("generate", event, 1, 1)
    many = await server.closed_loop("generate", event, plan.generate_callers, 1)
    table.add(
        THROUGHPUT["generate"].format(plan=plan) + f", {plan.generate_tokens} tokens "
        f"each: completion tokens/s, all callers",
        f"{many.tokens_rate:.1f}",
        f"{one.tokens_rate:.1f} at 1 caller",
        share(many.tokens_rate, one.tokens_rate),
    )


async def per_handler(table: Table, tmp: Path, source: Path, present: set[str]) -> None:
    plan = table.plan
    for handler, bundle_name in BUNDLES.items():
        if bundle_name not in present:
            why = f"no {bundle_name} bundle (its package is not installed)"
            table.skip(f"`{handler}` first request after READY, accelerator warm-up on", why)
            table.skip(f"peak {table.unit} memory of the largest `{handler}` request", why)
            if handler in THROUGHPUT:
                table.skip(THROUGHPUT[handler].format(plan=plan), why)
            continue
        modules = f"handlers.{handler},bench.fixtures"
        async with Server(tmp / "node", handler, source, modules, plan.device) as server:
            view = await server.load(bundle_name)
            first, steady = await first_and_steady(server, handler, plan)
            warmup_s = view["phase_ms"].get("warmup", 0.0) / 1000
            table.add(
                f"`{handler}` first request after READY vs steady (median of {len(steady)}), "
                f"accelerator warm-up on; warm-up {warmup_s:.2f} s at load",
                fmt_s(first),
                fmt_s(median(steady)),
                first / median(steady),
                f"<= {FIRST_TARGET}x",
                first / median(steady) <= FIRST_TARGET,
            )
            await peak_memory(table, server, handler, view["memory"]["per_request_bytes"])
            if handler == "embed":
                await embed_throughput(table, server)
            elif handler == "generate":
                await generate_throughput(table, server)


def build_shipped(bundles: Path) -> None:
    build = [sys.executable, str(ROOT / "scripts" / "build_model_bundles.py")]
    names = ",".join(BUNDLES.values())
    subprocess.run([*build, "--out", str(bundles), "--only", names], check=True, stdout=sys.stderr)


async def run(plan: Plan, bundles: Path) -> list[Row]:
    table = Table(plan)
    with tempfile.TemporaryDirectory(prefix="thaw-gpu-") as name:
        tmp = Path(name)
        source = tmp / "bundles"
        source.mkdir()
        present = shipped_bundles(source, bundles)
        progress(f"shipped bundles: {sorted(present) or 'none'}; writing {SYNTHETIC}")
        write_synthetic(source, plan)
        await load_and_unload(table, tmp, source, present)
        await per_handler(table, tmp, source, present)
    return table.rows


def describe_machine(plan: Plan) -> str:
    import torch

    device = torch.cuda.get_device_name() if plan.device == "cuda" else "CPU (smoke)"
    return f"{device}, torch {torch.__version__}, {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every path on the CPU, tiny sizes")
    parser.add_argument("--bundles", default=str(ROOT / "bundles"), help="built shipped bundles")
    parser.add_argument("--no-build", action="store_true", help="use --bundles as they are")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    if skipped_without_cuda("bench/gpu.py", args.smoke):
        return 0
    plan = plan_for(args.smoke)
    started, load = time.monotonic(), load_average()
    if not args.no_build:
        build_shipped(Path(args.bundles))
    rows = asyncio.run(run(plan, Path(args.bundles)))
    table = render(rows)
    print(table)
    print(
        f"\n{describe_machine(plan)}; load average {load:.1f} at start; "
        f"took {time.monotonic() - started:.0f} s."
    )
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
