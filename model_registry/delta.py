"""Lossless weight deltas between two safetensors files, and their exact application.

A delta holds, per tensor of the result file, whichever of these is smallest:
  - "same":   the parent's bytes unchanged (nothing stored);
  - "xor":    the XOR of the raw bits of child and parent, bytes split into planes (every element's
              first byte, then every second byte, ...) and zstd-compressed: sign and exponent bytes
              barely change between versions, so their planes are almost all zeros;
  - "xor_mag": the same XOR, its elements first put in the order of the *parent's* magnitudes (a
              stable sort both sides can compute from the parent alone): an optimizer step moves
              every value by about the same amount, so whether a value's bits change, and which bits
              a carry flips, depend on the value it had; sorted, the changes gather in one end, long
              runs of zeros fill the other, and alike XOR patterns sit together (3x smaller in bf16);
  - "sparse": the positions of the changed elements (gaps between them, zstd) and their *new* values
              (raw bits, zstd), for when few values changed;
  - "raw":    the child's bytes, zstd-compressed (a tensor that is new or changed shape or dtype).
Nothing is ever arithmetic: new values and XORs of bits, so applying a delta rebuilds the result
byte for byte. A delta names the sha256 of the parent file it was made against and of the result
file, and `apply_delta` refuses a parent that is not that file and a result that is not that file.

The blob: MAGIC, an 8-byte little-endian header length, a JSON header, then the payload segments
it points to (every zstd frame carries its own checksum).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

MAGIC = b"FWDELTA1"
SUFFIX = ".fwdelta"
ZSTD_LEVEL = 10
# Above this share of changed elements the sparse form cannot win (indices cost more than the XOR).
_SPARSE_MAX_SHARE = 0.3
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
             "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Float dtypes: every bit but the sign, for the magnitude order.
_MAGNITUDE = {"F32": 0x7FFF_FFFF, "BF16": 0x7FFF, "F16": 0x7FFF, "F64": 0x7FFF_FFFF_FFFF_FFFF}


class DeltaError(ValueError):
    """A delta that cannot be made or applied: not a safetensors file, a corrupt blob, the wrong parent."""


@dataclass(frozen=True)
class SafetensorsFile:
    """A parsed safetensors file: its raw prefix (length + JSON header) and each tensor's byte range."""

    raw: bytes
    prefix_len: int
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}

    def data(self, name: str) -> memoryview:
        start, end = self.tensors[name]["data_offsets"]
        return memoryview(self.raw)[self.prefix_len + start : self.prefix_len + end]


def parse_safetensors(raw: bytes) -> SafetensorsFile:
    """Split a safetensors file into header and tensor ranges; `DeltaError` when it is not one."""
    if len(raw) < 8:
        raise DeltaError("not a safetensors file: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise DeltaError("not a safetensors file: its header length runs past the end")
    try:
        header = json.loads(raw[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeltaError(f"not a safetensors file: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise DeltaError("not a safetensors file: header is not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1]):
            raise DeltaError(f"not a safetensors file: tensor {name!r} has no valid data_offsets")
        end = max(end, offsets[1])
    if 8 + n + end != len(raw):
        raise DeltaError("not a safetensors file: tensor data does not fill the file exactly")
    return SafetensorsFile(raw=raw, prefix_len=8 + n, tensors=header)


def tensor_hashes(raw: bytes) -> dict[str, dict[str, Any]]:
    """Per-tensor sha256 of the raw bits, with dtype and shape: the manifest's record of a weights file."""
    parsed = parse_safetensors(raw)
    return {
        name: {"sha256": hashlib.sha256(parsed.data(name)).hexdigest(), "dtype": info["dtype"],
               "shape": list(info["shape"])}
        for name, info in sorted(parsed.tensors.items())
    }  # fmt: skip


def _planes(data: bytes | memoryview, itemsize: int) -> bytes:
    arr = np.frombuffer(data, dtype=np.uint8)
    if itemsize == 1 or arr.size % itemsize:
        return arr.tobytes()
    return arr.reshape(-1, itemsize).T.tobytes()  # (itemsize, n): each byte position together


def _unplanes(data: bytes, itemsize: int) -> np.ndarray:
    arr = np.frombuffer(data, dtype=np.uint8)
    if itemsize == 1 or arr.size % itemsize:
        return arr
    return arr.reshape(itemsize, -1).T.reshape(-1)


class _Writer:
    def __init__(self, level: int) -> None:
        self._zstd = zstandard.ZstdCompressor(level=level, write_checksum=True)
        self.segments: list[bytes] = []
        self.offset = 0

    def compress(self, payload: bytes) -> bytes:
        return self._zstd.compress(payload)

    def append(self, blob: bytes) -> list[int]:
        """Add a compressed segment; returns its [offset, length] within the payload."""
        self.segments.append(blob)
        self.offset += len(blob)
        return [self.offset - len(blob), len(blob)]

    def add(self, payload: bytes) -> list[int]:
        return self.append(self.compress(payload))


def _magnitude_order(parent: memoryview | bytes, dtype: str) -> np.ndarray | None:
    """Element positions sorted (stably) by the parent's magnitude bits; None for a non-float dtype."""
    if dtype not in _MAGNITUDE:
        return None
    itemsize = _ITEMSIZE[dtype]
    bits = np.frombuffer(parent, _UINT[itemsize])
    # The top 16 bits (exponent and leading mantissa) as the key: numpy sorts 16-bit keys by radix, in linear time.
    key = ((bits & _UINT[itemsize](_MAGNITUDE[dtype])) >> (8 * itemsize - 16)).astype(np.uint16)
    return np.argsort(key, kind="stable")


def _encode_tensor(parent: memoryview, child: memoryview, dtype: str, w: _Writer) -> dict[str, Any]:
    if parent == child:
        return {"enc": "same"}
    itemsize = _ITEMSIZE.get(dtype, 1)
    xor = np.bitwise_xor(np.frombuffer(parent, np.uint8), np.frombuffer(child, np.uint8))
    candidates: list[tuple[dict[str, Any], list[bytes]]] = [({"enc": "xor"}, [_planes(xor.tobytes(), itemsize)])]
    order = _magnitude_order(parent, dtype) if len(child) % itemsize == 0 else None
    if order is not None:
        by_magnitude = xor.view(_UINT[itemsize])[order]
        candidates.append(({"enc": "xor_mag"}, [_planes(by_magnitude.tobytes(), itemsize)]))
    if itemsize in _UINT and len(child) % itemsize == 0:
        old = np.frombuffer(parent, _UINT[itemsize])
        new = np.frombuffer(child, _UINT[itemsize])
        changed = np.flatnonzero(old != new)
        if changed.size <= _SPARSE_MAX_SHARE * new.size:
            gaps = np.diff(changed, prepend=-1).astype(np.uint32)  # positions as gaps: small numbers
            candidates.append(({"enc": "sparse", "count": int(changed.size)},
                               [_planes(gaps.tobytes(), 4), _planes(new[changed].tobytes(), itemsize)]))
    # Compress every candidate and keep the smallest: the sizes are only known after zstd.
    compressed = [(spec, [w.compress(p) for p in payloads]) for spec, payloads in candidates]
    spec, blobs = min(compressed, key=lambda c: sum(map(len, c[1])))
    return {**spec, "segments": [w.append(blob) for blob in blobs]}


def _comparable(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether a tensor can be encoded against its parent's namesake: same dtype and shape."""
    return old is not None and old["dtype"] == new["dtype"] and old["shape"] == new["shape"]


def shares_tensors(parent_raw: bytes, child_raw: bytes) -> bool:
    """Whether any tensor of `child_raw` can be encoded against `parent_raw` (not so after a dtype change):
    without one, a delta would only hold every tensor again, "raw"."""
    parent, child = parse_safetensors(parent_raw), parse_safetensors(child_raw)
    return any(_comparable(parent.tensors.get(name), info) for name, info in child.tensors.items())


def make_delta(parent_raw: bytes, child_raw: bytes, level: int = ZSTD_LEVEL) -> bytes:
    """The delta that turns the safetensors file `parent_raw` into `child_raw` exactly."""
    parent, child = parse_safetensors(parent_raw), parse_safetensors(child_raw)
    w = _Writer(level)
    plan: dict[str, dict[str, Any]] = {}
    for name, info in child.tensors.items():
        if _comparable(parent.tensors.get(name), info):
            plan[name] = _encode_tensor(parent.data(name), child.data(name), str(info["dtype"]), w)
        else:
            plan[name] = {"enc": "raw", "segments": [w.add(bytes(child.data(name)))]}
    header = {
        "parent_sha256": hashlib.sha256(parent_raw).hexdigest(),
        "result_sha256": hashlib.sha256(child_raw).hexdigest(),
        "result_bytes": len(child_raw),
        "prefix": w.add(child_raw[: child.prefix_len]),
        "tensors": plan,
    }
    raw_header = json.dumps(header, sort_keys=True).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(raw_header)), raw_header, *w.segments])


def read_delta_header(blob: bytes) -> dict[str, Any]:
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 8:
        raise DeltaError("not a weights delta (bad magic)")
    (n,) = struct.unpack("<Q", blob[len(MAGIC) : len(MAGIC) + 8])
    try:
        header: dict[str, Any] = json.loads(blob[len(MAGIC) + 8 : len(MAGIC) + 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DeltaError("the delta's header is corrupt") from None
    header["_payload_start"] = len(MAGIC) + 8 + n
    return header


def apply_delta(parent_raw: bytes, blob: bytes) -> bytes:
    """The result file the delta was made for, rebuilt from `parent_raw` and checked by its sha256."""
    header = read_delta_header(blob)
    parent_sha = hashlib.sha256(parent_raw).hexdigest()
    if parent_sha != header.get("parent_sha256"):
        raise DeltaError(
            f"the delta was made against a parent file with sha256 {str(header.get('parent_sha256'))[:12]}..., "
            f"not this one ({parent_sha[:12]}...)"
        )
    start = header["_payload_start"]
    dctx = zstandard.ZstdDecompressor()

    def segment(ref: list[int]) -> bytes:
        try:
            return dctx.decompress(blob[start + ref[0] : start + ref[0] + ref[1]])
        except zstandard.ZstdError as exc:
            raise DeltaError(f"a compressed segment of the delta is corrupt ({exc})") from None

    try:
        prefix = segment(header["prefix"])
        child = parse_safetensors(prefix + bytes(header["result_bytes"] - len(prefix)))
        parent = parse_safetensors(parent_raw)
        out = bytearray(header["result_bytes"])
        out[: len(prefix)] = prefix
        for name, info in child.tensors.items():
            spec = header["tensors"][name]
            lo, hi = info["data_offsets"]
            dst = slice(child.prefix_len + lo, child.prefix_len + hi)
            itemsize = _ITEMSIZE.get(str(info["dtype"]), 1)
            enc = spec["enc"]
            if enc == "raw":
                out[dst] = segment(spec["segments"][0])
            elif enc == "same":
                out[dst] = parent.data(name)
            elif enc == "xor":
                xor = _unplanes(segment(spec["segments"][0]), itemsize)
                out[dst] = np.bitwise_xor(np.frombuffer(parent.data(name), np.uint8), xor).tobytes()
            elif enc == "xor_mag":
                order = _magnitude_order(parent.data(name), str(info["dtype"]))
                if order is None:
                    raise DeltaError(f"tensor {name!r}: xor_mag on a non-float dtype")
                xor_sorted = _unplanes(segment(spec["segments"][0]), itemsize).view(_UINT[itemsize])
                bits = np.frombuffer(parent.data(name), _UINT[itemsize]).copy()
                bits[order] ^= xor_sorted
                out[dst] = bits.tobytes()
            elif enc == "sparse":
                gaps = _unplanes(segment(spec["segments"][0]), 4).view(np.uint32)
                values = _unplanes(segment(spec["segments"][1]), itemsize).view(_UINT[itemsize])
                arr = np.frombuffer(parent.data(name), _UINT[itemsize]).copy()
                arr[np.cumsum(gaps.astype(np.int64)) - 1] = values
                out[dst] = arr.tobytes()
            else:
                raise DeltaError(f"tensor {name!r}: unknown encoding {enc!r}")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        if isinstance(exc, DeltaError):
            raise
        raise DeltaError(f"the delta is malformed ({type(exc).__name__}: {exc})") from None
    result = bytes(out)
    if hashlib.sha256(result).hexdigest() != header["result_sha256"]:
        raise DeltaError("the rebuilt file's sha256 differs from the one the delta promises")
    return result


def describe_delta(blob: bytes) -> dict[str, Any]:
    """Encoding and stored bytes of each tensor (for `flywheel registry show`)."""
    header = read_delta_header(blob)
    return {name: {"enc": spec["enc"], "bytes": sum(s[1] for s in spec.get("segments", []))}
            for name, spec in header["tensors"].items()}  # fmt: skip
