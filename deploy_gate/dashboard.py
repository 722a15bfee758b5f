"""The dashboard page: reward per arm over time, the split's state and history, pending candidates.

Rendered on the server (inline SVG); its style sheet and the few lines of script behind the
buttons are served by the gate itself (`/static/gate.css`, `/static/gate.js`), never inline,
so the Content-Security-Policy can forbid inline script (an injected `<script>` or `onclick`
does not run) and nothing is fetched from elsewhere. Every value that came from a person or
the registry is HTML-escaped, too.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from html import escape
from urllib.parse import quote

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse

from deploy_gate.api import Gate, check_bucket
from deploy_gate.chart import reward_chart
from deploy_gate.metrics import ArmMetrics, arm_metrics
from deploy_gate.views import GateStatus
from flywheel.contract import TrafficSplit

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eee}
th{font-weight:600;background:#fafafa}.num{text-align:right;font-variant-numeric:tabular-nums}
.state{display:inline-block;padding:2px 8px;border-radius:10px;background:#eef;font-weight:600}
.state.running{background:#e6f4ea}.state.rolled_back{background:#fdecea}.state.promoted{background:#fff4e5}
.chart{width:100%;max-width:760px;height:auto}.grid{stroke:#eee}.tick,.legend{font-size:11px;fill:#555}
.empty,.muted{color:#777}form.act{display:flex;gap:6px;flex-wrap:wrap;margin:8px 0}
input{padding:3px 6px}button{padding:3px 10px;cursor:pointer}#msg{margin:6px 0;font-weight:600}
"""

# Posts to the API with the bearer token typed into the page; the token is never stored, and
# the history records the token's identity. Buttons name their API path in data-action.
SCRIPT = """
async function gate(path){
  const f=document.getElementById('who');
  const r=await fetch(path,{method:'POST',headers:{'Content-Type':'application/json',
    'Authorization':'Bearer '+f.token.value},body:JSON.stringify({reason:f.reason.value})});
  const body=await r.json().catch(()=>({}));
  document.getElementById('msg').textContent=r.ok?'done: '+path:(r.status+': '+(body.detail||'failed'));
  if(r.ok){setTimeout(()=>location.reload(),600);}
}
document.addEventListener('DOMContentLoaded',()=>{
  for(const f of document.querySelectorAll('form')){f.addEventListener('submit',e=>e.preventDefault());}
  for(const b of document.querySelectorAll('button[data-action]')){
    b.addEventListener('click',()=>gate(b.dataset.action));
  }
});
"""


def _fmt(v: float | None, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _url(version: str) -> str:
    """A version as a path segment that is also safe inside an HTML attribute."""
    return escape(quote(version, safe=""))


def _ts(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _split_section(split: TrafficSplit | None) -> str:
    if split is None:
        return (
            '<p class="empty">No traffic split yet: the first gate action creates it with the champion.</p>'
        )
    share = split.challenger_share if split.challenger_version else 0.0
    challenger = (
        f"challenger <b>v{escape(split.challenger_version)}</b> {share:.0%}"
        if split.challenger_version
        else "no challenger"
    )
    return (
        f'<p><span class="state {escape(split.state)}">{escape(split.state)}</span> '
        f"experiment <b>{escape(split.experiment)}</b>: champion <b>v{escape(split.champion_version)}</b> "
        f"{1 - share:.0%}, {challenger}. "
        f'<span class="muted">Last change by {escape(split.changed_by)} at {_ts(split.changed_at)}: '
        f"{escape(split.reason)}</span></p>"
    )


def _arms_table(metrics: ArmMetrics) -> str:
    if not metrics.arms:
        return ""
    rows = []
    for a in metrics.arms:
        mix = (
            ", ".join(f"{escape(k)} {v / a.n:.0%}" for k, v in sorted(a.label_sources.items())) if a.n else ""
        )
        ci = f"[{_fmt(a.ci_low)}, {_fmt(a.ci_high)}]" if a.ci_low is not None else "–"
        rows.append(
            f"<tr><td>{escape(a.arm)}</td><td>v{escape(a.model_version)}</td><td class=num>{a.n}</td>"
            f"<td class=num>{_fmt(a.mean)}</td><td class=num>{ci}</td><td>{mix}</td></tr>"
        )
    return (
        "<table><tr><th>arm</th><th>version</th><th class=num>n</th><th class=num>mean reward</th>"
        f"<th class=num>95% CI</th><th>label sources</th></tr>{''.join(rows)}</table>"
    )


def _pending_section(status: GateStatus) -> str:
    if not status.pending:
        return '<p class="empty">No candidate waits for approval.</p>'
    rows = "".join(
        f"<tr><td>v{escape(v.version)}</td><td>{_ts(v.created_at)}</td>"
        f"<td>{'v' + escape(v.parent_version) if v.parent_version else '–'}</td>"
        f"<td class=num>{v.sample_count}</td>"
        f'<td><button type="button" data-action="api/versions/{_url(v.version)}/approve">approve</button> '
        f'<button type="button" data-action="api/versions/{_url(v.version)}/reject">reject</button></td></tr>'
        for v in status.pending
    )
    return (
        "<table><tr><th>version</th><th>registered</th><th>parent</th><th class=num>samples</th>"
        "<th></th></tr>"
        f"{rows}</table>"
    )


def _history_section(history: Iterable[TrafficSplit]) -> str:
    rows = "".join(
        f"<tr><td>{_ts(h.changed_at)}</td><td>{escape(h.state)}</td><td>v{escape(h.champion_version)}</td>"
        f"<td>{'v' + escape(h.challenger_version) if h.challenger_version else '–'}</td>"
        f"<td class=num>{h.challenger_share:.0%}</td><td>{escape(h.changed_by)}</td>"
        f"<td>{escape(h.reason)}</td></tr>"
        for h in history
    )
    if not rows:
        return '<p class="empty">No changes yet.</p>'
    return (
        "<table><tr><th>when</th><th>state</th><th>champion</th><th>challenger</th><th class=num>share</th>"
        f"<th>by</th><th>why</th></tr>{rows}</table>"
    )


def _versions_section(status: GateStatus) -> str:
    rows = "".join(
        f"<tr><td>v{escape(v.version)}</td><td>{escape(v.gate_state)}</td>"
        f"<td>{escape(', '.join(v.aliases))}</td>"
        f"<td>{_ts(v.created_at)}</td><td class=num>{v.sample_count}</td></tr>"
        for v in status.versions[:20]
    )
    return (
        "<table><tr><th>version</th><th>gate state</th><th>aliases</th><th>registered</th>"
        f"<th class=num>samples</th></tr>{rows}</table>"
    )


def render_dashboard(status: GateStatus, history: list[TrafficSplit], metrics: ArmMetrics) -> str:
    reward = f"reward definition {escape(metrics.reward_version)}, " if metrics.reward_version else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Flywheel deploy gate</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="static/gate.css"><script src="static/gate.js"></script></head>
<body>
<h1>Flywheel deploy gate</h1>
<div class="muted">Updated {_ts(metrics.computed_at)} · <a href="">refresh</a> · JSON:
<a href="api/metrics/arms">metrics</a>, <a href="api/split">split</a>,
<a href="api/versions">versions</a></div>
<h2>Rollout</h2>{_split_section(status.split)}
<h2>Satisfaction per arm</h2>
<p class="muted">Mean reward per {escape(metrics.bucket)} bucket with {metrics.confidence:.0%} intervals
({reward}latest revision of each generation's reward; hover a point for its sample size).</p>
{reward_chart(metrics)}
{_arms_table(metrics)}
<h2>Candidates waiting for approval</h2>
<form id="who" class="act">
<input name="reason" placeholder="why" size="40" required>
<input name="token" type="password" placeholder="your approver token" autocomplete="off"></form>
{_pending_section(status)}
<form class="act">
<button type="button" data-action="api/promote">promote challenger</button>
<button type="button" data-action="api/rollback">roll back challenger</button></form>
<div id="msg"></div>
<h2>Split history</h2>{_history_section(history)}
<h2>Versions</h2>{_versions_section(status)}
</body></html>"""


page = APIRouter(tags=["dashboard"])


@page.get("/", response_class=HTMLResponse)
def dashboard(request: Request, gate: Gate, bucket: str = "1h") -> HTMLResponse:
    check_bucket(bucket)
    status = gate.status()
    metrics = arm_metrics(request.app.state.settings, bucket=bucket)
    return HTMLResponse(render_dashboard(status, gate.history(20), metrics))


@page.get("/static/gate.css", include_in_schema=False)
def style() -> Response:
    return Response(STYLE, media_type="text/css")


@page.get("/static/gate.js", include_in_schema=False)
def script() -> Response:
    return Response(SCRIPT, media_type="text/javascript")
