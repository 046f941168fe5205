"""Activation-checkpointed regions opened for the passes, with the recompute torch gives them.

``model.gradient_checkpointing_enable()`` (HF; ``torch.utils.checkpoint`` under it) is how a model
too large for a GPU's memory trains there: each layer's activations are recomputed in the backward
instead of kept. Dynamo records each checkpointed layer as one opaque call on a body graph
(``torch_private.CHECKPOINT_OP``), and to the row passes that call is a wall: padding elimination
stopped at the first layer ("padding rows reach tag_activation_checkpoint") and was off for every
model trained this way.

What the call means is only what torch does with it when AOTAutograd traces it: the body's ops
run with two tags (``recompute``, and one ``ac_graph_id`` per region), which the partitioner reads
to recompute them in the backward. :func:`open_checkpoints` does that step before the passes: each
body's nodes replace the call in the graph, tagged as torch tags them, so the passes see the
layers and the partitioner still recomputes them (a 4-layer BERT-MLM with padding elimination
keeps 5.8 MiB for its backward, 18.6 MiB unchecked: tests/test_checkpointing.py). Ops a pass adds inside a region (the
variable-length attention that replaces a layer's padded one) join that region
(:func:`tag_added`): left untagged, the partitioner would save their outputs, one tensor per layer
the user's checkpointing meant to drop. After the passes :func:`close_checkpoints` puts each region
back into one call of torch's op, on a body of its ops as the passes left them: the graph that
leaves the passes stage means what dynamo's meant, and the eager executor runs each call as
``torch.utils.checkpoint`` (runtime/checkpointed.py).

A selective checkpoint (``context_fn``: its policy tags each op as it runs) stays whole, as does
a body this does not read (a module attribute, a nested call): the passes then stop at it as before.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

import torch
import torch.fx

from .. import torch_private as tp
from ..errors import Error
from ..runtime.step import PassReport

NAME = "checkpointed_regions"
Node = torch.fx.Node
_RANDOM = {torch.nn.functional.dropout, torch.dropout, torch.rand, torch.randn, torch.randint, torch.rand_like,
           torch.randn_like, torch.bernoulli, torch.multinomial, torch.normal}
# The keyword arguments dynamo leaves on the call: checkpoint's own (torch.utils.checkpoint.checkpoint).
_CHECKPOINT_KWARGS = {"use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop"}


def _why_whole(gm: torch.fx.GraphModule, call: Node) -> Optional[str]:
    """Why the region ``call`` stays one opaque call, or None where its body can be opened."""
    attr = call.args[0] if call.args else None
    body = getattr(gm, attr.target, None) if isinstance(attr, Node) and attr.op == "get_attr" else None
    if not isinstance(body, torch.fx.GraphModule):
        return "a checkpointed region without a body graph"
    if tp.checkpoint_context_fn(body) is not None:
        return "a selective checkpoint (context_fn) tags its ops as they run"
    if set(call.kwargs) - _CHECKPOINT_KWARGS:
        return f"a checkpointed region called with {sorted(set(call.kwargs) - _CHECKPOINT_KWARGS)}"
    nodes = list(body.graph.nodes)
    if any(n.op not in ("placeholder", "call_function", "call_method", "output") or
           tp.is_checkpoint_call(n) for n in nodes):
        return "a checkpointed region whose body reads module attributes or nests another"
    if sum(n.op == "placeholder" for n in nodes) != len(call.args) - 1:
        return "a checkpointed region called with other arguments than its body takes"
    outputs = nodes[-1].args[0]
    if not isinstance(outputs, (tuple, list)) or not all(isinstance(o, Node) for o in outputs) or any(
            u.target is not operator.getitem or not isinstance(u.args[1], int) for u in call.users):
        return "a checkpointed region whose outputs are not a tuple of tensors read by index"
    return None


def _random(node: Node) -> bool:
    """A torch-level op drawing random numbers (dropout, ``torch.rand``...): FX's own purity test
    knows the aten ops only."""
    return node.op == "call_function" and (tp.draws_random_numbers(node) or node.target in _RANDOM)


def _inline(gm: torch.fx.GraphModule, call: Node, body: torch.fx.GraphModule, region: int) -> None:
    graph = gm.graph
    env: Dict[Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, call.args[1:]))
    outputs: List[Node] = []
    with graph.inserting_before(call):
        for n in body.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = [env[o] for o in n.args[0]]
                break
            copy = graph.node_copy(n, lambda x: env[x])
            tp.tag_recompute(copy, region)
            env[n] = copy
    for user in list(call.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    # Dynamo leaves dead size reads in a body (``hidden.size()[2]``, read by nothing); in the graph
    # they would read the padded rows, which padding elimination refuses.
    for copy in reversed([env[n] for n in body.graph.nodes if n in env and n.op != "placeholder"]):
        if not copy.users and not copy.is_impure() and not _random(copy):
            graph.erase_node(copy)
    attr = call.args[0]
    graph.erase_node(call)
    if not attr.users:
        graph.erase_node(attr)   # the body stays an attribute: a copy of the graph made before may name it


@dataclass
class OpenRegions:
    """What :func:`open_checkpoints` did: its report, and each opened region's id and the keyword
    arguments of its call, which :func:`close_checkpoints` gives the call it makes again."""

    report: PassReport
    calls: Dict[int, Dict[str, Any]] = field(default_factory=dict)


def has_checkpoints(gm: torch.fx.GraphModule) -> bool:
    return any(tp.is_checkpoint_call(n) for n in gm.graph.nodes)


def open_checkpoints(gm: torch.fx.GraphModule) -> OpenRegions:
    """Replace each checkpointed region's call by its body's ops, tagged for recomputation."""
    calls = [n for n in gm.graph.nodes if tp.is_checkpoint_call(n)]
    if not calls:
        return OpenRegions(PassReport(NAME, False, "no activation checkpointing"))
    for call in calls:
        why = _why_whole(gm, call)
        if why is not None:   # all or none: torch numbers the regions it traces itself after these
            return OpenRegions(PassReport(NAME, False, f"{why}: {len(calls)} region(s) left whole, "
                                                       f"the passes stop at them"))
    opened = OpenRegions(PassReport(NAME, True, f"{len(calls)} checkpointed region(s) opened to the passes, "
                                                f"their ops recomputed in the backward as checkpointing does"))
    for call in calls:   # in program order: the partitioner compares region ids
        region = tp.new_checkpoint_region()
        opened.calls[region] = dict(call.kwargs)
        _inline(gm, call, getattr(gm, call.args[0].target), region)
    gm.graph.lint()
    gm.recompile()
    return opened


def tag_added(gm: torch.fx.GraphModule, before: Set[Node]) -> int:
    """Tag the ops the passes added (those not in ``before``) that sit inside one checkpointed
    region: every input from that region (or from outside all regions) and every user in it. An
    op between two regions, or feeding an untagged one (the re-padding after the last layer),
    stays outside. Returns how many were tagged."""
    nodes = list(gm.graph.nodes)
    inside: Dict[Node, int] = {}
    for n in nodes:   # candidates: added ops reading one region
        if n in before or n.op not in ("call_function", "call_method") or tp.recompute_region(n) is not None:
            continue
        regions = {tp.recompute_region(a) if tp.recompute_region(a) is not None else inside.get(a)
                   for a in n.all_input_nodes} - {None}
        if len(regions) == 1:
            inside[n] = regions.pop()
    for n in reversed(nodes):   # users first: a candidate stays when all its users are in its region
        if n in inside and (not n.users or any(
                (tp.recompute_region(u) if tp.recompute_region(u) is not None else inside.get(u)) != inside[n]
                for u in n.users)):
            del inside[n]
    for n, region in inside.items():
        tp.tag_recompute(n, region)
    return len(inside)


class NotConvex(Error):
    """A region the passes left with an op outside it between two of its ops that cannot join it."""


def close_checkpoints(gm: torch.fx.GraphModule, opened: OpenRegions) -> None:
    """Put each opened region back into one call of torch's region op, on a body made of its ops
    as the passes left them (their tags dropped: torch tags the body's ops again when it traces
    the call). The graph then means what dynamo's meant, region for region: the eager executor runs
    each call as ``torch.utils.checkpoint`` (runtime/checkpointed.py), AOTAutograd as torch traces
    it. An op outside a region that reads it and feeds it again (none on the models tested) joins
    it where it is pure; one that is not raises NotConvex."""
    members: Dict[int, List[Node]] = {}
    for n in gm.graph.nodes:
        region = tp.recompute_region(n)
        if region in opened.calls:
            members.setdefault(region, []).append(n)
    for index, (region, nodes) in enumerate(members.items()):
        _outline(gm, _convex(gm, nodes), opened.calls[region], index)
    gm.graph.lint()
    gm.recompile()


def _convex(gm: torch.fx.GraphModule, nodes: List[Node]) -> List[Node]:
    """``nodes`` with the ops between them: those reading one of them and read by one."""
    inside = set(nodes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first, last = order[nodes[0]], order[nodes[-1]]
    span = [n for n in gm.graph.nodes if first < order[n] < last and n not in inside]
    downstream = set(inside)
    for n in span:
        if any(a in downstream for a in n.all_input_nodes):
            downstream.add(n)
    upstream = set(inside)
    for n in reversed(span):
        if any(u in upstream for u in n.users):
            upstream.add(n)
    between = [n for n in span if n in downstream and n in upstream]
    impure = [n for n in between if n.is_impure() or _random(n)]
    if impure:
        raise NotConvex(f"{impure[0].format_node()} reads a checkpointed region and feeds it")
    return sorted(inside.union(between), key=order.__getitem__)


def _outline(gm: torch.fx.GraphModule, nodes: List[Node], kwargs: Dict[str, Any], index: int) -> None:
    graph, inside = gm.graph, set(nodes)
    inputs: List[Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    body_graph = torch.fx.Graph()
    env: Dict[Node, Node] = {}
    for a in inputs:
        env[a] = body_graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = body_graph.node_copy(n, env.__getitem__)
        tp.untag_recompute(env[n])
    body_graph.output(tuple(env[o] for o in outputs))
    name = f"fxtrain_checkpoint_body_{index}"
    gm.add_submodule(name, torch.fx.GraphModule(torch.nn.Module(), body_graph))
    with graph.inserting_after(nodes[-1]):
        attr = graph.get_attr(name)
    with graph.inserting_after(attr):
        call = graph.call_function(tp.CHECKPOINT_OP, (attr, *inputs), dict(kwargs))
    call.meta["example_value"] = tuple(o.meta.get("example_value") for o in outputs)
    last = call
    for i, o in enumerate(outputs):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (call, i))
        last.meta = dict(o.meta)
        tp.untag_recompute(last)
        o.replace_all_uses_with(last, delete_user_cb=lambda user: user not in inside)
    # An op outside the region that sat between its ops and reads its outputs moves after the call.
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved: Set[Node] = set(call.users)
    later = [n for n in graph.nodes if order[nodes[0]] < order[n] < order[call] and n not in inside]
    tail = last
    for n in later:
        if any(a in moved for a in n.all_input_nodes):
            moved.add(n)
            tail.append(n)
            tail = n
    for n in reversed(nodes):
        graph.erase_node(n)
