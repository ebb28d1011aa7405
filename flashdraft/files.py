"""The files flashdraft keeps (caches, manifests, markers, checkpoints): written so that no reader ever sees half of
one, and checksummed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` so that a reader, or a run killed meanwhile, sees the old file or the new one whole:
    written beside it under a name of this process (two writers never share one), then renamed over it."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    if isinstance(data, bytes):
        partial.write_bytes(data)
    else:
        partial.write_text(data, encoding="utf-8")
    partial.replace(path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
