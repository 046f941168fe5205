"""Padding elimination: token-wise work runs on real tokens only.

A batch padded to its longest sequence is half padding in DESIGN §7, and eager PyTorch runs every
projection, FFN, LayerNorm and residual add on the padding too. Right after the embeddings this pass
picks the real tokens (``attention_mask != 0``) as rows ``[tokens, hidden]`` and runs every op that
computes a row from the same row alone (``rows.row_inputs``) on them: Q/K/V and output projections
included. Attention runs on them too, sequence by sequence (``varlen.py``: each sequence's real
tokens are one contiguous block of rows; rotary embeddings between the head split and attention
run on the packed rows too). Only an attention that cannot (attention dropout, a mask that is more
than padding, q/k/v that are not a head split of the rows) still needs the
``[batch, seq]`` layout: its inputs are scattered back into zeros at the padding positions, and its
output is gathered again (``row_ops``: row copies whose backward is a row copy too). Rows that a
later op selects (the labelled positions of label sparsity, a classifier's ``h[:, 0]``) are taken
from the real tokens' rows directly, not re-padded first.

Why that is exact for the real tokens: a padding position reaches a real token only as an attention
key or value, and the attention mask gives those keys weight 0 (checked on the capturing batch by
evaluating the model's own mask). Between the re-padded rows and attention only layout ops and ops
that act on each position alone (``varlen.per_position_op``: rotary embeddings, whose cos/sin come
from outside the padded tensors) are accepted, and the layout must keep each row's features in the
last dim (checked with a probe), so no position reads another through them. The model's returned tensors that hold padding positions
(logits, hidden states, a key/value cache) are not computed in the step: they become deferred
tensors (passes/defer.py) that re-run the original dense ops on first read, so what the caller
sees is eager's everywhere, and a loop that reads only the loss pays nothing for them. A loss that reads a padding position (a label on a padding token) or a head that reads
one (``h[:, 0]`` under left padding) would differ from eager: the capturing batch is checked, and
the graph asserts it on every later batch, raising a clear error instead of a wrong number.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx
import torch.nn.functional as F

from ..options import Options
from ..torch_private import ASSERT_ASYNC, NN_SDPA
from ..runtime.step import PassReport, Plans
from ..runtime.varlen_attention import kernel_calls
from .batch_guard import GuardBuilder, counted_index
from .defer import defer_dense, feeds_resumed_code
from .label_sparsity import cross_entropy_args, unsupported_cross_entropy
from .density import ExampleSource, add_probe, density_reason
from .row_ops import put_rows, row_selection, take_rows
from .varlen import Attention, attention_on_real_tokens, mask_kind, per_position_op, sdpa_arguments
from .rows import (Node, _same, _same_shape, ancestors, attention_flops_at_capture, copy_on_rows, descendants,
                   features_split, flops_at_capture, heavy, op_name, row_inputs, run_node, same_shape_guarded,
                   topk_rows, value)
from . import eager_attention, expert_blocks

NAME = "padding_elimination"
_SDPA = {NN_SDPA, F.scaled_dot_product_attention}
# Ops that only move a tensor's elements around (or add nothing), between a padded tensor and attention.
_LAYOUT_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "split", "chunk", "unbind", "unflatten",
                   "expand"}
_ASSERT = "fxtrain padding_elimination: a label or a kept row sits on a padding position " \
          "(attention_mask == 0), which this rewrite does not compute; use Options(padding_elimination='off')"


def _masks_padding_keys(attn_mask: Any, tokens: torch.Tensor) -> bool:
    """Every real query gives weight 0 to every padding key: bool False, or an additive ``-inf`` or
    the dtype's lowest value (transformers' eager masks), after which ``exp`` is exactly 0."""
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dim() != 4:
        return False
    b, s = tokens.shape
    try:
        m = attn_mask.expand(b, attn_mask.shape[1], s, s)
    except RuntimeError:
        return False
    allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min
    real_q = tokens[:, None, :, None]
    pad_k = ~tokens[:, None, None, :]
    return not bool((allowed & real_q & pad_k).any())


def _token_mask(sdpas: List[Node], eager: List[eager_attention.EagerAttention], embeddings: List[Node],
                examples: ExampleSource) -> Tuple[Optional[Node], Optional[Any], str]:
    """The placeholder that marks real tokens, and how to read it: ``(node, padding_idx or None, why)``."""
    id_shapes = [value(e.args[0]).shape for e in embeddings]
    if sdpas or eager:
        masks = [n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) for n in sdpas] + \
            [block.mask for block in eager]
        if any(m is None for m in masks):
            return None, None, ("an attention has no mask: nothing marks padding tokens (each token attends "
                                "every token, or every earlier one, of its row)")
        common = set.intersection(*(ancestors(m) for m in masks))
        candidates = [n for n in common if n.op == "placeholder" and isinstance(value(n), torch.Tensor)
                      and value(n).dim() == 2 and not value(n).is_floating_point()
                      and any(same_shape_guarded(value(n).shape, s) for s in id_shapes)]
        candidates = [n for n in candidates if not _holds_more_than_a_mask(n, examples)]
        if len(candidates) != 1:
            return None, None, "no single [batch, seq] attention mask input gates every attention"
        return candidates[0], None, ""
    for e in embeddings:
        pad = e.args[2] if len(e.args) > 2 else e.kwargs.get("padding_idx")
        if isinstance(pad, int) and e.args[0].op == "placeholder":
            return e.args[0], pad, ""
    return None, None, "no attention mask and no embedding padding_idx marks the padding"


def _holds_more_than_a_mask(node: Node, examples: ExampleSource) -> bool:
    """A [batch, seq] integer input whose capturing values are not all 0/1 (``position_ids`` of a
    packed batch, which the document mask is built from) does not mark real tokens."""
    real = examples.value(node)
    return isinstance(real, torch.Tensor) and bool(((real != 0) & (real != 1)).any())


def _is_embedding_start(node: Node, lead_shape: Sequence[Any]) -> bool:
    if node.op != "call_function" or node.target is not F.embedding:
        return False
    ids = value(node.args[0])
    return isinstance(ids, torch.Tensor) and _same_shape(ids.shape, lead_shape)


def _layout_to_attention(node: Node, entries: Dict[Node, Tuple[int, ...]], seen: Optional[Set[Node]] = None,
                         chain: Optional["_Chain"] = None) -> bool:
    """``node``'s every use, through layout-only ops (and, given ``chain``, ops that act on each
    position alone: rotary embeddings), ends as attention's query, key or value: an argument of
    ``entries`` (attention node -> the positions of its q, k and v)."""
    seen = seen if seen is not None else set()
    for user in node.users:
        if user in seen:
            continue
        seen.add(user)
        if user.op == "output" or _returned_slice(user, node):
            continue  # a returned key/value cache: padding positions not computed, as for every output
        if user in entries:
            if not _enters_attention(node, user, entries):
                return False
            continue
        layout = (user.op == "call_method" and user.target in _LAYOUT_METHODS) or \
            (user.op == "call_function" and user.target is operator.getitem and isinstance(value(node), (tuple, list))) or \
            _new_axes(user, node) or _whole_slice(user, node) or _last_dim_chunks(user, node) or \
            (user.op == "call_function" and user.target is torch.cat and all(
                a is node or (isinstance(value(a), torch.Tensor) and value(a).numel() == 0) for a in user.args[0]))
        if not layout and chain is not None and per_position_op(user, chain.inside):
            if node not in chain.ops:
                chain.entries.add(node)
            chain.ops.add(user)
            layout = True
        if not layout or not _layout_to_attention(user, entries, seen, chain):
            return False
    return True


def _enters_attention(node: Node, user: Node, entries: Dict[Node, Tuple[int, ...]]) -> bool:
    """``user``, an attention of ``entries``, reads ``node`` as its q, k or v and as nothing else."""
    return any(i < len(user.args) and user.args[i] is node for i in entries[user]) \
        and not any(a is node for i, a in enumerate(user.args) if i not in entries[user]) \
        and node not in user.kwargs.values()


def _last_dim_chunks(user: Node, node: Node) -> bool:
    """``torch.chunk(x, n, dim=-1)`` or ``torch.split`` of the last dim (gpt-oss's rotary halves):
    each position's features stay at that position."""
    if user.op != "call_function" or user.target not in (torch.chunk, torch.split, torch.functional.split) \
            or not user.args or user.args[0] is not node:
        return False
    x = value(node)
    dim = user.kwargs.get("dim", user.args[2] if len(user.args) > 2 else 0)
    return isinstance(x, torch.Tensor) and isinstance(dim, int) and x.dim() > 0 and dim % x.dim() == x.dim() - 1


def _returned_slice(user: Node, node: Node) -> bool:
    """``node[:, :, -w:, :]`` read only by the graph's output: a sliding-window cache trimmed to its
    window on a sequence longer than it (gpt-oss's, Mistral's), returned and never attended here.
    Computed on first use from the dense graph, as every returned tensor that holds padding."""
    if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not node \
            or not isinstance(user.args[1], tuple):
        return False
    plain = all(i is Ellipsis or isinstance(i, slice) and all(v is None or isinstance(v, int)
                                                             for v in (i.start, i.stop, i.step)) for i in user.args[1])
    return plain and all(u.op == "output" for u in user.users)


def _new_axes(user: Node, node: Node) -> bool:
    """``node[:, :, None]``: an unsqueeze written as indexing (grouped-query attention's repeat_kv)."""
    if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not node \
            or not isinstance(user.args[1], tuple):
        return False
    return all(i is None or i is Ellipsis or i == slice(None) for i in user.args[1])


def _whole_slice(user: Node, node: Node) -> bool:
    """``node[:, :, -w:, :]`` that keeps every element: a sliding-window cache's trim of keys and
    values to the window (HF Mistral's ``DynamicSlidingWindowLayer``, returned as the cache), on a
    sequence no longer than the window. Shapes compared as the capture sees them: a symbolic
    sequence is guarded by dynamo to the side of the window it was captured on."""
    if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not node \
            or not isinstance(user.args[1], tuple):
        return False
    if not all(i is Ellipsis or (isinstance(i, slice) and i.step in (None, 1)) for i in user.args[1]):
        return False
    a, b = value(node), value(user)
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() \
        and all(_same(x, y) for x, y in zip(a.shape, b.shape))


class _Chain:
    """What a walk from the padded rows to attention met besides layout ops: ops that act on each
    position alone (``varlen.per_position_op``), and the tensors they start from."""

    def __init__(self, padded: Set[Node]) -> None:
        self.padded = padded          # every node computed from the padded region
        self.ops: Set[Node] = set()
        self.entries: Set[Node] = set()

    def inside(self, node: Any) -> bool:
        return isinstance(node, Node) and node in self.padded


def _features_last(gm: torch.fx.GraphModule, start: Node, lead: int, entries: Set[Node],
                   examples: ExampleSource) -> bool:
    """On the capturing batch's shapes, every ``entry`` (a layout of ``start``'s rows) keeps each
    row's features in its last dim, so that slicing that dim never mixes positions. Checked by
    running the layout ops on a probe whose values name their own row."""
    shape = [int(d.node.hint) if isinstance(d, torch.SymInt) and d.node.hint is not None else d
             for d in value(start).shape]
    if not all(isinstance(d, int) for d in shape):
        return False
    probe = torch.arange(math.prod(shape[:lead]), dtype=torch.float64,   # on the graph's device: see varlen._match
                         device=value(start).device).view(*shape[:lead], *[1] * (len(shape) - lead))
    env: Dict[Node, Any] = {start: probe.expand(shape).contiguous()}
    needed = ancestors(entries)
    for node in gm.graph.nodes:
        if node is start or node not in needed or not any(a in env for a in node.all_input_nodes):
            continue
        try:
            for a in node.all_input_nodes:
                if a not in env:
                    env[a] = examples.evaluate(gm, a)
            env[node] = run_node(node, env)
        except Exception:
            return False
    for e in entries:
        x = env.get(e)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not bool((x == x[..., :1]).all()):
            return False
    return True


class _Plan:
    def __init__(self, gm: torch.fx.GraphModule, examples: ExampleSource) -> None:
        self.gm, self.examples = gm, examples
        self._reached: Optional[Set[Node]] = None
        self.region: Dict[Node, int] = {}
        self.frontier: Dict[Node, int] = {}
        self.broadcast: Set[Node] = set()
        self.consumers: List[Tuple[Node, Node, str]] = []   # (region node, consumer, kind)
        self.flat: Any = None                                # batch * seq
        self.row_cuts: List[Node] = []  # row gathers (row_ops) of padded values: real rows asserted
        self.blocks: Dict[Node, expert_blocks.ExpertBlock] = {}   # a block's node -> its block
        self.attention_inputs: Dict[Node, Tuple[int, ...]] = {}    # SDPA or eager attention -> q/k/v positions

    def reached(self) -> Set[Node]:
        """Every node computed from the region (made once the region is final)."""
        if self._reached is None:
            self._reached = descendants(self.region)
        return self._reached

    def add(self, node: Node, lead: int, rows: List[Tuple[Node, int]], broadcast: Set[Node]) -> None:
        """Take ``node`` into the region; the row inputs it reads outside it join the frontier."""
        self.region[node] = lead
        for a, a_lead in rows:
            if a not in self.region:
                self.frontier.setdefault(a, a_lead)
        self.broadcast |= broadcast


def _plan(gm: torch.fx.GraphModule, lead_shape: Sequence[Any], examples: ExampleSource,
          attention_inputs: Dict[Node, Tuple[int, ...]]) -> Tuple[Optional[_Plan], str]:
    plan = _Plan(gm, examples)
    plan.attention_inputs = attention_inputs
    plan.flat = flat = math.prod(lead_shape)
    ends = {}
    for block in expert_blocks.find(gm):
        ends[block.out] = block
        plan.blocks.update((n, block) for n in block.nodes)
    for node in gm.graph.nodes:
        if _is_embedding_start(node, lead_shape):
            plan.region[node] = len(lead_shape)
            plan.frontier[node.args[0]] = len(lead_shape)
            continue
        if node in ends:   # a mixture of experts, one row op when every input it reads is token rows
            block = ends[node]
            if all(plan.region.get(i) == 1 and _same_shape(value(i).shape[:1], [flat]) for i in block.inputs):
                plan.region.update((n, 1) for n in block.nodes)
            continue
        inside = [a for a in node.all_input_nodes if a in plan.region]
        if not inside or node.op == "output" or node in plan.blocks:
            continue
        split = features_split(node) or topk_rows(node)
        if split is not None and split in plan.region and plan.region[split] < value(split).dim():
            plan.region[node] = plan.region[split]   # a tuple of row tensors, each taken by getitem
            continue
        if node.op == "call_function" and node.target is operator.getitem and \
                (features_split(node.args[0]) is not None or topk_rows(node.args[0]) is not None) \
                and node.args[0] in plan.region and isinstance(node.args[1], int):
            plan.region[node] = plan.region[node.args[0]]
            continue
        first = inside[0]
        out = value(node)
        if not isinstance(out, torch.Tensor):
            continue
        # The node's rows: as many leading dims as its features leave (an elementwise op, a flatten
        # of the rows), or its input's (a view or an index of the features alone: Gemma 4's
        # per-layer inputs, [B, S, L * D] -> [B, S, L, D] -> [B, S, D] at layer l).
        for lead in dict.fromkeys([out.dim() - (value(first).dim() - plan.region[first]), plan.region[first]]):
            broadcast: Set[Node] = set()
            rows = row_inputs(node, lead, broadcast, token_rows=True) if 1 <= lead <= out.dim() else None
            ok = rows is not None and (lead == 1 and _same_shape([out.shape[0]], [flat])
                                       or _same_shape(out.shape[:lead], lead_shape))
            if ok:
                listed = dict(rows)
                ok = all(listed.get(a) == plan.region[a] for a in inside)
            if ok:
                plan.add(node, lead, rows, broadcast)
                break
    _grow_upstream(plan, lead_shape)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in plan.region:
        for user in node.users:
            if user in plan.region:
                continue
            kind = _consumer_kind(node, user, plan, output)
            if kind is None:
                return None, f"padding rows reach {op_name(user)} ({user.name})"
            plan.consumers.append((node, user, kind))
    return plan, ""


def _grow_upstream(plan: _Plan, lead_shape: Sequence[Any]) -> None:
    """Pull row-wise producers that only the region reads into it (attention's output projection):
    the row gather then happens on their input, before the matmul, not after."""
    changed = True
    while changed:
        changed = False
        for f, f_lead in list(plan.frontier.items()):
            if f in plan.region or f.op not in ("call_function", "call_method") or not f.users \
                    or not all(u in plan.region for u in f.users):
                continue
            out = value(f)
            if not isinstance(out, torch.Tensor) or out.dim() < f_lead:
                continue
            want = list(lead_shape) if f_lead == len(lead_shape) else [plan.flat] if f_lead == 1 else None
            if want is None or not _same_shape(out.shape[:f_lead], want):
                continue
            broadcast: Set[Node] = set()
            rows = row_inputs(f, f_lead, broadcast, token_rows=True)
            if rows is None or not all(isinstance(value(a), torch.Tensor) for a, _ in rows):
                continue
            del plan.frontier[f]
            plan.add(f, f_lead, rows, broadcast)
            changed = True


def _consumer_kind(node: Node, user: Node, plan: _Plan, output: Node) -> Optional[str]:
    if user is output:
        return "output"
    if _layout_to_attention_from(node, user, plan):
        return "attention"
    lead = plan.region[node]
    if lead == 1 and _loss_on_rows(node, user):
        return "loss"
    if user.op == "call_method" and user.target == "flatten" and lead == 2 and tuple(user.args[1:]) == (0, 1) \
            and not user.kwargs and len(user.users) == 1:
        (sel,) = user.users
        if _gathers_from(sel, user):
            return "rows"
    if lead == 1 and _gathers_from(user, node):
        return "rows"
    if user.op == "call_function" and user.target is operator.getitem and lead == 2 and isinstance(user.args[1], tuple):
        index = user.args[1]
        if len(index) >= 2 and index[0] == slice(None) and isinstance(index[1], int):
            return "select"
    return None


def _gathers_from(sel: Node, src: Node) -> bool:
    found = row_selection(sel)
    return found is not None and found[0] is src


def _loss_on_rows(node: Node, user: Node) -> bool:
    """``cross_entropy(node, target)`` over the flattened tokens: rows whose target is ignored add
    nothing, so when every padding position is ignored the loss can run on the real rows alone."""
    bound = cross_entropy_args(user)
    if bound is None or bound.arguments["input"] is not node or unsupported_cross_entropy(bound):
        return False
    return not bound.arguments["label_smoothing"] and bound.arguments["target"] is not node


def _layout_to_attention_from(node: Node, user: Node, plan: "_Plan") -> bool:
    if user in plan.attention_inputs:
        return _enters_attention(node, user, plan.attention_inputs)
    layout = (user.op == "call_method" and user.target in _LAYOUT_METHODS)
    if not layout:
        return False
    chain = _Chain(plan.reached())
    if not _layout_to_attention(user, plan.attention_inputs, None, chain):
        return False
    return not chain.entries or _features_last(plan.gm, node, plan.region[node], chain.entries, plan.examples)


def padding_elimination(gm: torch.fx.GraphModule, examples: ExampleSource, options: Options,
                        plans: Plans) -> PassReport:
    if options.padding_elimination == "off":
        return PassReport(NAME, False, "off by option")
    graph = gm.graph
    embeddings = [n for n in graph.nodes if n.op == "call_function" and n.target is F.embedding
                  and isinstance(value(n.args[0]), torch.Tensor) and value(n.args[0]).dim() == 2]
    if not embeddings:
        return PassReport(NAME, False, "no [batch, seq] embedding lookup")
    sdpas = [n for n in graph.nodes if n.op == "call_function" and n.target in _SDPA]
    eager = eager_attention.find(gm)
    mask_node, pad_id, why = _token_mask(sdpas, eager, embeddings, examples)
    if mask_node is None:
        return PassReport(NAME, False, why)
    real = examples.value(mask_node)
    add_probe(gm, plans, "token density", mask_node, pad_id if pad_id is not None else 0)
    tokens = None if real is None else (real != (pad_id if pad_id is not None else 0))
    density = None if tokens is None else float(tokens.float().mean())
    on, reason = density_reason("token density", density, options.padding_elimination, options.sparsity_threshold)
    if not on:
        return PassReport(NAME, False, reason)
    if tokens is None:
        return PassReport(NAME, False, "the token mask of the capturing batch is not readable")
    kinds: Dict[Node, Optional[bool]] = {}   # attention -> causal (None: neither kind, stays padded)
    # Per mask, not per attention: the layers of a model share theirs, and reading one is a few
    # passes over [batch, heads, seq, seq] (BERT-base at 32 x 512: 0.05 s each on the CPU).
    read: Dict[Any, Tuple[bool, Optional[bool]]] = {}
    for sdpa in sdpas:
        attn_mask = sdpa_arguments(sdpa)["attn_mask"]
        if attn_mask not in read:
            evaluated = examples.evaluate(gm, attn_mask)
            hides = _masks_padding_keys(evaluated, tokens)
            read[attn_mask] = (hides, mask_kind(evaluated, tokens) if hides else None)
        hides_padding, kinds[sdpa] = read[attn_mask]
        if not hides_padding:
            return PassReport(NAME, False, f"the mask of {sdpa.name} lets real tokens attend to padding")
    for block in eager:   # attention in eager ops: as an SDPA where it computes one, else re-padded around
        if block.mask not in read:
            evaluated = examples.evaluate(gm, block.mask)
            hides = _masks_padding_keys(evaluated, tokens)
            read[block.mask] = (hides, mask_kind(evaluated, tokens) if hides else None)
        hides_padding, kinds[block.out] = read[block.mask]
        if not hides_padding:
            return PassReport(NAME, False, f"the mask of {block.out.name} lets real tokens attend to padding")
    lead_shape = value(mask_node).shape
    inputs = {n: (0, 1, 2) for n in sdpas}
    for block in eager:
        inputs.update(block.inputs())
    plan, why = _plan(gm, lead_shape, examples, inputs)
    if plan is None:
        return PassReport(NAME, False, why)
    matmuls = sum(1 for n in plan.region if heavy(n))
    if not matmuls:
        return PassReport(NAME, False, "no projection runs token by token")
    # What the rewrite skips on the capturing batch: the padding rows of every token-wise matmul, and
    # each attention's whole-row work beyond its sequences' own (measured after the rewrite: an
    # attention can stay over whole rows).
    real_share = float(tokens.float().mean())
    lengths = tokens.sum(1).tolist()
    within = sum(n * n for n in lengths) / (tokens.shape[0] * tokens.shape[1] ** 2)
    saved = round(sum(flops_at_capture(n) for n in plan.region) * (1 - real_share))
    attention = {n: attention_flops_at_capture(n) for n in sdpas}
    attention.update({b.out: flops_at_capture(b.scores) + flops_at_capture(b.out) for b in eager})
    padded = _padded_values(plan)
    output = next(n for n in graph.nodes if n.op == "output")
    if any(o in padded for o in output.all_input_nodes) and feeds_resumed_code(gm):
        return PassReport(NAME, False, f"returned tensors hold padding positions and {feeds_resumed_code(gm)}")
    problem = _check_capturing_batch(gm, plan, tokens)
    if problem:
        return PassReport(NAME, False, problem)
    deferred = defer_dense(gm, plans, padded)
    _erase_unused(gm, padded)
    plan.consumers = [c for c in plan.consumers if c[1].op != "output" and c[1] in gm.graph.nodes]
    index, packed_row = _rewrite(gm, plan, mask_node, pad_id, plans)
    # Read after the rewrite, which re-pads their inputs.
    attentions: Dict[Attention, Optional[bool]] = {}
    kept_eager = []
    blocks = {b.out: b for b in eager}
    for node, kind in kinds.items():
        if node not in gm.graph.nodes:
            continue
        if node not in blocks:
            attentions[Attention.of_sdpa(node)] = kind
            continue
        equivalent, why_not = blocks[node].sdpa_equivalent()
        if equivalent is None:
            kept_eager.append(f"{node.name}: attention in eager ops (matmul, softmax, matmul) runs on the padded "
                              f"layout: {why_not}")
        else:
            attentions[equivalent] = kind
    heads = {a.out: (value(a.args["query"]), value(a.args["value"])) for a in attentions}
    varlen, kept = attention_on_real_tokens(gm, plans, attentions, index, packed_row, set(plan.row_cuts), mask_node,
                                            pad_id or 0, tokens, examples.evaluate)
    saved += round(sum(f for n, f in attention.items() if n not in gm.graph.nodes) * (1 - within))
    note = f"; {deferred} returned tensor(s) that hold padding positions are computed on first use" if deferred else ""
    kept += kept_eager
    if attentions or kept_eager:
        note += f"; attention on real tokens, sequence by sequence: {varlen} of {len(attentions) + len(kept_eager)}"
        note += f" (re-padded: {kept[0]})" if kept else ""
    return PassReport(NAME, True, f"{reason}: {matmuls} matmul(s) on real tokens only{note}", saved_flops=saved,
                      attention_calls=varlen, attention_runs=sum(kernel_calls(*qv, lengths) for n, qv in heads.items()
                                                                 if n not in gm.graph.nodes))


def _erase_unused(gm: torch.fx.GraphModule, nodes: Set[Node]) -> None:
    """Drop what only fed the outputs ``defer_dense`` took out (a returned key/value cache, say)."""
    for node in reversed(list(gm.graph.nodes)):   # not what writes in place (a MoE's ``inv[perm] = arange(n)``)
        if node in nodes and not node.users and node.op in ("call_function", "call_method") and not node.is_impure() \
                and not str(getattr(node.target, "__name__", node.target)).endswith("_"):
            gm.graph.erase_node(node)


def _padded_values(plan: _Plan) -> Set[Node]:
    """Nodes whose values at padding positions the rewrite changes: all that the region reaches,
    except through a selection of real rows, which reads exact values. Row selections
    (``row_ops.row_selection`` over the flattened tokens) are recorded in ``plan.row_cuts``: that
    ``i`` only names real tokens is checked on the capturing batch and asserted on every batch."""
    cuts = {user for _, user, kind in plan.consumers if kind in ("select", "loss")}
    seen: Set[Node] = set()
    stack = list(plan.region)
    while stack:
        node = stack.pop()
        if node in seen or node in cuts:
            continue
        if node not in plan.region and _selects_token_rows(node, plan.flat) and row_selection(node)[0] in seen:
            if node not in plan.row_cuts:
                plan.row_cuts.append(node)
            continue
        seen.add(node)
        stack.extend(u for u in node.users if u.op != "output")
    return seen


def _selects_token_rows(node: Node, flat: Any) -> bool:
    found = row_selection(node)
    if found is None:
        return False
    src = found[0]
    if isinstance(value(src), torch.Tensor):
        return value(src).dim() >= 1 and _same_shape([value(src).shape[0]], [flat])
    # Inserted by an earlier pass, without metadata: ``flatten(x, 0, k)`` of a node that has it.
    if src.op == "call_method" and src.target == "flatten" and len(src.args) == 3 and src.args[1] == 0:
        x = value(src.args[0])
        if isinstance(x, torch.Tensor) and isinstance(src.args[2], int) and src.args[2] < x.dim():
            return _same_shape([math.prod(x.shape[:src.args[2] + 1])], [flat])
    return False


def _loss_on_real_rows(graph: torch.fx.Graph, ce: Node, rows: Node, index: Node, guard: "_Guard") -> None:
    bound = cross_entropy_args(ce)
    target, ignore = bound.arguments["target"], bound.arguments["ignore_index"]
    guard.labels_on_real_tokens(target, ignore, ce)
    with graph.inserting_before(ce):
        picked = graph.call_function(torch.index_select, (target, 0, index))
        loss = graph.call_function(F.cross_entropy, (), dict(bound.arguments, input=rows, target=picked))
    loss.meta = dict(ce.meta)
    ce.replace_all_uses_with(loss)
    graph.erase_node(ce)


def _check_capturing_batch(gm: torch.fx.GraphModule, plan: _Plan, tokens: torch.Tensor) -> str:
    flat = tokens.flatten()
    for sel in plan.row_cuts:
        index = plan.examples.evaluate(gm, row_selection(sel)[1])
        if index is None or not bool(flat[index].all()):
            return "the loss reads padding positions (labels on padding tokens)"
    for node, user, kind in plan.consumers:
        if kind == "loss":
            bound = cross_entropy_args(user)
            target = plan.examples.evaluate(gm, bound.arguments["target"])
            if target is None or not bool(((target == bound.arguments["ignore_index"]) | flat).all()):
                return "the loss has labels on padding positions"
        elif kind == "select":
            j = user.args[1][1]
            if not bool(tokens[:, j].all()):
                return f"the model keeps position {j}, which is padding in some rows"
    return ""


def _rewrite(gm: torch.fx.GraphModule, plan: _Plan, mask_node: Node, pad_id: Optional[int],
             plans: Plans) -> Tuple[Node, Callable[[], Node]]:
    """Rewrite the plan's region onto packed real tokens; returns the node of their flat positions,
    and a function giving the node of each flat position's packed row (made on first call)."""
    graph = gm.graph
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        valid = graph.call_function(torch.ne, (graph.call_method("flatten", (mask_node,)), pad_id or 0))
        index = counted_index(gm, plans, valid)  # sized by the batch guard's read-ahead count: no sync of its own
        sizes = [graph.call_method("size", (mask_node, d)) for d in range(value(mask_node).dim())]
        n_flat = sizes[0]
        for s in sizes[1:]:
            n_flat = graph.call_function(operator.mul, (n_flat, s))
    rows: Dict[Node, Node] = {}
    guard = _Guard(gm, plans, mask_node, pad_id or 0, valid)
    packed: List[Node] = []

    def packed_row() -> Node:
        """Each position's row in the packed layout (the number of real tokens before it), computed
        once, where the selection of real tokens is."""
        if not packed:
            with graph.inserting_before(first):
                packed.append(graph.call_function(operator.sub, (graph.call_function(torch.cumsum, (valid, 0)), 1)))
        return packed[0]

    def gathered(node: Node, lead: int) -> Node:
        if node not in rows:
            if node in plan.broadcast:
                rows[node] = _broadcast_rows(graph, node, lead, index, sizes if lead == len(sizes) else [n_flat])
            else:
                flat = node if lead == 1 else graph.call_method("flatten", (node, 0, lead - 1))
                rows[node] = take_rows(graph, flat, index, value(node), lead)
        return rows[node]

    for node in list(graph.nodes):
        if node not in plan.region:
            continue
        lead = plan.region[node]
        with graph.inserting_before(node):
            for a in node.all_input_nodes:
                if a in plan.frontier and a not in plan.region:
                    gathered(a, plan.frontier[a])
            block = plan.blocks.get(node)
            rows[node] = block.copy(graph, node, rows) if block else copy_on_rows(graph, node, rows, lead)
    cut_index = {sel: row_selection(sel)[1] for sel in plan.row_cuts}
    moved: Dict[Node, Node] = {}   # a row selection of padded values -> the same rows taken from the packed layout
    repadded: Dict[Node, Node] = {}
    for node, user, kind in plan.consumers:
        lead = plan.region[node]
        if kind == "loss":
            _loss_on_real_rows(graph, user, rows[node], index, guard)
            continue
        if kind == "rows":
            # Labelled rows of the padded layout are rows of the packed one: take them there, at
            # their packed positions, instead of re-padding everything to pick a few rows back.
            sel = next(iter(user.users)) if user.op == "call_method" else user
            with graph.inserting_before(sel):
                at = graph.call_function(torch.index_select, (packed_row(), 0, row_selection(sel)[1]))
                moved[sel] = take_rows(graph, rows[node], at, value(node), lead)
            sel.replace_all_uses_with(moved[sel])
            graph.erase_node(sel)
            if user is not sel and not user.users:
                graph.erase_node(user)
            continue
        j = user.args[1][1] if kind == "select" else None
        if kind == "select" and all(i == slice(None) for i in user.args[1][2:]):
            # h[:, j]: one row per sequence, taken from the packed layout.
            with graph.inserting_before(user):
                at = graph.call_function(operator.getitem, (graph.call_method("view", (packed_row(), *sizes)),
                                                            (slice(None), j)))
                taken = take_rows(graph, rows[node], at, value(node), lead)
            user.replace_all_uses_with(taken)
            graph.erase_node(user)
            guard.position_is_real(j, taken, sizes)
            continue
        if node not in repadded:
            feat = list(value(node).shape[lead:])
            with graph.inserting_before(user):
                full = put_rows(graph, rows[node], index, n_flat, value(node), lead)
                repadded[node] = full if lead == 1 else graph.call_method("view", (full, *sizes, *feat))
        user.replace_input_with(node, repadded[node])
        if kind == "select":
            guard.position_is_real(j, user, sizes)
    for sel in plan.row_cuts:
        guard.rows_are_real(cut_index[sel], moved.get(sel, sel))
    for node in reversed(list(graph.nodes)):
        if node in plan.region and not node.users:
            graph.erase_node(node)
    guard.store(plans)
    return index, packed_row


def _broadcast_rows(graph: torch.fx.Graph, node: Node, lead: int, index: Node, lead_sizes: List[Any]) -> Node:
    """The real tokens' rows of ``node``, an operand broadcast over the tokens (a ``[1, seq, hidden]``
    position embedding): gathered from ``node`` itself, at each token's row of it (its position in the
    sequence, say), not from a ``[batch * seq, hidden]`` expanded copy. The backward then sums into
    ``node``'s own few rows instead of zero-filling and reducing a padded gradient."""
    shape = value(node).shape[:lead]

    def times(a: Any, b: Any) -> Any:
        return b if isinstance(a, int) and a == 1 else graph.call_function(operator.mul, (a, b))

    row: Optional[Node] = None
    outer: Any = 1   # size of the dims of lead_sizes after d (a flat position's stride along d)
    own: Any = 1     # the same over node's own (unbroadcast) dims
    for d in reversed(range(lead)):
        if not _same(shape[d], 1):
            coord = index if isinstance(outer, int) and outer == 1 else \
                graph.call_function(torch.div, (index, outer), {"rounding_mode": "floor"})
            if d > 0:
                coord = graph.call_function(torch.remainder, (coord, lead_sizes[d]))
            term = coord if isinstance(own, int) and own == 1 else graph.call_function(torch.mul, (coord, own))
            row = term if row is None else graph.call_function(torch.add, (row, term))
            if d > 0:
                own = times(own, lead_sizes[d])
        if d > 0:
            outer = times(outer, lead_sizes[d])
    if row is None:   # broadcast along every leading dim: every token reads the one row
        row = graph.call_function(torch.zeros_like, (index,))
    src = node if lead == 1 else graph.call_method("flatten", (node, 0, lead - 1))
    return take_rows(graph, src, row, value(node), lead)


class _Guard:
    """What the rewrite assumes of every batch: labels and kept rows sit on real tokens.

    Each condition goes to the batch guard (checked before the step; a batch that fails runs the
    graph without the passes). A condition the guard cannot hold (its inputs come from an impure
    computation) stays in the graph as an assertion: an error, never a different number.
    """

    def __init__(self, gm: torch.fx.GraphModule, plans: Plans, mask: Node, pad: int, valid: Node) -> None:
        self.gm, self.valid, self.seen = gm, valid, set()
        self.builder = GuardBuilder.of(gm, plans)  # the guard an earlier selection (counted_index) stored
        g_mask = self.builder.node(mask)
        self.g_real = self.builder.call(torch.ne, g_mask, pad)
        self.g_valid = self.builder.call("flatten", self.g_real, method=True)

    def _require(self, make: Any, fallback: Any, at: Node, reason: str) -> None:
        ok = make()
        if ok is not None:
            self.builder.require(ok, reason)
            return
        graph = self.gm.graph
        with graph.inserting_before(at):
            graph.call_function(ASSERT_ASYNC, (fallback(graph), _ASSERT))

    def labels_on_real_tokens(self, target: Node, ignore: int, at: Node) -> None:
        b = self.builder

        def make() -> Optional[Node]:
            t = b.node(target)
            return None if t is None else b.call("all", b.call(torch.logical_or, b.call(torch.eq, t, ignore),
                                                               self.g_valid), method=True)

        def fallback(graph: torch.fx.Graph) -> Node:
            return graph.call_method("all", (graph.call_function(torch.logical_or, (graph.call_function(
                torch.eq, (target, ignore)), self.valid)),))
        self._require(make, fallback, at, "a label sits on a padding position")

    def rows_are_real(self, index: Node, at: Node) -> None:
        if index in self.seen:
            return
        self.seen.add(index)
        b = self.builder
        selected = b.selections.get(index)  # index = nonzero(selected): no selection needed to check it

        def make() -> Optional[Node]:
            if selected is not None:
                s = b.node(selected)  # every selected row is real: valid | ~selected everywhere
                return None if s is None else b.call("all", b.call(torch.logical_or, self.g_valid,
                                                                   b.call(torch.logical_not, s)), method=True)
            i = b.node(index)
            return None if i is None else b.call("all", b.call(torch.index_select, self.g_valid, 0, i), method=True)

        def fallback(graph: torch.fx.Graph) -> Node:
            return graph.call_method("all", (graph.call_function(torch.index_select, (self.valid, 0, index)),))
        self._require(make, fallback, at, "a label sits on a padding position")

    def position_is_real(self, j: int, at: Node, sizes: List[Node]) -> None:
        b = self.builder

        def make() -> Node:
            return b.call("all", b.call(operator.getitem, self.g_real, (slice(None), j)), method=True)

        def fallback(graph: torch.fx.Graph) -> Node:
            return graph.call_method("all", (graph.call_function(operator.getitem, (
                graph.call_method("view", (self.valid, *sizes)), (slice(None), j))),))
        self._require(make, fallback, at, f"the model keeps position {j}, which is padding in some rows")

    def store(self, plans: Plans) -> None:
        self.builder.store(plans)
