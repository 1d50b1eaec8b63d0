"""``timeline(gm, path)``: an SVG (or self-contained HTML) picture of the predicted schedule.

One lane for compute and one per process group for communication; one ``<rect>`` per scheduled
node (class ``node`` plus its kind, and ``exposed`` when any of its time is exposed); a time axis
in microseconds. Hovering a rect shows its ``<title>``: node, kind, start, end, exposed time.
Exposed communication (and the wait that blocks on it) is red; hidden communication green;
compute blue; waits that do not block grey.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Iterable
from xml.sax.saxutils import escape, quoteattr

import torch.fx as fx

from fcoll.inspect.predicted import Event, PredictFn, collective_timings, predicted_events

__all__ = ["timeline", "timeline_svg", "exposed_of"]

log = logging.getLogger(__name__)

_LEFT, _RIGHT, _TOP = 150, 30, 40
_LANE_H, _LANE_GAP, _AXIS_H = 26, 10, 40
_PLOT_W = 1100
_COLORS = {"compute": "#4c78a8", "collective": "#54a24b", "wait": "#b0b0b0",
           "exposed": "#e45756"}
_MIN_EXPOSED_US = 1e-6


def _nice_step(span: float, target_ticks: int = 10) -> float:
    raw = span / max(1, target_ticks)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _lanes(events: list[Event]) -> list[str]:
    """"compute" first, then the communication lanes in order of first use."""
    lanes = ["compute"]
    for e in events:
        if e.lane not in lanes:
            lanes.append(e.lane)
    return lanes


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _lane_labels(lane_y: dict[str, float]) -> list[str]:
    out = []
    for lane, y in lane_y.items():
        label = lane if lane == "compute" else f"comm group {lane}"
        out.append(f'<text x="{_LEFT - 8}" y="{y + _LANE_H / 2 + 4}" text-anchor="end">'
                   f"{escape(label)}</text>")
        out.append(f'<line x1="{_LEFT}" x2="{_LEFT + _PLOT_W}" y1="{y + _LANE_H}" '
                   f'y2="{y + _LANE_H}" stroke="#ddd"/>')
    return out


def _event_rects(events: list[Event], lane_y: dict[str, float], t0: float, scale: float,
                 exposed_us: dict[str, float]) -> list[str]:
    """One rectangle per event (with a tooltip), and its name where it fits."""
    out = []
    for e in events:
        e_exposed = exposed_us.get(e.node, e.exposed_us)
        exposed = e_exposed > _MIN_EXPOSED_US
        color = _COLORS["exposed"] if exposed else _COLORS.get(e.kind, "#999")
        x = _LEFT + (e.start_us - t0) * scale
        w = max(0.5, e.dur_us * scale)
        y = lane_y[e.lane]
        cls = f"node {e.kind}" + (" exposed" if exposed else "")
        tip = (f"{e.node} ({e.kind}, lane {e.lane}): {_fmt(e.start_us)}-{_fmt(e.end_us)} us, "
               f"{_fmt(e.dur_us)} us, exposed {_fmt(e_exposed)} us")
        out.append(f'<rect class={quoteattr(cls)} data-node={quoteattr(e.node)} '
                   f'x="{x:.2f}" y="{y}" width="{w:.2f}" height="{_LANE_H}" fill="{color}" '
                   f'stroke="#fff" stroke-width="0.5"><title>{escape(tip)}</title></rect>')
        if w > 7 * len(e.node):
            out.append(f'<text x="{x + 3:.2f}" y="{y + _LANE_H / 2 + 4}" fill="#fff" '
                       f'pointer-events="none">{escape(e.node)}</text>')
    return out


def _time_axis(axis_y: float, t0: float, span: float, scale: float) -> list[str]:
    """The time axis: a line, ticks at :func:`_nice_step` intervals, and its label."""
    out = [f'<line x1="{_LEFT}" x2="{_LEFT + _PLOT_W}" y1="{axis_y}" y2="{axis_y}" '
           f'stroke="#333"/>']
    step = _nice_step(span)
    k = 0
    while k * step <= span + 1e-9:
        x = _LEFT + k * step * scale
        out.append(f'<line x1="{x:.2f}" x2="{x:.2f}" y1="{axis_y}" y2="{axis_y + 5}" '
                   f'stroke="#333"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 17}" text-anchor="middle">'
                   f"{_fmt(k * step)}</text>")
        k += 1
    out.append(f'<text x="{_LEFT + _PLOT_W / 2}" y="{axis_y + 33}" text-anchor="middle">'
               f"time (us, from {_fmt(t0)})</text>")
    return out


def _legend() -> list[str]:
    legend = [("compute", "compute"), ("collective", "communication (hidden)"),
              ("exposed", "exposed communication / blocking wait"), ("wait", "wait")]
    out = []
    lx = _LEFT + _PLOT_W
    for key, text in reversed(legend):
        lx -= 7 * len(text) + 24
        out.append(f'<circle cx="{lx}" cy="16" r="5" fill="{_COLORS[key]}"/>'
                   f'<text x="{lx + 8}" y="20">{escape(text)}</text>')
    return out


def timeline_svg(events: list[Event], title: str = "",
                 exposed_us: dict[str, float] | None = None) -> str:
    """The SVG text for ``events`` (see the module docstring for what is drawn).

    Args:
        events: the schedule.
        title: a heading.
        exposed_us: exposed time per node name, overriding the events' own ``exposed_us`` (a
            simulator may charge a collective's exposure to its wait; :func:`timeline` passes
            the per-collective figure of :func:`fcoll.inspect.predicted.collective_timings`).
    """
    lanes = _lanes(events)
    t0 = min((e.start_us for e in events), default=0.0)
    t1 = max((e.end_us for e in events), default=1.0)
    span = max(t1 - t0, 1e-9)
    scale = _PLOT_W / span
    height = _TOP + len(lanes) * (_LANE_H + _LANE_GAP) + _AXIS_H + 20
    width = _LEFT + _PLOT_W + _RIGHT
    lane_y = {lane: _TOP + i * (_LANE_H + _LANE_GAP) for i, lane in enumerate(lanes)}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f"<title>{escape(title or 'fcoll predicted schedule')}</title>",
           f'<text x="{_LEFT}" y="20" font-size="13">{escape(title)}</text>' if title else ""]
    out += _lane_labels(lane_y)
    out += _event_rects(events, lane_y, t0, scale, exposed_us or {})
    out += _time_axis(_TOP + len(lanes) * (_LANE_H + _LANE_GAP), t0, span, scale)
    out += _legend()
    out.append("</svg>")
    return "\n".join(line for line in out if line)


def exposed_of(gm: fx.GraphModule, events: list[Event]) -> dict[str, float]:
    """Exposed µs of each collective node of ``gm`` by name, as the tables count it."""
    return {n.name: t.exposed_us or 0.0 for n, t in collective_timings(gm, events).items()}


def timeline(gm: fx.GraphModule, path: str | os.PathLike, *,
             events: Iterable[Any] | None = None, predict: PredictFn | None = None,
             title: str = "") -> str:
    """Draw the predicted schedule of ``gm`` (in its current order) to ``path``.

    Args:
        gm: the graph.
        path: output file; ``.html``/``.htm`` writes a self-contained HTML page around the SVG,
            anything else a plain SVG document.
        events: precomputed predicted events (see :mod:`fcoll.inspect.predicted`).
        predict: a simulator ``gm -> events`` to use instead of
            ``fcoll.passes.rewrites.overlap.predict``.
        title: a heading for the picture.

    Returns:
        ``path`` as a string.

    Raises:
        RuntimeError: no events given and no predictor available.
    """
    evs = predicted_events(gm, events=events, predict=predict, required=True)
    svg = timeline_svg(evs, title, exposed_of(gm, evs))
    path = os.fspath(path)
    if path.lower().endswith((".html", ".htm")):
        doc = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>"
               f"{escape(title or 'fcoll timeline')}</title></head><body>\n{svg}\n</body></html>\n")
    else:
        doc = '<?xml version="1.0" encoding="UTF-8"?>\n' + svg + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(doc)
    log.debug("timeline: %d events, %d lanes -> %s", len(evs), len(_lanes(evs)), path)
    return path
