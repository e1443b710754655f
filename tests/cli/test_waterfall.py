"""The cold-start waterfall (runtime/cli/waterfall.py), drawn by a real browser.

The SVG and the HTML page are rendered by Debian's chromium, headless, into a
PNG; Pillow then finds each bar by its colour. What is checked is what a person
reads off the picture: every phase that was paid is there, the bars follow one
another in the order a cold request passes them, each on its own row below the
last, and their widths are proportional to their times (one px/ms scale).
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from runtime.cli.waterfall import BARE_PHASES, THAW_PHASES, bars, svg, tick_step, write
from tests.support import SAFETY_S

Image = pytest.importorskip("PIL.Image", reason="Pillow (the models extra) reads the screenshots")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (apt-get install -y chromium; .ci/run does)"
)

# Known times, each wide enough to measure in pixels, none equal to another.
RESULT: dict[str, Any] = {
    "handler": "embed",
    "spawn_ms": 40.0,
    "process_start_to_healthy_ms": 340.0,
    "first_invocation_ms": 1500.0,
    "process_start_to_first_answer_ms": 1840.0,
    "phases_ms": {
        "queue": 60.0,
        "fetch": 120.0,
        "load": 420.0,
        "init": 180.0,
        "warmup": 260.0,
        "run": 220.0,
    },
    "phases_absent": [],
    "batch_ms": 90.0,
    "bare": {
        "first_answer_ms": 1200.0,
        "import_ms": 520.0,
        "load_ms": 310.0,
        "build_ms": 150.0,
        "run_ms": 120.0,
    },
    "repeat": 1,
    "ratio": 1.53,
}
THAW_MS = {
    "spawn": 40.0,
    "healthz": 300.0,
    "fetch": 120.0,
    "load": 420.0,
    "init": 180.0,
    "warmup": 260.0,
    "queue": 60.0,
    "batch": 90.0,
    "run": 220.0,
    "rest": 150.0,  # 1500 - (120 + 420 + 180 + 260 + 60 + 90 + 220)
}
BARE_MS = {"start": 100.0, "import_ms": 520.0, "load_ms": 310.0, "build_ms": 150.0, "run_ms": 120.0}


def _rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def screenshot(page: Path, tmp_path: Path, size: str = "1000,900") -> Any:
    png = tmp_path / f"{page.name}.png"
    done = subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",  # tests may run as root, which chromium's sandbox refuses
            "--disable-gpu",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            f"--window-size={size}",
            f"--screenshot={png}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=SAFETY_S,
        check=False,
    )
    assert done.returncode == 0 and png.is_file(), done.stderr.decode(errors="replace")[-2000:]
    return Image.open(png).convert("RGB")


def boxes(image: Any, colours: dict[str, str]) -> dict[str, tuple[int, int, int, int]]:
    """Each colour's bounding box (left, top, right, bottom; right/bottom exclusive)."""
    wanted = {_rgb(c): name for name, c in colours.items()}
    found: dict[str, list[int]] = {}
    width, height = image.size
    pixels = image.load()
    for y in range(height):
        for x in range(width):
            name = wanted.get(pixels[x, y])
            if name is None:
                continue
            box = found.setdefault(name, [x, y, x + 1, y + 1])
            box[0], box[1] = min(box[0], x), min(box[1], y)
            box[2], box[3] = max(box[2], x + 1), max(box[3], y + 1)
    return {name: (b[0], b[1], b[2], b[3]) for name, b in found.items()}


def check_lane(
    found: dict[str, tuple[int, int, int, int]], order: list[str], ms: dict[str, float]
) -> float:
    """In order, each on the row below the last, starting where the last ended, its
    width proportional to its time; returns the scale (px per ms)."""
    assert [name for name in order if name not in found] == [], found
    lefts = [found[name][0] for name in order]
    tops = [found[name][1] for name in order]
    assert lefts == sorted(lefts) and tops == sorted(set(tops)), (lefts, tops)
    for before, after in itertools.pairwise(order):
        assert abs(found[after][0] - found[before][2]) <= 1, (before, after, found)
    scales = [(found[n][2] - found[n][0]) / ms[n] for n in order]
    scale = sum(scales) / len(scales)
    for name in order:
        width = found[name][2] - found[name][0]
        # Rounding an edge to a pixel moves each end by at most one.
        assert abs(width - ms[name] * scale) <= 2, (name, width, ms[name] * scale)
    return scale


@pytest.mark.process
@needs_chromium
@pytest.mark.parametrize("suffix", ["svg", "html"])
def test_the_browser_draws_each_phase_in_order_and_to_scale(tmp_path: Path, suffix: str) -> None:
    written = dict(zip(("svg", "html"), write(RESULT, tmp_path / "cold"), strict=True))
    image = screenshot(written[suffix], tmp_path)
    thaw_colours = {key: colour for key, _, colour in THAW_PHASES}
    bare_colours = {key: colour for key, _, colour in BARE_PHASES}
    found = boxes(image, {**thaw_colours, **bare_colours})
    thaw_scale = check_lane(found, [k for k, _, _ in THAW_PHASES], THAW_MS)
    bare_scale = check_lane(found, [k for k, _, _ in BARE_PHASES], BARE_MS)
    # One time axis: the same scale for both runs, both starting at its zero.
    assert abs(thaw_scale - bare_scale) / thaw_scale < 0.01
    assert found["spawn"][0] == found["start"][0]
    # The bare run is drawn below the whole of the Thaw run.
    assert found["start"][1] > found["rest"][3]


@pytest.mark.process
@needs_chromium
def test_a_phase_not_paid_has_no_bar(tmp_path: Path) -> None:
    result = {
        **RESULT,
        "phases_ms": {**RESULT["phases_ms"], "fetch": 0.0, "load": 0.0, "init": 0.0, "warmup": 0},
        "phases_absent": ["fetch", "load", "init", "warmup"],
        "batch_ms": None,
    }
    result.pop("bare")
    svg_path, _ = write(result, tmp_path / "echo.svg")
    assert svg_path == tmp_path / "echo.svg"
    found = boxes(screenshot(svg_path, tmp_path), {k: c for k, _, c in THAW_PHASES})
    assert set(found) == {"spawn", "healthz", "queue", "run", "rest"}
    # What fetch, load, init, warm-up and batch did not take is not added to the rest.
    ms = {**THAW_MS, "rest": 1500.0 - 60.0 - 220.0}
    check_lane(found, ["spawn", "healthz", "queue", "run", "rest"], ms)
    assert svg_path.read_text().count("not paid") == 5


def test_bars_start_where_the_last_ended_on_one_axis() -> None:
    drawn = bars(RESULT)
    thaw = [b for b in drawn if b.lane == "thaw serve"]
    assert [b.phase for b in thaw] == list(THAW_MS)
    assert [b.duration_ms for b in thaw] == list(THAW_MS.values())
    for before, after in itertools.pairwise(thaw):
        assert after.start_ms == pytest.approx(before.start_ms + before.duration_ms)
    # The Thaw lane ends at the client's first answer, measured from the spawn.
    assert thaw[-1].start_ms + thaw[-1].duration_ms == pytest.approx(1840.0)
    bare = [b for b in drawn if b.lane == "bare script"]
    assert bare[-1].start_ms + bare[-1].duration_ms == pytest.approx(1200.0)


def test_the_svg_is_self_contained_and_escapes_the_handler_name() -> None:
    text = svg({**RESULT, "handler": "<b>&"})
    assert "&lt;b&gt;&amp;" in text and "<b>" not in text
    # Nothing to fetch: no links, scripts, images or external fonts.
    for needle in ("href", "<script", "<image", "url(", "@import"):
        assert needle not in text


@pytest.mark.parametrize(
    ("total", "step"), [(1840.0, 500.0), (80.0, 10.0), (0.0, 1.0), (7300.0, 1000.0)]
)
def test_ticks_are_round(total: float, step: float) -> None:
    assert tick_step(total) == step


@needs_chromium
def test_coldstart_writes_a_waterfall_of_a_real_run_and_keeps_its_json(
    thaw_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**thaw_env, "THAW_HANDLERS": "tests.handlers.echo"}
    stem = tmp_path / "out" / "echo"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "runtime.cli.main", "coldstart", "echo", "--runs", "2"),
            *("--json", "--waterfall", str(stem)),
        ],
        env=env,
        capture_output=True,
        timeout=SAFETY_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    result = orjson.loads(done.stdout)  # stdout is still the one JSON object
    assert result["spawn_ms"] > 0 and result["batch_ms"] is None
    assert f"{stem}.svg" in done.stderr.decode() and f"{stem}.html" in done.stderr.decode()
    found = boxes(screenshot(Path(f"{stem}.html"), tmp_path), {k: c for k, _, c in THAW_PHASES})
    # The run's own times: spawn, /healthz, queue, run and the rest, in that order.
    assert [k for k, _, _ in THAW_PHASES if k in found][0:2] == ["spawn", "healthz"]
    assert found["healthz"][0] < found["run"][0] <= found["rest"][0]
    assert "fetch" not in found and "load" not in found
