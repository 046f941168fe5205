"""``fxtrain cache ls|clear``: what the on-disk cache holds, and emptying it."""
from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

from ..report import format_table
from .store import Store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("ls", "clear"), help="ls: list entries with their sizes; clear: delete them")
    p.add_argument("--dir", dest="directory", default=os.environ.get("FXTRAIN_CACHE_DIR"),
                   help="the cache directory (default: $FXTRAIN_CACHE_DIR)")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def run(args: argparse.Namespace) -> int:
    if not args.directory:
        raise ValueError("no cache directory: pass --dir or set FXTRAIN_CACHE_DIR")
    root = Path(args.directory).expanduser()
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory")
    store = Store(root)
    if args.action == "clear":
        count, freed = store.clear()
        print(f"removed {count} file(s), {_size(freed)} from {root}")
        return 0
    entries = store.entries()
    rows = []
    for e in entries:
        h = e.header
        created = datetime.datetime.fromtimestamp(h["created"]).strftime("%Y-%m-%d %H:%M") if "created" in h else "-"
        rows.append([e.key[:12], h.get("model", "?"), h.get("mode", "?"), h.get("nodes", "-"), _size(e.size),
                     created, f"torch {h.get('torch', '?')}" if "error" not in h else f"unreadable: {h['error']}"])
    print(f"{root}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
          f"{_size(sum(e.size for e in entries))}")
    if rows:
        print(format_table(["key", "model", "mode", "nodes", "size", "created", "versions"], rows))
    return 0
