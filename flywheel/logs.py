"""One logging set-up for every Flywheel process: one valid JSON object per line.

`configure_logging(verbose)` routes the standard library's `logging` (every `logging.getLogger` in
the code base and in the client libraries) and structlog's own loggers through structlog's
`ProcessorFormatter`, so what must hold for each line holds for all of them:

- a line is one JSON object, whatever the message holds (quotes, newlines, text that looks like JSON):
  values are escaped by the JSON encoder, never pasted into a format string;
- `extra={...}` fields of a stdlib call become fields of the line (pass user input that way);
- a traceback is the `exception` field, not extra lines.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

# Client libraries narrate every connection and request at INFO.
_CHATTY = ("kafka", "httpx", "httpcore", "mlflow", "alembic", "apscheduler.executors", "uvicorn.access")

# The shared steps of both kinds of record (stdlib and structlog).
_SHARED: list[structlog.typing.Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
]


class _FlywheelHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler this module installed, so configuring again replaces it instead of doubling lines."""


def json_formatter() -> logging.Formatter:
    """The formatter that renders any stdlib or structlog record as one JSON line."""
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_SHARED, structlog.stdlib.ExtraAdder()],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.EventRenamer("msg"),
            structlog.processors.JSONRenderer(sort_keys=False, default=str),
        ],
    )


def configure_logging(verbose: bool = False, *, stream: TextIO | None = None) -> None:
    """Send every log record of this process to `stream` (stderr) as JSON lines; DEBUG when `verbose`."""
    structlog.configure(
        processors=[*_SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = _FlywheelHandler(stream or sys.stderr)
    handler.setFormatter(json_formatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _FlywheelHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.captureWarnings(True)  # library warnings become JSON lines too, not raw multi-line text
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)
    # uvicorn's loggers carry their own handlers when it configures logging; servers here start it with
    # `log_config=None`, and these lines make sure its records reach the JSON handler either way.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger (key-value fields: `log.info("cycle done", version=v)`)."""
    return structlog.stdlib.get_logger(name)  # type: ignore[no-any-return]
