"""An inline SVG chart of mean reward per arm over time, with 95% intervals and sample sizes.

Server-rendered and self-contained (no script, no CDN): each point is a bucket's mean, its
whisker the interval, and hovering shows n. Buckets with a single reward have no interval.
"""

from __future__ import annotations

from datetime import datetime
from html import escape

from deploy_gate.metrics import ArmMetrics, ArmSummary

WIDTH, HEIGHT = 760, 280
PAD_L, PAD_R, PAD_T, PAD_B = 56, 150, 16, 36
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def _label(a: ArmSummary) -> str:
    return f"{a.arm} v{a.model_version}" if a.model_version else a.arm


def reward_chart(metrics: ArmMetrics) -> str:
    points = [(b, a) for a in metrics.arms for b in a.buckets if b.mean is not None]
    if not points:
        return '<p class="empty">No rewards yet: the chart appears once signals have written rewards.</p>'
    times = sorted({b.start for b, _ in points})
    ys = [v for b, _ in points for v in (b.mean, b.ci_low, b.ci_high) if v is not None]
    lo, hi = min(ys), max(ys)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    margin = (hi - lo) * 0.05
    lo, hi = lo - margin, hi + margin
    plot_w, plot_h = WIDTH - PAD_L - PAD_R, HEIGHT - PAD_T - PAD_B

    def x(t: datetime) -> float:
        if len(times) == 1:
            return PAD_L + plot_w / 2
        span = (times[-1] - times[0]).total_seconds()
        return PAD_L + plot_w * (t - times[0]).total_seconds() / span

    def y(v: float) -> float:
        return PAD_T + plot_h * (hi - v) / (hi - lo)

    out = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="mean reward per arm over time" xmlns="http://www.w3.org/2000/svg">'
    ]
    # Axes and gridlines.
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        out.append(
            f'<line x1="{PAD_L}" x2="{PAD_L + plot_w}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>'
            f'<text x="{PAD_L - 6}" y="{y(v) + 4:.1f}" text-anchor="end" class="tick">{v:.2f}</text>'
        )
    for t in (times[0], times[-1]) if len(times) > 1 else (times[0],):
        out.append(
            f'<text x="{x(t):.1f}" y="{HEIGHT - 12}" text-anchor="middle" class="tick">'
            f"{t.strftime('%m-%d %H:%M')}</text>"
        )
    # Small horizontal offsets keep overlapping whiskers of different arms apart.
    for i, arm in enumerate(metrics.arms):
        color = PALETTE[i % len(PALETTE)]
        dx = (i - (len(metrics.arms) - 1) / 2) * 4
        pts = [b for b in arm.buckets if b.mean is not None]
        line = " ".join(f"{x(b.start) + dx:.1f},{y(b.mean):.1f}" for b in pts if b.mean is not None)
        out.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        for b in pts:
            assert b.mean is not None
            cx = x(b.start) + dx
            tip = f"{_label(arm)} {b.start:%Y-%m-%d %H:%M}: mean {b.mean:.3f}, n={b.n}"
            if b.ci_low is not None and b.ci_high is not None:
                tip += f", 95% CI [{b.ci_low:.3f}, {b.ci_high:.3f}]"
                out.append(
                    f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(b.ci_low):.1f}" y2="{y(b.ci_high):.1f}" '
                    f'stroke="{color}" stroke-opacity="0.5" stroke-width="6"/>'
                )
            out.append(
                f'<circle cx="{cx:.1f}" cy="{y(b.mean):.1f}" r="3.5" fill="{color}">'
                f"<title>{escape(tip)}</title></circle>"
            )
        ly = PAD_T + 14 + 18 * i
        out.append(
            f'<rect x="{WIDTH - PAD_R + 12}" y="{ly - 9}" width="12" height="12" fill="{color}"/>'
            f'<text x="{WIDTH - PAD_R + 30}" y="{ly + 1}" class="legend">{escape(_label(arm))} '
            f"(n={arm.n})</text>"
        )
    out.append("</svg>")
    return "".join(out)
