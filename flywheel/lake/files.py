"""Small files beside the lake's tables (the reward definitions), on the same store as the tables.

The lake's root is a local folder or an `s3://` URI (`Settings.lake_root`); what lives beside its tables
must live where they do, so that processes sharing the lake share nothing else (on a cluster: no volume).
Files are read and written through pyarrow's filesystems: a local folder, or S3 with the same `AWS_*`
variables delta-rs reads (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, and
`AWS_ENDPOINT_URL` for an S3-compatible server, whose scheme says whether it is plain HTTP).

What must hold: a reader sees a whole file or none, never half of one. On a disk a file is written
beside its place and renamed into it; on S3 one PUT replaces an object whole.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from pyarrow import fs

from flywheel.lake import is_remote, join


def _open(uri: str) -> tuple[fs.FileSystem, str]:
    if is_remote(uri):
        return fs.FileSystem.from_uri(uri)
    return fs.LocalFileSystem(), str(Path(uri).resolve())


def read_bytes(root: str | Path, *parts: str) -> bytes | None:
    """The file at `root`/`parts`, or None when there is none."""
    store, path = _open(join(root, *parts))
    try:
        with store.open_input_stream(path) as f:
            return bytes(f.read())
    except FileNotFoundError:
        return None


def write_bytes(root: str | Path, *parts: str, data: bytes) -> None:
    """Replace the file at `root`/`parts` whole (a reader sees the old file or the new one)."""
    uri = join(root, *parts)
    store, path = _open(uri)
    if is_remote(uri):
        with store.open_output_stream(path) as f:
            f.write(data)
        return
    parent = str(Path(path).parent)
    store.create_dir(parent, recursive=True)
    staged = f"{parent}/.{Path(path).name}.{uuid.uuid4().hex}.tmp"
    with store.open_output_stream(staged) as f:
        f.write(data)
    store.move(staged, path)


def names(root: str | Path, *parts: str, suffix: str = "") -> list[str]:
    """The names of the files directly in the folder `root`/`parts` ending in `suffix` (none: [])."""
    store, path = _open(join(root, *parts))
    found = store.get_file_info(fs.FileSelector(path, allow_not_found=True))
    return sorted(
        Path(i.path).name for i in found
        if i.type == fs.FileType.File and i.path.endswith(suffix) and not Path(i.path).name.startswith(".")
    )  # fmt: skip
