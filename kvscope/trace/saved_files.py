"""The files of a saved trace, each read from disk once.

A load parses a file's bytes and checks their SHA-256 against ``checksums.json``; hashing the
bytes it parsed, rather than reading the file again, saves the second read and checks exactly
what was parsed.
"""
from __future__ import annotations

import hashlib
from pathlib import Path


class SavedFiles:
    """Reads the files of the save in ``path`` and keeps the SHA-256 of the bytes each read gave."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._digests: dict[str, str] = {}

    def read(self, name: str) -> bytes:
        """The bytes of file ``name`` of the save (``OSError`` as ``Path.read_bytes`` raises it)."""
        data = (self.path / name).read_bytes()
        self._digests[name] = hashlib.sha256(data).hexdigest()
        return data

    def digest(self, name: str) -> str:
        """The SHA-256 of file ``name`` as it was read, or as it is now if it was not."""
        if name not in self._digests:
            self.read(name)
        return self._digests[name]
