"""Attention written out in eager ops (transformers' ``eager_attention_forward``), found as one unit.

Families whose attention transformers runs only in eager ops (Gemma 2's logit softcapping, GPT-J)
and every model a user sets to ``attn_implementation="eager"`` compute attention as

    scores = matmul(q, k.transpose(-2, -1))     # [batch, heads, seq, seq]
    scores = f(scores)                          # each score alone: * scale, / cap, tanh, * cap, casts
    weights = softmax(scores + mask, dim=-1)    # then casts, dropout
    out = matmul(weights, v)

gpt-oss adds a learned "sink" logit per head as one more column before the softmax and drops its
weight after: ``x = cat([scores + mask, sinks], -1); softmax(x - x.max(-1, keepdim=True)[0])[..., :-1]``.

A plain block (scores scaled by numbers and cast, no cap, no sink, no acting dropout) is the SDPA
it computes (:meth:`EagerAttention.sdpa_equivalent`), and padding elimination runs it sequence by
sequence as one (passes/varlen.py). Around any other, padding elimination re-pads q, k and v as
it does around an SDPA it cannot replace: zeros at the padding positions instead of eager's values
there. That gives eager's numbers
at every real query only if a padding key gets weight exactly 0 whatever its value, which is why
:func:`find` accepts this form and no other: the additive mask is the last op before the softmax
(a mask applied before a ``tanh`` would be capped to ``-cap`` and leave padding keys a weight), the
ops between the first matmul and the mask act on each score alone with constant operands, and only
casts and dropout sit between the softmax and the second matmul. The sink form keeps that: its
extra column and the row max it subtracts are finite, so a hidden key's logit stays at the mask's
value, its weight 0, and the slice drops only the sink's column. Whether the mask hides every
padding key (``-inf`` or its dtype's lowest value, where ``exp`` underflows to exactly 0) is the
caller's check on the capturing batch, as for SDPA's mask.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F

from .rows import Node, op_name, value
from .varlen import Attention

_MATMUL = {torch.matmul, operator.matmul}
_SOFTMAX_FUNCTIONS = {F.softmax, torch.softmax}
# Score-wise ops between the first matmul and the mask: the other operand a constant.
_SCALE_FUNCTIONS = {operator.mul, operator.truediv, torch.mul, torch.div}
_SCALE_METHODS = {"mul", "div"}
_UNARY_FUNCTIONS = {torch.tanh}
_UNARY_METHODS = {"tanh"}
_CAST_METHODS = {"to", "float", "half", "bfloat16", "double", "contiguous"}
_ADD = {operator.add, torch.add}


@dataclass
class EagerAttention:
    """One matched block: ``scores`` is ``matmul(q, k^T)``, ``out`` is ``matmul(weights, v)``,
    ``mask`` the additive mask, ``nodes`` the block's own nodes from ``scores`` to ``out``;
    ``score_ops`` the score-wise ops between the first matmul and the mask, ``around`` the sink
    column or row max around the softmax, ``tail`` what sits between the softmax and ``out``."""

    scores: Node
    out: Node
    mask: Node
    nodes: List[Node] = field(default_factory=list)
    score_ops: List[Node] = field(default_factory=list)
    around: List[Node] = field(default_factory=list)
    tail: List[Node] = field(default_factory=list)

    def inputs(self) -> Dict[Node, Tuple[int, ...]]:
        """Where q, k (transposed) and v enter: node -> argument positions."""
        return {self.scores: (0, 1), self.out: (1,)}

    def sdpa_equivalent(self) -> Tuple[Optional[Attention], str]:
        """This block as the SDPA call it computes, ``(attention, "")``, or ``(None, why not)``.

        Only a plain block qualifies: scores scaled by numbers and cast, no sink column, no row max,
        no cap, and no dropout that acts (``p`` 0 or ``training`` False). Its softmax over
        ``scale * q.k + mask`` is then exactly SDPA's with that float mask, so the varlen rewrite
        can run it on each sequence's real tokens as one kernel call per layer and direction
        (passes/varlen.py), where the re-padded block costs ``batch * seq**2`` in four kernels or
        more. Read from the graph as it is when called: the padding rewrite changes the block's inputs."""
        if self.around:
            return None, "its softmax has a sink column or subtracts a row max"
        scale = 1.0
        for node in self.score_ops:
            if _cast_of(node) is not None:
                continue
            if node.target in _UNARY_FUNCTIONS or node.target in _UNARY_METHODS:
                return None, f"its scores pass through {op_name(node)} (a cap) before the mask"
            number = [a for a in node.args if not isinstance(a, Node)]
            if len(number) != 1 or not isinstance(number[0], (int, float)) or isinstance(number[0], bool):
                return None, "its scores are scaled by a tensor"
            divides = node.target in (operator.truediv, torch.div, "div")
            scale = scale / number[0] if divides else scale * number[0]
        for node in self.tail:
            if _is_dropout(node, node.args[0]) and not _dropout_inactive(node):
                return None, "attention dropout is on (its mask over the padded layout has no per-sequence form)"
        k_t = self.scores.args[1]
        if not (isinstance(k_t, Node) and _last_two_swapped(k_t)):
            return None, "its keys are not transposed in the graph"
        own = list(reversed(self.nodes)) + ([k_t] if list(k_t.users) == [self.scores] else [])
        return Attention(self.out, {"query": self.scores.args[0], "key": k_t.args[0], "value": self.out.args[1],
                                    "attn_mask": self.mask, "dropout_p": 0.0, "is_causal": False, "scale": scale,
                                    "enable_gqa": False}, own), ""


def find(gm: torch.fx.GraphModule) -> List[EagerAttention]:
    """Every eager attention block of ``gm`` (see the module docstring)."""
    found = []
    for node in gm.graph.nodes:
        if _is_softmax(node):
            block = _match(node)
            if block is not None:
                found.append(block)
    return found


def _is_softmax(node: Node) -> bool:
    if node.op == "call_function" and node.target in _SOFTMAX_FUNCTIONS:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    elif node.op == "call_method" and node.target == "softmax":
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    else:
        return False
    x = value(node.args[0]) if node.args else None
    return isinstance(x, torch.Tensor) and x.dim() == 4 and isinstance(dim, int) and dim in (-1, 3) \
        and not (set(node.kwargs) - {"dim", "dtype", "_stacklevel"})


def _constant(a: Any) -> bool:
    """A number, or a one-element tensor (GPT-J's ``scale_attn`` buffer): the same for every score."""
    if isinstance(a, (int, float)):
        return True
    return isinstance(a, Node) and isinstance(value(a), torch.Tensor) and value(a).numel() == 1


def _score_wise(node: Node) -> Optional[Node]:
    """The scores ``node`` reads, if it acts on each score alone; else None."""
    if node.op == "call_function" and node.target in _SCALE_FUNCTIONS and len(node.args) == 2 and not node.kwargs:
        x, c = node.args
        if node.target in (operator.mul, torch.mul) and isinstance(c, Node) and not _constant(c) and _constant(x):
            x, c = c, x
        return x if isinstance(x, Node) and _constant(c) else None
    if node.op == "call_method" and node.target in _SCALE_METHODS and len(node.args) == 2 and not node.kwargs:
        return node.args[0] if _constant(node.args[1]) else None
    if (node.op == "call_function" and node.target in _UNARY_FUNCTIONS
            or node.op == "call_method" and node.target in _UNARY_METHODS) and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    return _cast_of(node)


def _cast_of(node: Node) -> Optional[Node]:
    """The tensor a dtype cast (or ``contiguous``) reads; None for anything else."""
    if node.op != "call_method" or node.target not in _CAST_METHODS:
        return None
    extra = list(node.args[1:]) + list(node.kwargs.values())
    if not all(isinstance(a, torch.dtype) for a in extra):
        return None
    return node.args[0]


def _only_user(node: Node, user: Node) -> bool:
    return list(node.users) == [user]


def _row_max_subtracted(node: Node) -> Optional[Tuple[Node, List[Node]]]:
    """``x - x.max(dim=-1, keepdim=True)[0]``: (x, the nodes after it), else None."""
    if node.op != "call_function" or node.target not in (operator.sub, torch.sub) or len(node.args) != 2 \
            or node.kwargs:
        return None
    x, m = node.args
    if not isinstance(x, Node) or not isinstance(m, Node) or m.op != "call_function" or m.target is not operator.getitem \
            or m.args[1] != 0 or not _only_user(m, node):
        return None
    mx = m.args[0]
    dim = mx.kwargs.get("dim", mx.args[1] if len(mx.args) > 1 else None)
    keep = mx.kwargs.get("keepdim", mx.args[2] if len(mx.args) > 2 else False)
    if not (mx.op == "call_method" and mx.target == "max" or mx.op == "call_function" and mx.target is torch.max) \
            or mx.args[0] is not x or dim not in (-1, 3) or keep is not True or set(x.users) != {mx, node}:
        return None
    return x, [mx, m, node]


def _sink_column(node: Node) -> Optional[Tuple[Node, List[Node]]]:
    """``cat([x, sinks], dim=-1)`` with a one-column ``sinks``: (x, [the cat]), else None."""
    if node.op != "call_function" or node.target not in (torch.cat, torch.concat) or node.kwargs.get("dim", (
            node.args[1] if len(node.args) > 1 else 0)) not in (-1, 3):
        return None
    parts = node.args[0]
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not all(isinstance(p, Node) for p in parts) \
            or not _shape_4d(parts[1]) or value(parts[1]).shape[-1] != 1 or not _only_user(parts[0], node):
        return None
    return parts[0], [node]


def _match(softmax: Node) -> Optional[EagerAttention]:
    added, pre = softmax.args[0], []
    sink = False
    if isinstance(added, Node) and _only_user(added, softmax):
        for form in (_row_max_subtracted, _sink_column):
            found = form(added)
            if found is not None:
                added, more = found
                pre = more + pre
                sink = sink or form is _sink_column
    if not isinstance(added, Node) or added.op != "call_function" or added.target not in _ADD \
            or len(added.args) != 2 or added.kwargs or len(added.users) != 1:
        return None
    for scores_side, mask in (added.args, added.args[::-1]):
        if not isinstance(scores_side, Node) or not isinstance(mask, Node):
            continue
        chain = [added]
        node: Optional[Node] = scores_side
        while node is not None and not (node.op == "call_function" and node.target in _MATMUL):
            if not _only_user(node, chain[-1]):
                node = None
                break
            chain.append(node)
            node = _score_wise(node)
        if node is None or not _only_user(node, chain[-1]) or not _shape_4d(node):
            continue
        m = value(mask)
        if not isinstance(m, torch.Tensor) or m.dim() != 4 or not m.is_floating_point():
            continue
        scores = node
        after = _weights_to_matmul(softmax, value(added).shape[-1] if sink else None)
        if after is None:
            return None
        out, tail = after
        if not _shape_4d(out) or value(out).shape[-2] != value(scores).shape[-2]:
            return None
        return EagerAttention(scores, out, mask, [scores, *chain[:0:-1], added, *pre, softmax, *tail, out],
                              chain[1:], pre, tail)
    return None


def _weights_to_matmul(softmax: Node, keys: Any = None) -> Optional[Tuple[Node, List[Node]]]:
    """From the softmax through casts and dropout to ``matmul(weights, v)``: (that matmul, the
    nodes between). ``keys``: where a sink column was added, the slice back to that many keys
    comes first."""
    tail: List[Node] = []
    node = softmax
    if keys is not None:
        (user,) = softmax.users if len(softmax.users) == 1 else (None,)
        if user is None or user.op != "call_function" or user.target is not operator.getitem \
                or not isinstance(user.args[1], tuple) or len(user.args[1]) != 2 or user.args[1][0] is not Ellipsis \
                or not isinstance(user.args[1][1], slice) or user.args[1][1].start not in (None, 0) \
                or user.args[1][1].step not in (None, 1) or not _shape_4d(user) or value(user).shape[-1] != keys:
            return None
        tail.append(user)
        node = user
    while True:
        users = list(node.users)
        if len(users) != 1:
            return None
        (user,) = users
        if user.op == "call_function" and user.target in _MATMUL and len(user.args) == 2 and user.args[0] is node \
                and not user.kwargs:
            return user, tail
        if _cast_of(user) is node or _is_dropout(user, node):
            tail.append(user)
            node = user
            continue
        return None


def _is_dropout(node: Node, x: Node) -> bool:
    return node.op == "call_function" and node.target is F.dropout and bool(node.args) and node.args[0] is x


def _dropout_inactive(node: Node) -> bool:
    """``F.dropout(x, p, training)`` that returns ``x``: ``p`` 0 or ``training`` False, as constants."""
    bound = dict(zip(("input", "p", "training", "inplace"), node.args), **node.kwargs)
    p, training = bound.get("p", 0.5), bound.get("training", True)
    return training is False or (isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0)


def _last_two_swapped(node: Node) -> bool:
    """``k.transpose(-2, -1)`` (or ``(2, 3)``) of a 4-d ``k``."""
    v = value(node)
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or node.kwargs:
        return False
    if node.op == "call_method" and node.target == "transpose" and len(node.args) == 3:
        dims = node.args[1:]
    elif node.op == "call_function" and node.target is torch.transpose and len(node.args) == 3:
        dims = node.args[1:]
    else:
        return False
    return isinstance(node.args[0], Node) and all(isinstance(d, int) for d in dims) and {d % 4 for d in dims} == {2, 3}


def _shape_4d(node: Node) -> bool:
    x = value(node)
    return isinstance(x, torch.Tensor) and x.dim() == 4
