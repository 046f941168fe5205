"""Which graph breaks a TrainModule call caused, counted whatever dynamo files them under.

Dynamo keeps its break messages in process-global counters: a break it compiles around goes to
``counters["graph_break"]``, one it meets while deciding a branch on a data-dependent value (HF
DeBERTa's loss branching on ``nonzero().size(0)``) stays in ``counters["unimplemented"]``, and the
totals are shared by every model in the process. A call's own breaks are therefore the difference of
both counters across the call, less what the calls of other TrainModules nested inside it filed.

The counters only move while dynamo converts a frame, and every conversion bumps
dynamo's frame counter (``torch_private.dynamo_frame_counter``) first, so a call that converted nothing costs two integer reads:
the before-image of the counters is copied only after a conversion happened somewhere.

``torch._dynamo.reset()`` sets the frame counter back to 0 but leaves the message counters as they
are: an image keyed by a count the counter reaches again after a reset would pass for current and
hand a fresh module the breaks of one that ran before. So every window that saw conversions leaves
the image as of its end (the tally it computed anyway): after a reset the counter no longer matches
it, and the next window takes a new image.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..torch_private import dynamo_counters, dynamo_frame_counter
from . import untraceable_ops

_CATEGORIES = ("graph_break", "unimplemented")
_TALLY = Dict[str, int]


counters = dynamo_counters()
_conversions = dynamo_frame_counter()


def _tally() -> _TALLY:
    """Every break message dynamo has filed, summed over the categories it may sit in: a message
    moved from "unimplemented" to "graph_break" while dynamo handles it counts once."""
    total: _TALLY = {}
    for category in _CATEGORIES:
        for message, n in counters[category].items():
            total[message] = total.get(message, 0) + n
    return total


class _Ledger(threading.local):
    """Per thread: the counters as of the last conversion seen, and the breaks nested calls claimed."""

    def __init__(self) -> None:
        self.image: Tuple[int, _TALLY] = (-1, {})
        self.claims: List[_TALLY] = []
        self.depth = 0


_ledger = _Ledger()


@dataclass
class Window:
    """One TrainModule call, as seen by the break counters."""

    conversions: int
    before: _TALLY
    claims_at: int


def open_window() -> Window:
    now = _conversions()
    ledger = _ledger
    if ledger.image[0] != now:
        ledger.image = (now, _tally())
    ledger.depth += 1
    return Window(now, ledger.image[1], len(ledger.claims))


def close_window(window: Window) -> _TALLY:
    """The break messages (with counts) filed during the window by this call itself. Must be
    called once per ``open_window``, failure or not (nested windows close first)."""
    ledger = _ledger
    ledger.depth -= 1
    own: _TALLY = {}
    now = _conversions()
    if now != window.conversions:
        nested: collections.Counter = collections.Counter()
        for claim in ledger.claims[window.claims_at:]:
            nested.update(claim)
        tally = _tally()
        for message, n in tally.items():
            filed = n - window.before.get(message, 0) - nested.get(message, 0)
            if filed > 0:
                own[message] = filed
        if own:
            ledger.claims.append(own)
        ledger.image = (now, tally)
    if ledger.depth == 0:
        ledger.claims.clear()
    return own


# --------------------------------------------------------------------------------- reasons
def summary(message: str) -> str:
    """Dynamo's multi-line break message as one line: what broke, and its explanation (fxtrain's
    own where fxtrain made dynamo break: untraceable_ops.py)."""
    own = untraceable_ops.explain(message)
    if own is not None:
        return own
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "graph break (no message)"
    head = lines[0]
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
    return f"{head}: {explanation[len('Explanation:'):].strip()}" if explanation else head


def graph_break_site(gm: Any) -> Optional[Tuple[str, str]]:
    """(dynamo's reason, 'file:line in function') when the graph ends at a break, else None.

    Dynamo stores why it compiled a graph on the GraphModule it hands the backend; it is this
    module's graph by construction, which the global counters are not.
    """
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    stack = list(getattr(reason, "user_stack", None) or [])
    where = ""
    if stack:
        frame = stack[-1]
        where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"
    return str(reason.reason).strip().splitlines()[0] if str(reason.reason).strip() else "graph break", where


def call_breaks(filed: _TALLY, sites: Sequence[Tuple[str, str]], graphs_made: int) -> List[str]:
    """One reason per break of a call that captured.

    Three witnesses, each of which can miss a break the others see: the messages filed in the
    counters (a break before any op makes no graph), the graphs that end at a break (a message filed
    elsewhere), and the number of graphs (k graphs in one call are k-1 breaks). The call has as many
    breaks as the largest of them says. Messages count once each: dynamo files a break inside an
    inlined function once for every frame it tries (the entry function, then the model's forward).
    A message and a site are paired when they are the same text or, failing that, in order, so that
    a reason says where the break is whenever dynamo did.
    """
    messages = list(filed)
    count = max(len(messages), len(sites), graphs_made - 1, 0)
    sites = list(sites)
    reasons: List[str] = []
    for message in messages:
        match = next((s for s in sites if s[0] == message), None)
        site = match if match is not None else (sites[0] if sites else None)
        if site is not None:
            sites.remove(site)
        reasons.append(summary(message) + (f" (at {site[1]})" if site and site[1] else ""))
    reasons.extend(text + (f" (at {where})" if where else "") for text, where in sites)
    while len(reasons) < count:
        reasons.append("graph split without a reason from dynamo")
    return reasons[:count]
