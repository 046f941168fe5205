"""Scalar arguments whose value changes between calls.

fxtrain captures with dynamo's ``specialize_float=True``: a float is a constant of the graph, which
spares the restart of dynamo's analysis that turning floats into graph inputs costs (it doubled the
first step of the DESIGN §7 BERT-MLM). The price is a guard on the value, so an argument that
changes every call (a temperature, a loss weight, a schedule) would recapture every call until the
recompile limit. ``ScalarWatch`` notices such an argument before the call that would recapture, so
that TrainModule captures from then on with ``specialize_float=False``: dynamo then makes the float
a graph input at its next change (its automatic dynamic, as for sizes and ints), and later values
reuse that graph.

Graphs loaded from the on-disk cache have every scalar they were captured with built in and no
dynamo guard of their own on it, so the cache watches ints and floats of the calls it serves.

Only modules called with such arguments pay for a watch (a walk over the arguments per call).
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, Iterator, Tuple, Type

Kinds = Tuple[Type, ...]


def scalar_leaves(args: Tuple[Any, ...], kwargs: Dict[str, Any], kinds: Kinds) -> Tuple[Any, ...]:
    """The values of the given scalar types in a call, in the order ``inputs.schema`` visits them
    (which the call's key fixes); bools are left out: their values are part of the key already."""
    return tuple(_leaves(args, kinds)) + tuple(_leaves(tuple(kwargs.values()), kinds))


def _leaves(value: Any, kinds: Kinds) -> Iterator[Any]:
    if isinstance(value, kinds) and not isinstance(value, bool):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v, kinds)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v, kinds)


class ScalarWatch:
    """The scalar values each input schema was captured (or loaded) with."""

    def __init__(self, kinds: Kinds) -> None:
        self.kinds = kinds
        self.seen: Dict[Hashable, Tuple[Any, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self.seen)

    def values(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
        return scalar_leaves(args, kwargs, self.kinds)

    def record(self, key: Hashable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        values = self.values(args, kwargs)
        if values:
            self.seen[key] = values

    def changed(self, key: Hashable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """True if this call passes other values than those recorded for its schema (a NaN counts as
        a change: what that costs is one recapture)."""
        before = self.seen.get(key)
        return before is not None and self.values(args, kwargs) != before

    def forget(self, key: Hashable) -> None:
        self.seen.pop(key, None)

    def clear(self) -> None:
        self.seen.clear()
