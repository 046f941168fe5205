"""CaptureInfo is the one writer of what happened during capture (counts, reasons, reports).

Capture, the cache and the runtime report through its methods (``add``, ``note_call``,
``note_cache``, ``note_python_op``, ``note_fallback``, ``count_dense_batch``); a write to one of its
fields from anywhere else would let two places disagree on what a count means. The check is
syntactic: a field reached through a name ``info`` / ``_info`` (or a ``capture_info()`` call) that
is assigned, augmented, deleted, stored into or has a mutating method called on it.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Optional, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent / "fxtrain"

pytestmark = pytest.mark.cpu_only(reason="source scan (the AST of fxtrain/): no tensors")
WRITER = ROOT / "runtime" / "info.py"
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "remove",
            "discard", "add", "sort", "reverse", "__setitem__", "__delitem__"}


def info_fields() -> Set[str]:
    tree = ast.parse(WRITER.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CaptureInfo")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _is_info(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("info", "_info")
    if isinstance(node, ast.Attribute):
        return node.attr in ("info", "_info")
    return isinstance(node, ast.Call) and _is_info_call(node.func)


def _is_info_call(func: ast.AST) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "capture_info") or \
        (isinstance(func, ast.Name) and func.id == "capture_info")


def _field_in_chain(node: ast.AST, fields: Set[str]) -> Optional[str]:
    """The CaptureInfo field ``node`` reaches (``info.records[-1].reason`` reaches ``records``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr in fields and _is_info(node.value):
            return node.attr
        node = node.value
    return None


def writes(source: str, fields: Set[str], where: str = "<snippet>") -> List[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            target = node
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            target = node.func.value
        else:
            continue
        field = _field_in_chain(target, fields)
        if field is not None:
            found.append(f"{where}:{node.lineno}: writes CaptureInfo.{field}")
    return found


def test_only_capture_info_writes_its_fields():
    fields = info_fields()
    assert {"graphs", "graph_breaks", "python_ops", "cache_log", "dense_batches", "records"} <= fields
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path != WRITER:
            found += writes(path.read_text(), fields, str(path.relative_to(ROOT.parent)))
    assert not found, "\n".join(found)


def test_the_check_finds_each_kind_of_write():
    fields = info_fields()
    bad = ["self._info.graph_breaks += 1", "info.fallback_reason = 'x'", "self.info.cache_log.append('x')",
           "info.break_reasons.extend([])", "self.context.info.dense_batches['r'] = 1",
           "del info.dense_batches['r']", "tm.capture_info().optimizations.update({})",
           "self._info.records[-1].reason = 'why'", "info.python_ops[:] = []"]
    for line in bad:
        assert writes(line, fields), line
    good = ["n = info.graph_breaks + 1", "x = list(self._info.cache_log)", "self._info.add(record)",
            "other.cache_log.append('x')", "info.note_cache('x')", "result.dense_batches = dict(info.dense_batches)",
            "self.info.density.items()"]
    for line in good:
        assert not writes(line, fields), line
