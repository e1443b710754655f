"""`thaw coldstart --waterfall STEM`: a cold start drawn as a waterfall.

One row per phase, each bar placed on one time axis from the moment the
server process was spawned: spawn (fork and exec of the interpreter),
/healthz (from there until GET /healthz answered 200: imports, the app's
startup, the bind), then the first invocation's phases as its Server-Timing
header gave them, in the order a cold request passes them (fetch, load, init,
warm-up, queue, batch, run), and what is left of the client's wall time (the
HTTP exchange, hand-offs between threads). With `--bare`, the bare script's
run is drawn below on the same axis: interpreter start, import, load, build,
run.

The SVG is written by hand, without a plotting library: a few rects and texts,
self-contained (no fonts, scripts or links to fetch), with `crispEdges` so each
bar is one solid colour from edge to edge (tests/cli/test_waterfall.py finds
the bars by colour in a headless browser's screenshot). The HTML page holds the
same SVG inline and the figures as a table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

THAW_LANE = "thaw serve"
BARE_LANE = "bare script"
# (result key, row label, colour): the order a cold request passes them. Colours are
# distinct, saturated and unlike the greys of text, so a screenshot tells them apart.
THAW_PHASES: tuple[tuple[str, str, str], ...] = (
    ("spawn", "spawn", "#1f77b4"),
    ("healthz", "/healthz", "#ff7f0e"),
    ("fetch", "fetch", "#2ca02c"),
    ("load", "load", "#d62728"),
    ("init", "init", "#9467bd"),
    ("warmup", "warm-up", "#8c564b"),
    ("queue", "queue", "#e377c2"),
    ("batch", "batch", "#bcbd22"),
    ("run", "run", "#17becf"),
    ("rest", "HTTP, hand-offs", "#7f7f00"),
)
BARE_PHASES: tuple[tuple[str, str, str], ...] = (
    ("start", "interpreter", "#0b3d91"),
    # The --json keys of the bare run's steps say `_s` but hold milliseconds.
    ("import_ms", "import", "#b35806"),
    ("load_ms", "load", "#1b7837"),
    ("build_ms", "build", "#762a83"),
    ("run_ms", "run", "#006d77"),
)

LABEL_W = 130
CHART_W = 640
VALUE_W = 110
ROW_H = 22
BAR_H = 14
TOP = 44
AXIS_H = 28
LANE_GAP = 26
FONT = "font-family:sans-serif;font-size:12px"


@dataclass(frozen=True)
class Bar:
    """One phase: where on the time axis it starts, how long it took."""

    lane: str
    phase: str
    label: str
    start_ms: float
    duration_ms: float
    colour: str
    # Not paid at all by this handler (a model-less handler has no fetch).
    absent: bool = False


def bars(result: dict[str, Any]) -> list[Bar]:
    """The waterfall of a `thaw coldstart` result (its --json object)."""
    phases = dict(result["phases_ms"])
    absent = set(result["phases_absent"])
    batch_ms = result.get("batch_ms")
    phases["batch"] = batch_ms or 0.0
    if batch_ms is None:
        absent.add("batch")
    spawn_ms = result.get("spawn_ms", 0.0)
    healthy_ms = result["process_start_to_healthy_ms"]
    paid = sum(phases[key] for key, _, _ in THAW_PHASES[2:9])
    durations = {
        "spawn": spawn_ms,
        "healthz": max(0.0, healthy_ms - spawn_ms),
        **{key: phases[key] for key, _, _ in THAW_PHASES[2:9]},
        "rest": max(0.0, result["first_invocation_ms"] - paid),
    }
    out: list[Bar] = []
    at = 0.0
    for key, label, colour in THAW_PHASES:
        out.append(Bar(THAW_LANE, key, label, at, durations[key], colour, key in absent))
        at += durations[key]
    bare = result.get("bare")
    if bare is not None:
        steps = sum(bare[key] for key, _, _ in BARE_PHASES[1:])
        durations = {
            "start": max(0.0, bare["first_answer_ms"] - steps),
            **{key: bare[key] for key, _, _ in BARE_PHASES[1:]},
        }
        at = 0.0
        for key, label, colour in BARE_PHASES:
            out.append(Bar(BARE_LANE, key, label, at, durations[key], colour))
            at += durations[key]
    return out


def tick_step(total_ms: float, most: int = 8) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving at most `most` ticks."""
    if total_ms <= 0:
        return 1.0
    raw = total_ms / most
    power = 10.0 ** math.floor(math.log10(raw))
    for factor in (1.0, 2.0, 5.0, 10.0):
        if raw <= factor * power:
            return factor * power
    return 10.0 * power


def _ms(value: float) -> str:
    return f"{value / 1000:.2f} s" if value >= 10_000 else f"{value:.1f} ms"


def _axis(total: float, scale: float, bottom: float) -> list[str]:
    """Grid lines and their labels, a round step apart (drawn under the bars)."""
    step = tick_step(total)
    unit, per = ("s", 1000.0) if step >= 1000 else ("ms", 1.0)
    parts = [
        f'<line x1="{LABEL_W}" y1="{bottom + 4}" x2="{LABEL_W + CHART_W}" y2="{bottom + 4}" '
        f'stroke="#999999" shape-rendering="crispEdges"/>'
    ]
    for n in range(int(total / step + 1e-9) + 1):
        x = LABEL_W + n * step * scale
        parts.append(
            f'<line x1="{x:.1f}" y1="{TOP - 4}" x2="{x:.1f}" y2="{bottom + 8}" '
            f'stroke="#e4e4e4" shape-rendering="crispEdges"/>'
        )
        parts.append(
            f'<text x="{x:.1f}" y="{bottom + 22}" text-anchor="middle" style="{FONT}" '
            f'fill="#555555">{n * step / per:g} {unit}</text>'
        )
    return parts


def svg(result: dict[str, Any]) -> str:
    """The waterfall as one self-contained SVG document."""
    drawn = bars(result)
    total = max((b.start_ms + b.duration_ms for b in drawn), default=0.0) or 1.0
    scale = CHART_W / total  # px per ms, the same for every bar
    lanes = list(dict.fromkeys(b.lane for b in drawn))
    bottom = TOP + len(drawn) * ROW_H + (len(lanes) - 1) * LANE_GAP
    height = bottom + AXIS_H + 10
    width = LABEL_W + CHART_W + VALUE_W
    title = f"cold start of {result['handler']}: {_ms(result['process_start_to_first_answer_ms'])}"
    if "bare" in result:
        title += f" (bare script {_ms(result['bare']['first_answer_ms'])})"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="8" y="20" style="{FONT};font-size:14px;font-weight:bold" '
        f'fill="#222222">{escape(title)}</text>',
        *_axis(total, scale, bottom),
    ]
    y = TOP
    for lane in lanes:
        parts.append(
            f'<text x="8" y="{y - 6}" style="{FONT};font-style:italic" '
            f'fill="#555555">{escape(lane)}</text>'
        )
        for bar in (b for b in drawn if b.lane == lane):
            x = LABEL_W + bar.start_ms * scale
            # A phase that was paid shows, however short: at least one pixel.
            w = max(bar.duration_ms * scale, 1.0 if bar.duration_ms > 0 else 0.0)
            mid = y + ROW_H / 2 + 4
            parts.append(
                f'<text x="{LABEL_W - 8}" y="{mid:.1f}" text-anchor="end" style="{FONT}" '
                f'fill="#333333">{escape(bar.label)}</text>'
            )
            note = "not paid" if bar.absent else _ms(bar.duration_ms)
            if not bar.absent:
                parts.append(
                    f'<rect class="bar" data-phase="{escape(bar.phase)}" x="{x:.3f}" '
                    f'y="{y + (ROW_H - BAR_H) / 2:.1f}" width="{w:.3f}" height="{BAR_H}" '
                    f'fill="{bar.colour}" shape-rendering="crispEdges">'
                    f"<title>{escape(bar.label)}: {note}</title></rect>"
                )
            parts.append(
                f'<text x="{x + w + 6:.1f}" y="{mid:.1f}" style="{FONT}" '
                f'fill="#555555">{note}</text>'
            )
            y += ROW_H
        y += LANE_GAP
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def html(result: dict[str, Any]) -> str:
    """A page with the SVG inline and each phase's figure in a table."""
    rows = "\n".join(
        f"<tr><td>{escape(b.lane)}</td><td>{escape(b.label)}</td>"
        f'<td class="n">{"not paid" if b.absent else f"{b.duration_ms:.1f}"}</td>'
        f'<td class="n">{b.start_ms:.1f}</td></tr>'
        for b in bars(result)
    )
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>thaw coldstart {escape(result["handler"])}</title>
<style>
body {{ margin: 16px; font-family: sans-serif; color: #222; background: #fff; }}
table {{ border-collapse: collapse; margin-top: 12px; font-size: 13px; }}
td, th {{ padding: 2px 10px; border-bottom: 1px solid #ddd; text-align: left; }}
td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
</style>
</head>
<body>
{svg(result)}
<table>
<tr><th>run</th><th>phase</th><th>ms</th><th>starts at (ms)</th></tr>
{rows}
</table>
<p>Made by <code>thaw coldstart</code>; the figures are also in its <code>--json</code>.</p>
</body>
</html>
"""


def write(result: dict[str, Any], stem: Path) -> tuple[Path, Path]:
    """Write STEM.svg and STEM.html (a `.svg` or `.html` suffix on `stem` is dropped)."""
    if stem.suffix.lower() in {".svg", ".html"}:
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    svg_path, html_path = stem.with_name(stem.name + ".svg"), stem.with_name(stem.name + ".html")
    svg_path.write_text(svg(result), encoding="utf-8")
    html_path.write_text(html(result), encoding="utf-8")
    return svg_path, html_path
