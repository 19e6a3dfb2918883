"""What a checkpoint's files hold, checked: per-range digests written and verified through DCP.

[Note: integrity]
DCP reads whatever bytes the files hold: a flipped byte inside a tensor's data, or a file copied
in from another save of the same model, loads without an error. So every byte range DCP writes
(one per tensor chunk or object, tiling each file; any gap is hashed as its own range) gets a
digest (zlib's CRC-32 by default, hashlib's SHA-256 with ``digest="sha256"``; each value names
its algorithm), recorded in the marker with each file's size and the ``.metadata`` file's
digest. On load every rank checks ``.metadata`` (digest, and that its save identifier is the
marker's) before DCP starts, and each range's digest as DCP reads it, before its bytes reach a
tensor, so verification costs one hash of exactly the bytes read (no extra reads). A mismatch is
raised on every rank, naming the file, the byte range and the ranks that read it (DCP gathers
every rank's read errors); the state dict may then hold some values already loaded: do not use
it. ``load_checkpoint(verify=False)`` skips the digests; ``verify_checkpoint(path)`` checks every
byte of a checkpoint in one process. CRC-32 catches damage and foreign files (a changed range
keeps its CRC with probability 2^-32); SHA-256 also resists deliberate forgery, at about 3x the
hashing time.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from fsdp_engine._private.checkpoint_errors import CheckpointIntegrityError

__all__ = [
    "DIGESTS",
    "algorithm_of",
    "digest_bytes",
    "file_record",
    "gather_digests",
    "DigestingWriter",
    "VerifyingReader",
]

_CHUNK = 1 << 22  # bytes hashed per read
DIGESTS = ("crc32", "sha256")


class _Crc32:
    """zlib's CRC-32 behind hashlib's ``update`` / ``hexdigest``."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _hasher(algorithm: str) -> Any:
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checkpoint digest {algorithm!r}: expected one of {DIGESTS}")


def digest_bytes(algorithm: str, data: bytes) -> str:
    """``"<algorithm>:<hex>"`` of ``data``: each recorded value names how it was made."""
    hasher = _hasher(algorithm)
    hasher.update(data)
    return f"{algorithm}:{hasher.hexdigest()}"


def _hash_range(fh: IO[bytes], offset: int, length: int, algorithm: str) -> str:
    """The digest of ``length`` bytes at ``offset`` (of fewer, if the file is shorter)."""
    fh.seek(offset)
    hasher = _hasher(algorithm)
    remaining = length
    while remaining > 0:
        chunk = fh.read(min(remaining, _CHUNK))
        if not chunk:
            break
        hasher.update(chunk)
        remaining -= len(chunk)
    return f"{algorithm}:{hasher.hexdigest()}"


def _tiling(ranges: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The written ``(offset, length)`` ranges plus the gaps between them, covering
    ``[0, size)``: every byte of the file belongs to exactly one hashed range."""
    pieces: list[tuple[int, int]] = []
    position = 0
    for offset, length in sorted(set(ranges)):
        if offset > position:
            pieces.append((position, offset - position))
        pieces.append((offset, length))
        position = max(position, offset + length)
    if position < size:
        pieces.append((position, size - position))
    return pieces


def file_record(path: Path, ranges: Sequence[tuple[int, int]], algorithm: str) -> dict[str, Any]:
    """``{"size", "items": [[offset, length, digest], ...], "digest"}`` of one file; the file's
    digest is the SHA-256 of its item list (which covers every byte)."""
    size = path.stat().st_size
    items = []
    with path.open("rb") as fh:
        for offset, length in _tiling(ranges, size):
            items.append([offset, length, _hash_range(fh, offset, length, algorithm)])
    listing = json.dumps(items, separators=(",", ":")).encode()
    return {"size": size, "items": items, "digest": digest_bytes("sha256", listing)}


def algorithm_of(record: Mapping[str, Any]) -> str:
    items = record.get("items") or [[0, 0, "crc32:"]]
    return str(items[0][2]).split(":", 1)[0]


class DigestingWriter(FileSystemWriter):
    """DCP's filesystem writer that records the save identifier in ``.metadata`` and, after
    writing this rank's files, the digests of every byte range it wrote."""

    def __init__(self, path: Path, save_id: str, algorithm: str) -> None:
        super().__init__(path)
        self.save_id = save_id  # DCP puts it into .metadata (storage_meta.save_id)
        self.algorithm = algorithm
        self.digests: dict[str, dict[str, Any]] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        ranges: dict[str, list[tuple[int, int]]] = {}
        for result in future.wait():
            info = result.storage_data
            ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
        root = Path(self.path)
        self.digests = {
            name: file_record(root / name, r, self.algorithm) for name, r in ranges.items()
        }
        return future


def gather_digests(
    writer: DigestingWriter, group: dist.ProcessGroup | None
) -> dict[str, dict[str, Any]]:
    """Every rank's file digests, merged, on rank 0 (empty elsewhere)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(writer.digests)
    rank = dist.get_rank(group)
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(writer.digests, gathered, group=group, group_dst=0)
    merged: dict[str, dict[str, Any]] = {}
    for part in gathered or ():
        merged.update(part)
    return merged


class VerifyingReader(FileSystemReader):
    """DCP's filesystem reader that hands DCP the (already verified) metadata and checks every
    byte range against its recorded digest as it is read (``files=None``: no checks)."""

    def __init__(
        self, path: Path, metadata: Metadata, files: Mapping[str, Any] | None, save_id: str
    ) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._files = files
        self._save_id = save_id
        self._sized: set[str] = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata: never written by save_checkpoint
            raise FileNotFoundError(f"{str(self.path)!r} has no per-rank DCP metadata")
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        view = super()._slice_file(file, sinfo)
        if self._files is None:
            return view
        name = str(sinfo.relative_path)
        where = f"{name!r} in {str(self.path)!r}"
        record = self._files.get(name)
        if record is None:
            raise CheckpointIntegrityError(
                f"{where} is not a file of save {self._save_id} (its marker does not list it)"
            )
        if name not in self._sized:
            size = os.fstat(file.fileno()).st_size
            if size != record["size"]:
                raise CheckpointIntegrityError(
                    f"{where} has {size} bytes, but save {self._save_id} wrote {record['size']}: "
                    f"it is truncated, extended or from another save"
                )
            self._sized.add(name)
        items = {(int(o), int(n)): str(d) for o, n, d in record["items"]}
        expected = items.get((int(sinfo.offset), int(sinfo.length)))
        data = view.read()
        span = f"bytes [{sinfo.offset}, {sinfo.offset + sinfo.length})"
        if expected is None:
            raise CheckpointIntegrityError(
                f"{where}: {span} were not written as one range by save {self._save_id}: "
                f"the .metadata and the marker disagree"
            )
        algorithm = expected.split(":", 1)[0]
        if len(data) != sinfo.length or digest_bytes(algorithm, data) != expected:
            raise CheckpointIntegrityError(
                f"{where}: {span} do not match the digest recorded when save {self._save_id} "
                f"was committed: the file is damaged or comes from another save"
            )
        return io.BytesIO(data)
