"""The dashboard page: the release's figures, pending approvals and the audit trail.

The page is a Jinja2 template (`templates/dashboard.html`, autoescaped) whose data sections
`static/dashboard.js` fills from the gate's JSON APIs and refreshes every few seconds, as
text nodes only, so a reason or a name holding markup is shown as text. Charts are drawn by
uPlot, vendored under `static/vendor/uplot/` (MIT, its LICENSE beside it): nothing is fetched
from another origin, and the Content-Security-Policy (`deploy_gate.security`) forbids inline
script, so an injected `<script>` or `onclick` cannot run even if it reached the page.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, PackageLoader, StrictUndefined

from deploy_gate.api import Gate, check_bucket

STATIC_DIR = Path(__file__).parent / "static"
REFRESH_MS = 5000
API_LINKS = (
    ("experiment", "api/experiment"),
    ("metrics", "api/metrics/arms"),
    ("split", "api/split"),
    ("versions", "api/versions"),
    ("audit", "api/audit"),
)

templates = Environment(
    loader=PackageLoader("deploy_gate", "templates"),
    autoescape=True,  # every template, whatever its name
    undefined=StrictUndefined,  # a misspelt variable is an error, not an empty string
    trim_blocks=True,
    lstrip_blocks=True,
)

page = APIRouter(tags=["dashboard"])


def render_dashboard(*, experiment: str, bucket: str | None) -> str:
    return templates.get_template("dashboard.html").render(
        title="Flywheel deploy gate",
        experiment=experiment,
        # Unasked, the page follows the experiment's own bucket (`GET /api/experiment`): minutes for a demo.
        bucket=bucket or "1h",
        bucket_asked=bucket is not None,
        refresh_ms=REFRESH_MS,
        api_links=API_LINKS,
        # Relative, so the page also works behind a proxy that mounts the gate under a prefix.
        static="static",
    )


@page.get("/", response_class=HTMLResponse)
def dashboard(request: Request, gate: Gate, bucket: str | None = None) -> HTMLResponse:
    if bucket is not None:
        check_bucket(bucket)
    experiment = gate.experiment if gate is not None else "default"
    return HTMLResponse(render_dashboard(experiment=experiment, bucket=bucket))
