"""Entries on disk: one file per key, written atomically, checked before use.

File layout: a magic line, a JSON header (what ``fxtrain cache ls`` shows, readable without
unpickling anything), the sha256 of the payload, the payload. A writer fills a private temporary
file in the same directory and renames it over the entry: readers and concurrent writers see the
old file or a complete new one, never a mix (rename is atomic on POSIX and Windows). A reader that
finds a short, garbled or foreign file reports it corrupt; the caller recaptures and rewrites it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from ..errors import Error

logger = logging.getLogger("fxtrain")

MAGIC = b"FXTRAIN-CACHE 1\n"
SUFFIX = ".fxc"
_warned: Set[str] = set()
_warn_lock = threading.Lock()


class CorruptEntry(Error):
    """The file for a key exists but is not a complete entry written by this format."""


@dataclass
class EntryFile:
    key: str
    path: Path
    size: int
    header: Dict[str, Any]


def warn_once(tag: str, message: str, *args: Any) -> None:
    """One warning per process for a given problem (a run may call the cache thousands of times)."""
    with _warn_lock:
        if tag in _warned:
            return
        _warned.add(tag)
    logger.warning(message, *args)


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def open(directory: str) -> Optional["Store"]:
        """The store at ``directory``, or None (with one warning) if it cannot be used."""
        root = Path(directory).expanduser()
        if not root.is_dir():
            warn_once(f"missing:{root}", "fxtrain: cache directory %s does not exist (create it to use the cache); "
                      "running without the cache", root)
            return None
        try:  # a real write: permission bits say nothing about read-only mounts or root
            fd, probe = tempfile.mkstemp(prefix=".probe.", suffix=".tmp", dir=root)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            warn_once(f"readonly:{root}", "fxtrain: cache directory %s is not writable (%s); running without the "
                      "cache", root, e.strerror or e)
            return None
        return Store(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def write(self, key: str, header: Dict[str, Any], payload: bytes) -> Path:
        head = json.dumps(header, sort_keys=True, default=str).encode()
        blob = b"".join([MAGIC, struct.pack("<Q", len(head)), head, hashlib.sha256(payload).digest(),
                         struct.pack("<Q", len(payload)), payload])
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return self.path(key)

    def read(self, key: str) -> Optional[Tuple[Dict[str, Any], bytes]]:
        """(header, payload) of the entry, None if there is none; raises CorruptEntry."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CorruptEntry(f"cannot read {path}: {e}") from e
        return _parse(data, path)

    def entries(self) -> List[EntryFile]:
        found = []
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            try:
                size = path.stat().st_size
                with open(path, "rb") as f:
                    header = _read_header(f.read(1 << 20), path)
            except (OSError, CorruptEntry) as e:
                header = {"error": str(e)}
                size = path.stat().st_size if path.exists() else 0
            found.append(EntryFile(path.name[:-len(SUFFIX)], path, size, header))
        return found

    def remove(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def clear(self) -> Tuple[int, int]:
        """Delete every entry (and stray temporary files); returns (files, bytes) freed."""
        count = freed = 0
        for path in list(self.root.glob(f"*{SUFFIX}")) + list(self.root.glob(".*.tmp")):
            try:
                size = path.stat().st_size
                path.unlink()
            except OSError:
                continue
            count, freed = count + 1, freed + size
        return count, freed


def _read_header(data: bytes, path: Path) -> Dict[str, Any]:
    if not data.startswith(MAGIC):
        raise CorruptEntry(f"{path.name}: not an fxtrain cache entry (bad magic)")
    at = len(MAGIC)
    if len(data) < at + 8:
        raise CorruptEntry(f"{path.name}: truncated header")
    (n,) = struct.unpack_from("<Q", data, at)
    at += 8
    if len(data) < at + n:
        raise CorruptEntry(f"{path.name}: truncated header")
    try:
        return json.loads(data[at:at + n])
    except ValueError as e:
        raise CorruptEntry(f"{path.name}: garbled header ({e})") from e


def _parse(data: bytes, path: Path) -> Tuple[Dict[str, Any], bytes]:
    header = _read_header(data, path)
    (n_head,) = struct.unpack_from("<Q", data, len(MAGIC))
    at = len(MAGIC) + 8 + n_head
    if len(data) < at + 32 + 8:
        raise CorruptEntry(f"{path.name}: truncated before the payload")
    digest = data[at:at + 32]
    (n,) = struct.unpack_from("<Q", data, at + 32)
    payload = data[at + 40:]
    if len(payload) != n:
        raise CorruptEntry(f"{path.name}: payload is {len(payload)} bytes, expected {n} (truncated?)")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptEntry(f"{path.name}: payload checksum mismatch (garbled)")
    return header, payload
