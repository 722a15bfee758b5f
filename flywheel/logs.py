"""One logging set-up for every Flywheel process: one valid JSON object per line.

`configure_logging(verbose)` routes the standard library's `logging` (every `logging.getLogger` in
the code base and in the client libraries) and structlog's own loggers through structlog's
`ProcessorFormatter`, so what must hold for each line holds for all of them:

- a line is one JSON object, whatever the message holds (quotes, newlines, text that looks like JSON):
  values are escaped by the JSON encoder, never pasted into a format string;
- `extra={...}` fields of a stdlib call become fields of the line (pass user input that way);
- a traceback is the `exception` field, not extra lines;
- an access log line keeps the names of its query parameters, never their values (`redact_access_log`);
- a client library repeating itself (kafka-python logs every failed reconnect, several a second while a
  broker is down) writes a line once per `REPEAT_WINDOW_S` per message: the outage itself is reported
  once by the process's dependency state (`flywheel.ops`). `--verbose` lets everything through.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

import structlog

# Client libraries narrate every connection and request at INFO.
_CHATTY = ("kafka", "httpx", "httpcore", "mlflow", "alembic", "apscheduler.executors", "uvicorn.access")
# kafka-python's own event loop warns whenever one of its steps took over 0.1 s, which a busy machine makes
# happen every few seconds, each time with another object's address (so the repeat filter cannot thin them).
_LOAD_REPORTS = ("kafka.net.selector",)

# The shared steps of both kinds of record (stdlib and structlog).
_SHARED: list[structlog.typing.Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
]


# Loggers of this code base; everything else is a library whose repeats are thinned out.
_OWN = ("flywheel", "ingest", "signals", "trainer", "deploy_gate", "model_registry", "serving", "launcher",
        "simulator", "__main__")
REPEAT_WINDOW_S = 60.0


class LibraryRepeatFilter(logging.Filter):
    """Lets a library's message (its logger and format string) through once per window; counts the rest."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S) -> None:
        super().__init__()
        self.window_s = window_s
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(_OWN) or record.levelno >= logging.CRITICAL:
            return True
        key, now = (record.name, str(record.msg)), time.monotonic()
        with self._lock:
            seen = self._last.get(key)
            if seen is not None and now - seen[0] < self.window_s:
                self._last[key] = (seen[0], seen[1] + 1)
                return False
            self._last[key] = (now, 0)
        if seen is not None and seen[1]:
            record.repeated_since_last = seen[1]  # a field of the line: how many were held back
        return True


class QueryStringRedactor(logging.Filter):
    """Keeps the names of an access log line's query parameters and drops their values: a client may put a
    token or a write key there, and the access log must not keep it (uvicorn's access record carries the
    path with its query as its third argument; any other record passes unchanged)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            path, _, query = args[2].partition("?")
            names = [part.partition("=")[0] for part in query.split("&")]
            redacted = "&".join(f"{n}={REDACTED_VALUE}" for n in names)
            record.args = (*args[:2], f"{path}?{redacted}", *args[3:])
        return True


REDACTED_VALUE = "[redacted]"


def redact_access_log() -> None:
    """Install `QueryStringRedactor` on uvicorn's access logger (once). On the logger itself, not a handler:
    it then holds whoever configures the handlers (uvicorn's own config under `--workers N`, or ours)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QueryStringRedactor) for f in access.filters):
        access.addFilter(QueryStringRedactor())


class _FlywheelHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler this module installed, so configuring again replaces it instead of doubling lines."""


def _drop_color_message(_: object, __: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    """uvicorn adds its message again with terminal colour codes: not for a JSON line."""
    event.pop("color_message", None)
    return event


def json_formatter() -> logging.Formatter:
    """The formatter that renders any stdlib or structlog record as one JSON line."""
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_SHARED, structlog.stdlib.ExtraAdder()],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _drop_color_message,
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
    if not verbose:
        handler.addFilter(LibraryRepeatFilter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _FlywheelHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.captureWarnings(True)  # library warnings become JSON lines too, not raw multi-line text
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)
    for name in _LOAD_REPORTS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.ERROR)
    # uvicorn's loggers carry their own handlers when it configures logging; servers here start it with
    # `log_config=None`, and these lines make sure its records reach the JSON handler either way.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    redact_access_log()


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger (key-value fields: `log.info("cycle done", version=v)`)."""
    return structlog.stdlib.get_logger(name)  # type: ignore[no-any-return]
