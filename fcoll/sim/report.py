"""Text and SVG of a :class:`~fcoll.sim.simulate.SimReport`."""

from __future__ import annotations

import math
from typing import Any
from xml.sax.saxutils import escape

from fcoll.inspect.text import fmt_bytes, text_table

__all__ = ["report_text", "plot_svg"]


def _ms(us: float) -> str:
    return f"{us / 1e3:.3f}"


def _algorithms(counts: dict[str, dict[str, int]]) -> str:
    return "; ".join(f"{kind} " + ",".join(f"{a}x{n}" if n > 1 else a for a, n in c.items())
                     for kind, c in counts.items()) or "-"


def report_text(report: Any) -> str:
    """One row per layout: ranks, hosts x ranks per host, step (graphs plus the time outside
    them), outside, compute, communication and exposed time (ms), overlap ratio, peak memory, the algorithms chosen; then the links, the
    graphs and the assumptions."""
    rows = []
    for r in report.results:
        rows.append((r.layout.ranks, str(r.layout), _ms(r.step_us), _ms(r.outside_us),
                     _ms(r.compute_us),
                     _ms(r.comm_us), _ms(r.exposed_comm_us), f"{r.overlap_ratio:.0%}",
                     fmt_bytes(int(r.peak_bytes)), _algorithms(r.algorithms())))
    table = text_table(("ranks", "hosts", "step_ms", "outside_ms", "compute_ms", "comm_ms",
                        "exposed_ms", "overlap", "peak_mem", "algorithms"), rows,
                       (True, True, True, True, True, True, True, True, True, False))
    lines = [table, "",
             f"graphs: {', '.join(report.programs)} (recorded on "
             f"{report.recorded_world_size} ranks)",
             f"compute: {report.compute_source}",
             f"outside the graphs: {report.outside_source}",
             f"intra-host: {report.network.intra.describe()}",
             f"inter-host: {report.network.inter.describe()}",
             f"algorithm: {report.network.algorithm}", "assumptions:"]
    lines += [f"  - {a}" for a in report.assumptions]
    return "\n".join(lines)


_W, _H, _L, _R, _T, _B = 640, 360, 70, 150, 30, 50
_COLORS = {"step": "#4c78a8", "exposed": "#e45756"}


def plot_svg(report: Any, title: str = "fcoll.sim") -> str:
    """SVG of step time and exposed communication (ms) against ranks (log2 axis)."""
    res = report.results
    xs = [math.log2(r.layout.ranks) for r in res]
    series = {"step": [r.step_us / 1e3 for r in res],
              "exposed": [r.exposed_comm_us / 1e3 for r in res]}
    x0, x1 = min(xs), max(xs)
    x1 = x1 if x1 > x0 else x0 + 1
    ymax = max(max(series["step"]), 1e-9) * 1.1
    pw, ph = _W - _L - _R, _H - _T - _B

    def px(x: float) -> float:
        return _L + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return _T + ph - y / ymax * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<text x="{_W / 2}" y="18" text-anchor="middle">{escape(title)}</text>',
           f'<line x1="{_L}" y1="{_T + ph}" x2="{_L + pw}" y2="{_T + ph}" stroke="black"/>',
           f'<line x1="{_L}" y1="{_T}" x2="{_L}" y2="{_T + ph}" stroke="black"/>',
           f'<text x="{_L + pw / 2}" y="{_H - 10}" text-anchor="middle">ranks</text>',
           f'<text x="15" y="{_T + ph / 2}" transform="rotate(-90 15 {_T + ph / 2})" '
           f'text-anchor="middle">ms per step</text>']
    for r, x in zip(res, xs):
        out.append(f'<text x="{px(x):.1f}" y="{_T + ph + 18}" text-anchor="middle">'
                   f'{r.layout.ranks}</text>')
    for i in range(5):
        y = ymax * i / 4
        out.append(f'<text x="{_L - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.3g}</text>')
    for k, (name, ys) in enumerate(series.items()):
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
        color = _COLORS[name]
        out.append(f'<polyline class="{name}" fill="none" stroke="{color}" stroke-width="2" '
                   f'points="{pts}"/>')
        out += [f'<circle class="{name}" cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" '
                f'fill="{color}"><title>{name} {y:.3f} ms</title></circle>'
                for x, y in zip(xs, ys)]
        label = "step time" if name == "step" else "exposed communication"
        out.append(f'<text x="{_L + pw + 10}" y="{_T + 14 + 18 * k}" fill="{color}">'
                   f'{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
