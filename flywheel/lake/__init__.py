"""The lake: Delta Lake tables (delta-rs, no JVM) on a local disk or on S3-compatible object storage.

Which tables there are, with their columns, places and rules, is `flywheel.lake.tables`: every
component writes and reads a table through its `Table` there. This module is the storage beneath it.

A table lives at a URI: a local path (the embedded default, `<data_dir>/lake/<table>`) or
`s3://bucket/prefix/<table>` (`FLYWHEEL_LAKE_URI`; credentials and endpoint from the usual
`AWS_*` variables, read by delta-rs itself: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_REGION`, `AWS_ENDPOINT_URL` and `AWS_ALLOW_HTTP` for an S3-compatible server). What must hold:

- a commit is atomic: readers see all of a batch or none of it, on a disk (rename) and on S3
  (conditional put, delta-rs's default since 1.x: no lock table);
- a reader reads one table version (`DeltaTable` pins it), so a compaction that lands during a
  read never shows it a row twice or hides one; the files it replaced stay until `vacuum`, whose
  retention (`flywheel.lake.maintenance`) outlasts any reader and keeps every version a
  registered candidate names;
- application transactions (`(app_id, version)` pairs committed with the data) are how a writer
  makes its commits idempotent: `flywheel.lake.tables.Table.commit` checks and commits them on one
  snapshot, and refuses a version that does not move forward (Delta itself accepts any).

delta-rs panics in a child `fork()`ed after the parent used it: processes that touch the lake are
started with `spawn` (or as their own programs), never forked. `guard_fork` turns the panic into
an error that says so.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

# The environment variables the lake's storage reads itself (delta-rs for the tables, pyarrow for the files
# beside them, `flywheel.lake.files`), not Flywheel's settings: a deployment sets them beside FLYWHEEL_LAKE_URI.
STORAGE_VARIABLES = frozenset(
    {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL",
     "AWS_ALLOW_HTTP"}
)  # fmt: skip

# Schemes delta-rs opens: a path without one is a local directory.
REMOTE_SCHEMES = frozenset({"s3", "s3a", "gs", "az", "abfs", "abfss"})


def is_remote(uri: str) -> bool:
    return urlparse(uri).scheme in REMOTE_SCHEMES


def join(root: str | Path, *parts: str) -> str:
    """`root` (a local path or a URI) with `parts` appended, as the URI delta-rs opens."""
    if isinstance(root, Path) or not is_remote(root):
        return str(Path(root).joinpath(*parts).resolve())
    return "/".join([root.rstrip("/"), *parts])


class ForkedLakeError(RuntimeError):
    """The lake used in a process forked after its parent used it (delta-rs would panic)."""


_used = False
_forked_after_use = False


def _after_fork_in_child() -> None:
    global _forked_after_use
    _forked_after_use = _forked_after_use or _used


os.register_at_fork(after_in_child=_after_fork_in_child)


def guard_fork() -> None:
    """Called before every use of delta-rs: refuses in a child forked after its parent used the lake."""
    global _used
    if _forked_after_use:
        raise ForkedLakeError(
            "this process was fork()ed after its parent used the lake, and delta-rs panics then: start it with "
            "multiprocessing.get_context('spawn') or as its own program"
        )
    _used = True
